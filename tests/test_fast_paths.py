"""The recorder's short paths for what loading a checkpoint does to each tensor: views of
deferred tensors answered at the torch-function level, calls on PyTorch's own meta tensors run
without the dispatch mode, and one header check per file in a materialize. Each must give what
the general path gives."""

from __future__ import annotations

import pytest
import torch
from _twins import eager_and_deferred
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from jupyter_metainit import is_deferred, materialize, meta_init


def test_a_write_through_each_kind_of_view_lands_on_the_base():
    def build():
        t = torch.randn(4, 6)
        t.view(6, 4)[0].fill_(1.0)
        t.reshape(24)[5:7].mul_(3.0)
        t[..., 1].add_(2.0)
        t.detach().t()[2].zero_()
        t.view(torch.int32)[3, 0].fill_(7)
        return t

    eager, deferred = eager_and_deferred(build)
    materialize(deferred)
    assert torch.equal(deferred, eager)


def _reshape_that_must_copy():
    t = torch.randn(4, 6)
    flat = t.t().reshape(-1)  # not viewable: a copy
    flat.fill_(0.0)
    return t, flat


def _advanced_index():
    t = torch.randn(5, 3)
    rows = t[[0, 2]]
    rows.fill_(1.0)
    return t, rows


@pytest.mark.parametrize("build", [_reshape_that_must_copy, _advanced_index])
def test_a_view_method_that_must_copy_is_a_copy(build):
    (eager, eager_copy), (deferred, copy) = eager_and_deferred(build)
    assert copy._rec.storage is not deferred._rec.storage
    materialize([deferred, copy])
    assert torch.equal(deferred, eager) and torch.equal(copy, eager_copy)


def test_views_require_grad_as_eager_views_do():
    with meta_init():
        p = torch.nn.Parameter(torch.randn(4, 6))
        viewed, detached, cast = p.view(24), p.detach(), p.view(torch.int32)
    eager = torch.nn.Parameter(torch.randn(4, 6))
    assert viewed.requires_grad == eager.view(24).requires_grad
    assert detached.requires_grad == eager.detach().requires_grad
    assert cast.requires_grad == eager.view(torch.int32).requires_grad


def test_views_made_under_no_grad_require_grad_as_eagers_do():
    # Eager: a view of a tensor that requires grad requires grad also when made under no_grad
    # (a leaf then, without grad_fn); a detach never does.
    def views(p):
        with torch.no_grad():
            v, row, flat = p.view(24), p[0], p.reshape(-1)
            return [v.requires_grad, v.is_leaf, row.requires_grad, flat.requires_grad,
                    p.detach().requires_grad]  # fmt: skip

    with meta_init():
        deferred = torch.nn.Parameter(torch.randn(4, 6))
        inside = views(deferred)
    assert inside == views(deferred) == views(torch.nn.Parameter(torch.randn(4, 6)))


def test_a_dispatch_mode_inside_meta_init_still_sees_each_view():
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with meta_init():
        t = torch.randn(4, 6)
        with Log():
            v = t.view(6, 4)
    assert torch.ops.aten.view.default in seen
    assert is_deferred(v)


def test_views_and_inits_of_meta_tensors_stay_meta_and_draw_nothing():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with meta_init(), torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(8, 4))
        torch.nn.init.kaiming_uniform_(p, a=5**0.5)
        torch.nn.init.normal_(p, std=0.02)
        d = p.detach()
    assert type(p) is torch.nn.Parameter and p.is_meta and p.requires_grad
    assert type(d) is torch.Tensor and d.is_meta and not d.requires_grad
    assert torch.equal(torch.get_rng_state(), state)


def test_an_init_function_on_a_deferred_tensor_is_still_recorded():
    def build():
        with torch.device("meta"):
            meta = torch.empty(3)
        w = torch.empty(8, 4)
        torch.nn.init.kaiming_uniform_(w, a=5**0.5)
        torch.nn.init.zeros_(meta)  # a meta tensor beside it changes nothing
        return w

    eager, deferred = eager_and_deferred(build)
    materialize(deferred)
    assert torch.equal(deferred, eager)


@pytest.mark.parametrize("n", [8])
def test_a_materialize_reads_each_files_header_once(tmp_path, n):
    tensors = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(n)}  # 1 MiB each: mapped
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    from safetensors.torch import load_file

    with meta_init():
        loaded = load_file(str(path))
    before = _read_bytes()
    materialize(list(loaded.values()))
    read = _read_bytes() - before
    assert read < 2 * (64 << 10)  # one 64 KiB header, not one per tensor
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _mappings_of(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(str(path)))


def test_a_file_read_inside_a_block_stays_mapped_until_the_block_ends(tmp_path):
    # The storage last found in a mapping is held (its mapping cannot go, nor its addresses be
    # taken by another file), so the other tensors of the file skip the map_files check; it is
    # let go when the outermost block ends.
    from safetensors import safe_open

    from jupyter_metainit.core.record.dispatch import file_memory

    tensors = {f"w{i}": torch.full((1 << 16,), float(i)) for i in range(3)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    with meta_init():
        with meta_init(), safe_open(str(path), framework="pt") as f:
            loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert file_memory._held is not None  # the inner block is not the outermost
    assert file_memory._held is None
    import gc

    gc.collect()
    assert _mappings_of(path) == 0  # nothing keeps the reader's mapping after the block
    materialize(list(loaded.values()))
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_another_file_mapped_where_a_closed_one_was_is_found_as_that_file(tmp_path):
    # Between blocks nothing is held: a new file over the same addresses is looked up again.
    from safetensors import safe_open

    paths = []
    for i in range(2):
        path = tmp_path / f"w{i}.safetensors"
        save_file({"w": torch.full((1 << 16,), float(i))}, str(path))
        paths.append(path)
    loaded = []
    for path in paths:
        with meta_init(), safe_open(str(path), framework="pt") as f:
            loaded.append(f.get_tensor("w"))
    materialize(loaded)
    assert [float(t[0]) for t in loaded] == [0.0, 1.0]
