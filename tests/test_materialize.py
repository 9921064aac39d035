"""materialize / dematerialize: in place, exact, selective, safe on failure."""

from __future__ import annotations

import collections
import dataclasses
import gc
import types
import weakref

import pytest
import torch
from _twins import assert_same, eager_and_deferred
from torch import nn

from jupyter_metainit import (
    clear_meta_init_cache,
    dematerialize,
    is_deferred,
    materialize,
    meta_init,
)
from jupyter_metainit.core import tensor_state, tensor_values
from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.replay import planning


class Net(nn.Module):
    def __init__(self, n: int = 4, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(32, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.linspace(0, 1, width), persistent=False)
        self.head = nn.Linear(width, 32, bias=False)
        self.head.weight = self.emb.weight


def test_every_reference_sees_the_real_tensor():
    eager, m = eager_and_deferred(Net)
    w = m.layers[0].weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    materialize(m)
    assert w is m.layers[0].weight and not is_deferred(w)
    assert opt.param_groups[0]["params"][1] is w
    assert torch.equal(w, eager.layers[0].weight)


def test_parameter_stays_parameter_and_keeps_requires_grad():
    with meta_init():
        m = nn.Linear(3, 3)
    m.bias.requires_grad_(False)
    materialize(m)
    assert type(m.weight) is nn.Parameter and m.weight.requires_grad
    assert type(m.bias) is nn.Parameter and not m.bias.requires_grad


def test_tied_weights_stay_one_object_and_non_persistent_buffers_materialize():
    eager, m = eager_and_deferred(Net)
    materialize(m)
    assert m.head.weight is m.emb.weight
    assert torch.equal(m.scale, eager.scale)
    assert_same(eager, m)


def test_materialized_model_trains():
    _, m = eager_and_deferred(Net)
    materialize(m)
    out = m.head(m.norm(m.layers[0](m.emb(torch.tensor([1, 2])))))
    out.sum().backward()
    assert m.layers[0].weight.grad is not None


def test_global_rng_state_is_untouched():
    with meta_init():
        m = Net()
    state = torch.get_rng_state()
    materialize(m.layers[2])
    materialize(m)
    assert torch.equal(state, torch.get_rng_state())


def test_subtree_in_any_order_equals_whole_model():
    eager, m = eager_and_deferred(lambda: Net(n=6))
    materialize(m.layers[4])
    assert is_deferred(m.layers[1]) and not is_deferred(m.layers[4])
    materialize([m.head, m.layers[0]])
    materialize(m.layers[5].bias)
    materialize(m)
    assert_same(eager, m)


def test_only_the_dependency_closure_is_replayed():
    with meta_init():
        m = Net(n=8)
    whole = len(planning.plan([t._rec for t in [*m.parameters(), *m.buffers()]]))
    one = len(planning.plan([m.layers[3].weight._rec, m.layers[3].bias._rec]))
    # a Linear layer: two empty() and their init ops (uniform_ x2 ...), never the other layers
    assert one <= whole / 6
    ops = planning.plan([m.layers[3].weight._rec]).ops
    # kaiming_uniform_'s uniform_ only: it overwrites all of `empty`, which is not replayed
    assert [op.func for op in ops] == [torch.ops.aten.uniform_.default]


def test_recording_is_freed_after_whole_model_materialization():
    with meta_init():
        m = Net()
    storage_ref = weakref.ref(m.layers[0].weight._rec.storage)
    op_ref = weakref.ref(m.layers[0].weight._rec.storage.writes[0])
    materialize(m)
    gc.collect()
    assert storage_ref() is None and op_ref() is None


def test_keep_cache_then_dematerialize_round_trip():
    eager, m = eager_and_deferred(Net)
    layer = m.layers[1]
    materialize(layer, keep_cache=True)
    first = layer.weight.detach().clone()
    dematerialize(layer)
    assert is_deferred(layer.weight) and layer.weight.shape == (16, 16)
    materialize(layer)
    assert torch.equal(layer.weight, first)
    assert torch.equal(layer.weight, eager.layers[1].weight)


def test_dematerialize_refuses_changed_tensors_without_force():
    with meta_init():
        m = nn.Linear(3, 3)
    materialize(m, keep_cache=True)
    with torch.no_grad():
        m.weight.add_(1)
    with pytest.raises(MaterializationError, match="force=True"):
        dematerialize(m)
    assert not is_deferred(m.weight)
    dematerialize(m, force=True)
    assert is_deferred(m.weight)


def test_dematerialize_without_keep_cache_is_a_clear_error():
    with meta_init():
        t = torch.ones(2)
    materialize(t)
    with pytest.raises(MaterializationError, match="keep_cache=True"):
        dematerialize(t)


def test_clear_meta_init_cache_drops_dematerialization_shadows():
    with meta_init():
        t = torch.ones(2)
    materialize(t, keep_cache=True)
    clear_meta_init_cache()
    with pytest.raises(MaterializationError):
        dematerialize(t)


def test_not_a_tensor_or_module_is_a_type_error():
    with pytest.raises(TypeError, match="tensor, a module"):
        materialize("model")
    with pytest.raises(TypeError):
        materialize([torch.ones(1), 3])


def test_bad_device_and_bad_rng_leave_everything_deferred():
    with meta_init():
        m = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not a device"):
        materialize(m, device="gpu7")
    with pytest.raises(ValueError, match="rng"):
        materialize(m, rng="random")
    if not torch.cuda.is_available():
        with pytest.raises(MaterializationError, match="CUDA is not available"):
            materialize(m, device="cuda:0")
    assert is_deferred(m.weight) and is_deferred(m.bias)
    materialize(m)
    assert not is_deferred(m)


def test_interrupt_during_replay_leaves_nothing_half_made():
    eager, m = eager_and_deferred(Net)
    calls = []

    def interrupt(done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        materialize(m, progress=interrupt)
    assert all(is_deferred(t) for t in [*m.parameters(), *m.buffers()])
    materialize(m)
    assert_same(eager, m)


def test_progress_reports_bytes_up_to_total():
    with meta_init():
        m = nn.Linear(64, 64)
    seen = []
    materialize(m, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] >= 64 * 64 * 4
    assert all(d <= t for d, t in seen)


def test_cuda_recorded_model_materializes_to_cpu_when_asked():
    # with a GPU present, eager draws on it (test_cuda.py); without one, from the CPU stream
    eager, m = eager_and_deferred(nn.Linear, 4, 4, device="cuda")
    assert m.weight.device.type == "cuda"
    materialize(m, device="cpu")
    assert m.weight.device == torch.device("cpu")
    assert torch.equal(m.weight, eager.weight.cpu())


def test_cuda_recorded_tensor_without_gpu_says_what_to_do():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with meta_init(device="cuda:0"):
        t = torch.ones(2)
    with pytest.raises(MaterializationError, match="device='cpu'"):
        materialize(t)
    assert is_deferred(t)


def test_dtype_at_materialization():
    eager, m = eager_and_deferred(lambda: nn.Linear(4, 4))
    materialize(m, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    assert torch.equal(m.weight, eager.weight.to(torch.bfloat16))


def test_tensor_state():
    with meta_init():
        m = nn.Linear(2, 2)
    assert tensor_state(m.weight) == "deferred"
    materialize(m.weight)
    assert tensor_state(m.weight) == "cpu"


def test_user_attributes_on_tensors_survive():
    with meta_init():
        m = nn.Linear(2, 2)
    m.weight._is_hf_initialized = True
    materialize(m)
    assert m.weight._is_hf_initialized is True


def test_dematerialize_a_module_without_keep_cache_changes_nothing_and_says_why():
    with meta_init():
        m = nn.Linear(3, 3)
    materialize(m)
    with pytest.raises(MaterializationError, match="keep_cache=True"):
        dematerialize(m)
    assert not is_deferred(m.weight)


def test_dematerialize_frees_the_memory():
    with meta_init():
        m = nn.Linear(1024, 1024)
    materialize(m, keep_cache=True)
    storage = m.weight.untyped_storage()
    ref = weakref.ref(storage)
    del storage
    dematerialize(m)
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "write",
    [
        lambda w: w.data.copy_(torch.ones_like(w)),
        lambda w: w.detach().zero_(),
        lambda w: w.detach().numpy().__setitem__((0, 0), 9.0),
    ],
    ids=["data_copy", "detach", "numpy_view"],
)
def test_dematerialize_sees_writes_the_version_counter_misses(write):
    _, m = eager_and_deferred(Net)
    materialize(m, keep_cache=True)
    write(m.layers[0].weight)
    with pytest.raises(MaterializationError, match="written since"):
        dematerialize(m)
    assert not is_deferred(m.layers[0].weight)  # nothing changed
    dematerialize(m, force=True)
    assert is_deferred(m)


def test_a_list_with_plain_meta_tensors_materializes_nothing():
    with meta_init():
        deferred = nn.Linear(2, 2)
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(MaterializationError, match="meta device"):
        materialize([deferred, meta])
    assert is_deferred(deferred.weight) and is_deferred(deferred.bias)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": torch.int8}, ValueError, "not a floating-point dtype"),
        ({"dtype": "bf17"}, ValueError, "is not a dtype"),
        ({"device": "xla"}, MaterializationError, "no xla device"),
        ({"device": "mps"}, MaterializationError, "no mps device"),
        ({"device": "warp:3"}, ValueError, "not a device"),
    ],
    ids=["int8", "string_dtype", "xla", "mps", "nonsense"],
)
def test_bad_arguments_are_clear_errors(kwargs, error, match):
    _, m = eager_and_deferred(Net)
    with pytest.raises(error, match=match):
        materialize(m, **kwargs)
    assert is_deferred(m)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_cuda_and_out_of_range_devices_say_what_exists():
    _, m = eager_and_deferred(Net)
    with pytest.raises(MaterializationError, match="CUDA is not available"):
        materialize(m, "cuda:999")
    assert is_deferred(m)


def test_state_changes_are_published():
    from jupyter_metainit.core.runtime import events

    seen = []

    def listener(kind, tensors):
        seen.append((kind, len(tensors)))

    events.subscribe(listener)
    _, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    dematerialize(m.layers[0])
    assert seen[-2:] == [("materialized", 2), ("dematerialized", 2)]


def test_materializing_again_with_a_dtype_casts_the_real_parts_in_place():
    eager, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    w = m.layers[0].weight
    materialize(m, dtype=torch.bfloat16)
    assert w is m.layers[0].weight and w.dtype == torch.bfloat16
    assert isinstance(w, nn.Parameter) and w.requires_grad
    assert torch.equal(w, eager.layers[0].weight.to(torch.bfloat16))
    assert m.head.weight is m.emb.weight and m.emb.weight.dtype == torch.bfloat16


def test_a_cast_real_part_is_freed_as_the_cast_values():
    eager, m = eager_and_deferred(Net)
    materialize(m.layers[1], keep_cache=True)
    materialize(m.layers[1], dtype=torch.float16)
    dematerialize(m.layers[1])  # the cast was ours: its recording is kept
    assert is_deferred(m.layers[1].weight) and m.layers[1].weight.dtype == torch.float16
    materialize(m.layers[1])
    assert torch.equal(m.layers[1].weight, eager.layers[1].weight.to(torch.float16))


def test_materializing_real_parts_to_another_device_moves_them_in_place():
    _, m = eager_and_deferred(Net)
    materialize(m.norm)
    bias = m.norm.bias
    materialize(m.norm, torch.device("cpu"), dtype=torch.float64)
    assert bias is m.norm.bias and bias.dtype == torch.float64 and tensor_state(bias) == "cpu"


# What dematerialize keeps is the truth: checked when freeing, named, kept as set.


def test_train_then_cast_in_place_is_refused_by_name_without_force():
    _, m = eager_and_deferred(Net)
    materialize(m, keep_cache=True)
    with torch.no_grad():
        m.layers[3].weight.add_(1)  # training
    materialize(m, dtype=torch.bfloat16)  # the widget's "Materialize -> CPU as bfloat16"
    with pytest.raises(MaterializationError, match=r"1 tensor.*layers\.3\.weight .*force=True"):
        dematerialize(m)
    assert not is_deferred(m.layers[3].weight) and not is_deferred(m.layers[0].weight)


def test_a_cast_of_a_trained_tensor_is_not_stamped_as_unchanged_even_with_the_same_values():
    _, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    w = m.layers[0].weight
    w.data = w.data.clone()  # same values, other memory: no longer the recorded tensor
    materialize(m.layers[0], dtype=torch.float16)
    with pytest.raises(MaterializationError, match="weight"):
        dematerialize(m.layers[0])


def test_weights_loaded_by_reference_whose_source_trained_on_are_refused():
    source = nn.Linear(1024, 512)  # 2 MiB: kept by reference in the recording, not copied
    with meta_init():
        m = nn.Linear(1024, 512)
        m.load_state_dict(source.state_dict())
    materialize(m, keep_cache=True)
    with torch.no_grad():
        source.weight.add_(1)  # the other model keeps training
    with pytest.raises(MaterializationError, match=r"weight was computed from a real tensor"):
        dematerialize(m)
    assert not is_deferred(m.weight) and not is_deferred(m.bias)


def test_weights_loaded_by_reference_from_an_unchanged_source_free_and_come_back():
    source = nn.Linear(1024, 512)
    with meta_init():
        m = nn.Linear(1024, 512)
        m.load_state_dict(source.state_dict())
    materialize(m, keep_cache=True)
    dematerialize(m)
    materialize(m)
    assert torch.equal(m.weight, source.weight) and torch.equal(m.bias, source.bias)


def test_a_refusal_names_every_changed_tensor_by_its_qualified_name():
    _, m = eager_and_deferred(Net)
    materialize(m, keep_cache=True)
    with torch.no_grad():
        m.layers[2].bias.add_(1)
        m.norm.weight.mul_(2)
    with pytest.raises(MaterializationError, match=r"layers\.2\.bias.*norm\.weight"):
        dematerialize(m)


def test_a_move_then_free_gives_the_moved_values_back():
    eager, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    materialize(m.layers[0], "cpu", dtype=torch.float64)
    dematerialize(m.layers[0])
    materialize(m.layers[0])
    assert m.layers[0].weight.dtype == torch.float64
    assert torch.equal(m.layers[0].weight, eager.layers[0].weight.double())


def test_free_then_materialize_keeps_requires_grad_false():
    _, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    m.layers[0].weight.requires_grad_(False)
    dematerialize(m.layers[0])
    assert not m.layers[0].weight.requires_grad
    materialize(m.layers[0])
    assert not m.layers[0].weight.requires_grad and isinstance(m.layers[0].weight, nn.Parameter)


def test_free_then_materialize_keeps_attributes_set_on_the_tensor():
    _, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    m.layers[0].weight.my_tag = 1
    dematerialize(m.layers[0])
    materialize(m.layers[0])
    assert m.layers[0].weight.my_tag == 1


def test_free_then_materialize_keeps_backward_hooks_and_their_handles():
    _, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    seen = []
    handle = m.layers[0].weight.register_hook(lambda g: seen.append("hook"))
    m.layers[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    dematerialize(m.layers[0])
    materialize(m.layers[0])
    m.layers[0](torch.ones(2, 16)).sum().backward()
    assert seen == ["hook", "post"]
    handle.remove()
    m.layers[0](torch.ones(2, 16)).sum().backward()
    assert seen == ["hook", "post", "post"]


def test_free_then_materialize_keeps_a_parameter_subclass():
    _, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    w = m.layers[0].weight
    w.__class__ = TaggedParameter  # as a quantization or sharding library does
    dematerialize(m.layers[0])
    materialize(m.layers[0])
    assert type(m.layers[0].weight) is TaggedParameter and m.layers[0].weight is w


def test_torch_save_after_keep_cache_loads_with_weights_only_and_without_this_package(tmp_path):
    import subprocess
    import sys

    _, m = eager_and_deferred(Net)
    materialize(m, keep_cache=True)
    torch.save(m.layers[0].weight, tmp_path / "param.pt")
    torch.save(m.state_dict(keep_vars=True), tmp_path / "state.pt")
    for name in ("param.pt", "state.pt"):
        torch.load(tmp_path / name)  # weights_only=True by default
    code = (
        "import sys; sys.modules['jupyter_metainit'] = None\n"  # not importable
        "import torch\n"
        f"p = torch.load({str(tmp_path / 'param.pt')!r}, weights_only=False)\n"
        f"s = torch.load({str(tmp_path / 'state.pt')!r})\n"
        "assert isinstance(p, torch.nn.Parameter) and not p.__dict__, p.__dict__\n"
        "assert all(not v.__dict__ for v in s.values())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert torch.equal(torch.load(tmp_path / "param.pt"), m.layers[0].weight)


class Tables(nn.Module):
    """Tensors kept in containers on the module, as research code does."""

    def __init__(self):
        super().__init__()
        from collections import OrderedDict

        self.lin = nn.Linear(4, 4)
        self.tables = {"k": torch.randn(3), "nested": {"x": [torch.randn(2), (torch.rand(5),)]}}
        self.ordered = OrderedDict(a=torch.randn(2, 2))
        self.pairs = (torch.arange(4), [torch.randn(3)])


def _container_tensors(m: Tables) -> list[torch.Tensor]:
    return [
        m.tables["k"], m.tables["nested"]["x"][0], m.tables["nested"]["x"][1][0],
        m.ordered["a"], m.pairs[0], m.pairs[1][0],
    ]  # fmt: skip


def test_tensors_in_dicts_lists_and_tuples_materialize_with_eager_values():
    eager, m = eager_and_deferred(Tables)
    materialize(m)
    for want, got in zip(_container_tensors(eager), _container_tensors(m), strict=True):
        assert tensor_state(got) == "cpu"
        assert torch.equal(want, got) and want.stride() == got.stride()


def test_is_deferred_sees_a_tensor_kept_in_a_dict():
    with meta_init():
        m = nn.Linear(2, 2)
        m.tables = {"k": torch.randn(3)}
    materialize(m.weight)
    materialize(m.bias)
    assert is_deferred(m)


def test_tensors_in_containers_dematerialize_and_come_back_the_same():
    eager, m = eager_and_deferred(Tables)
    materialize(m, keep_cache=True)
    dematerialize(m)
    assert all(tensor_state(t) == "deferred" for t in _container_tensors(m))
    materialize(m)
    for want, got in zip(_container_tensors(eager), _container_tensors(m), strict=True):
        assert torch.equal(want, got)


def test_materialize_takes_a_generator_of_parameters():
    eager, m = eager_and_deferred(lambda: nn.Linear(3, 3))
    materialize(m.parameters())
    assert not is_deferred(m)
    assert torch.equal(m.weight, eager.weight) and torch.equal(m.bias, eager.bias)


def test_materialize_takes_a_list_mixing_modules_and_tensors():
    eager, m = eager_and_deferred(Net)
    materialize([m.norm, m.layers[1].weight, (m.emb,)])
    assert not is_deferred(m.norm) and not is_deferred(m.emb)
    assert torch.equal(m.layers[1].weight, eager.layers[1].weight)
    assert is_deferred(m.layers[1].bias)


def test_is_deferred_takes_a_generator():
    with meta_init():
        m = nn.Linear(2, 2)
    assert is_deferred(m.parameters())


@pytest.mark.parametrize("verb", [materialize, dematerialize])
def test_a_number_is_a_type_error_saying_what_is_accepted(verb):
    with pytest.raises(TypeError, match=r"tensor, a module, or a list .* got int"):
        verb(5)


class TaggedParameter(nn.Parameter):
    """A user's parameter class, as quantization and research code define them."""

    def describe(self) -> str:
        return f"tagged {tuple(self.shape)}"


class WithTaggedParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = TaggedParameter(torch.randn(3, 2))
        self.w.note = "kept"
        self.frozen = TaggedParameter(torch.randn(2), requires_grad=False)


def test_a_parameter_subclass_keeps_its_class_and_attributes():
    eager, m = eager_and_deferred(WithTaggedParameter)
    materialize(m)
    assert type(m.w) is TaggedParameter and m.w.describe() == "tagged (3, 2)"
    assert m.w.note == "kept" and "_param_cls" not in m.w.__dict__
    assert torch.equal(m.w, eager.w) and m.w.requires_grad
    assert type(m.frozen) is TaggedParameter and not m.frozen.requires_grad


def test_a_parameter_subclass_keeps_its_class_after_free_and_materialize_again():
    with meta_init():
        m = WithTaggedParameter()
    materialize(m, keep_cache=True)
    dematerialize(m)
    materialize(m)
    assert type(m.w) is TaggedParameter and m.w.note == "kept"


class KeepsViews(nn.Module):
    """A weight in one part and views of it kept as attributes of another."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Module()
        self.b.w_t = self.a.weight.t()
        self.b.row = self.a.weight[0]
        self.c = nn.Linear(3, 4, bias=False)
        self.c.weight = nn.Parameter(self.a.weight.data.t())  # tied through shared memory


def _shares_memory(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


@pytest.mark.parametrize("order", [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b")])
def test_views_materialized_in_separate_calls_keep_aliasing(order):
    eager, m = eager_and_deferred(KeepsViews)
    for name in order:
        materialize(getattr(m, name))
    assert _shares_memory(m.b.w_t, m.a.weight) and _shares_memory(m.b.row, m.a.weight)
    assert _shares_memory(m.c.weight, m.a.weight)
    assert torch.equal(m.b.w_t, eager.b.w_t) and m.b.w_t.stride() == eager.b.w_t.stride()
    assert torch.equal(m.c.weight, eager.c.weight)


def test_a_view_materialized_after_training_its_base_sees_the_training():
    with meta_init():
        m = KeepsViews()
    materialize(m.a)
    with torch.no_grad():
        m.a.weight.add_(1.0)
    materialize(m.b)
    assert torch.equal(m.b.w_t, m.a.weight.t())


_TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() > 1


@pytest.mark.skipif(_TWO_GPUS, reason="needs a machine without cuda:1")
def test_a_module_recorded_for_a_missing_gpu_is_refused_not_moved_to_the_cpu():
    with meta_init(device="cuda:1"):
        m = nn.Linear(4, 4)
    with pytest.raises(MaterializationError, match=r"recorded for cuda:1.*device='cpu'"):
        materialize(m)
    assert is_deferred(m)


@pytest.mark.skipif(_TWO_GPUS, reason="needs a machine without cuda:1")
def test_a_device_named_in_the_code_for_a_missing_gpu_is_refused_naming_it():
    with meta_init():
        m = nn.Sequential(nn.Linear(4, 4, device="cuda:1"), nn.Linear(4, 4))
    with pytest.raises(MaterializationError, match=r"2 tensor.*recorded for cuda:1"):
        materialize(m)
    assert is_deferred(m)


def test_a_module_recorded_for_a_missing_gpu_materializes_where_device_says():
    torch.manual_seed(0)
    with meta_init(device="cuda:1"):
        m = nn.Linear(4, 4)
    materialize(m, device="cpu")
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    assert m.weight.device == torch.device("cpu") and torch.equal(m.weight, eager.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_module_recorded_for_cuda_materializes_on_cuda_without_device():
    torch.manual_seed(0)
    with meta_init(device="cuda"):
        m = nn.Linear(4, 4)
    materialize(m)
    torch.manual_seed(0)
    eager = nn.Linear(4, 4, device="cuda")  # drawn from the GPU's generator, as eagerly
    assert m.weight.device.type == "cuda" and m.bias.device.type == "cuda"
    assert torch.equal(m.weight, eager.weight) and torch.equal(m.bias, eager.bias)


def test_a_cast_by_other_code_is_refused_by_name_and_force_gives_the_recorded_values():
    eager, m = eager_and_deferred(Net)
    materialize(m.layers[0], keep_cache=True)
    m.layers[0].half()  # nn.Module's own cast: not a conversion materialize recorded
    with pytest.raises(MaterializationError, match=r"weight .*cast or moved.*force=True"):
        dematerialize(m.layers[0])
    dematerialize(m.layers[0], force=True)
    materialize(m.layers[0])
    assert torch.equal(m.layers[0].weight, eager.layers[0].weight)


def test_a_refusal_for_a_list_of_parts_names_tensors_by_their_name_in_root():
    _, m = eager_and_deferred(Net)
    materialize([m.layers[1], m.layers[2]], keep_cache=True)
    with torch.no_grad():
        m.layers[2].weight.add_(1)
    with pytest.raises(MaterializationError, match=r"layers\.2\.weight"):
        dematerialize([m.layers[1], m.layers[2]], root=m)


def test_share_memory_inside_meta_init_is_done_when_materialized():
    eager, m = eager_and_deferred(lambda: nn.Linear(3, 3).share_memory())
    assert m.weight.is_shared()
    materialize(m)
    assert m.weight.is_shared() and m.bias.is_shared()
    assert torch.equal(m.weight, eager.weight)


def test_share_memory_on_a_deferred_model_after_the_block_is_done_when_materialized():
    with meta_init():
        m = nn.Linear(3, 3)
    assert not m.weight.is_shared()
    m.share_memory()
    materialize(m)
    assert m.weight.is_shared() and m.bias.is_shared()


def test_views_keep_aliasing_after_a_part_is_freed_and_materialized_again():
    eager, m = eager_and_deferred(KeepsViews)
    materialize(m.a, keep_cache=True)
    dematerialize(m.a)
    materialize(m.b)
    materialize(m.a)
    assert _shares_memory(m.b.w_t, m.a.weight)
    assert torch.equal(m.a.weight, eager.a.weight)


def test_named_parameters_is_a_type_error_that_says_to_pass_parameters():
    with meta_init():
        m = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"pass parameters\(\)"):
        materialize(m.named_parameters())
    assert is_deferred(m.weight)


def _trained_one_step() -> nn.Linear:
    """A layer materialized with keep_cache=True, after a backward pass (gradients set)."""
    with meta_init():
        layer = nn.Linear(4, 4)
    materialize(layer, keep_cache=True)
    layer(torch.ones(2, 4)).sum().backward()
    return layer


def test_dematerialize_refuses_a_tensor_holding_a_gradient_and_names_it():
    layer = _trained_one_step()
    with pytest.raises(MaterializationError, match=r"gradient.*weight, bias.*zero_grad"):
        dematerialize(layer)
    assert not is_deferred(layer) and layer.weight.grad is not None


def test_dematerialize_frees_once_the_gradients_are_set_to_none():
    layer = _trained_one_step()
    first = layer.weight.detach().clone()
    layer.zero_grad(set_to_none=True)
    dematerialize(layer)
    materialize(layer)
    assert torch.equal(layer.weight, first)


def test_dematerialize_with_force_drops_the_gradient():
    layer = _trained_one_step()
    dematerialize(layer, force=True)
    assert is_deferred(layer.weight) and layer.weight.grad is None
    materialize(layer)
    assert layer.weight.grad is None


def test_a_view_kept_by_the_user_keeps_its_values_after_the_base_is_freed():
    eager, m = eager_and_deferred(lambda: nn.Linear(4, 4))
    materialize(m, keep_cache=True)
    row = m.weight[1]  # a real view, held outside the module
    dematerialize(m)
    gc.collect()
    assert torch.equal(row, eager.weight[1]) and row._base is not None
    materialize(m)
    assert torch.equal(m.weight, eager.weight)


def test_keep_cache_on_a_tensor_materialized_earlier_without_it_warns_it_cannot_be_kept():
    with meta_init():
        layer = nn.Linear(3, 3)
    materialize(layer)
    with pytest.warns(UserWarning, match=r"2 were materialized without keep_cache=True"):
        materialize(layer, keep_cache=True)


def test_dematerialize_says_keep_cache_on_a_real_tensor_does_not_bring_its_recording_back():
    with meta_init():
        layer = nn.Linear(3, 3)
    materialize(layer)
    with pytest.warns(UserWarning):
        materialize(layer, keep_cache=True)
    with pytest.raises(MaterializationError, match="pass keep_cache=True the first time"):
        dematerialize(layer)
    assert not is_deferred(layer)


def test_dematerialize_after_clear_meta_init_cache_says_the_cache_was_cleared():
    with meta_init():
        t = torch.ones(2)
    materialize(t, keep_cache=True)
    clear_meta_init_cache()
    with pytest.raises(MaterializationError, match=r"clear_meta_init_cache\(\)"):
        dematerialize(t)


def test_dematerialize_of_a_tensor_never_deferred_says_so():
    with pytest.raises(MaterializationError, match="never deferred"):
        dematerialize(torch.ones(2))


class Rope(nn.Module):
    """Tensors kept as plain attributes, as rotary-embedding code keeps them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.cache = {"cos": torch.randn(4)}
        self.noise = [torch.rand(3)]
        self.w_t = self.lin.weight.t()


def _rope_attributes(m: Rope) -> list[torch.Tensor]:
    return [m.freqs, m.cache["cos"], m.noise[0], m.w_t]


def test_attribute_dict_and_list_tensors_are_freed_with_their_module_once_real():
    with meta_init():
        m = Rope()
    materialize(m, keep_cache=True)
    assert not is_deferred(m)
    dematerialize(m)
    assert all(tensor_state(t) == "deferred" for t in _rope_attributes(m))


def test_attribute_dict_and_list_tensors_come_back_equal_to_eager_after_a_free():
    eager, m = eager_and_deferred(Rope)
    materialize(m, keep_cache=True)
    dematerialize(m)
    materialize(m)
    for want, got in zip(_rope_attributes(eager), _rope_attributes(m), strict=True):
        assert torch.equal(want, got) and want.stride() == got.stride()


def test_a_view_attribute_is_a_view_of_its_parameter_again_after_a_free():
    with meta_init():
        m = Rope()
    materialize(m, keep_cache=True)
    dematerialize(m)
    materialize(m)
    assert m.w_t.data_ptr() == m.lin.weight.data_ptr()


def test_an_attribute_materialized_alone_is_freed_by_freeing_its_parent_module():
    with meta_init():
        outer = nn.Sequential(Rope())
    materialize(outer[0].freqs, keep_cache=True)
    dematerialize(outer)
    assert tensor_state(outer[0].freqs) == "deferred" and is_deferred(outer)


def test_is_deferred_sees_a_freed_attribute_of_an_otherwise_real_module():
    with meta_init():
        m = Rope()
    materialize(m, keep_cache=True)
    dematerialize(m.cache["cos"])
    assert is_deferred(m)


def _freed_after_fast(model: nn.Module, part: nn.Module) -> dict[str, torch.Tensor]:
    """Materialize ``part`` with rng="fast" and keep_cache=True, free it; its fast values."""
    materialize(part, rng="fast", keep_cache=True)
    values = {k: v.detach().clone() for k, v in part.state_dict().items()}
    dematerialize(part)
    return values


def test_a_part_freed_with_fast_values_gets_them_back_from_a_default_materialize():
    with meta_init():
        layer = nn.Linear(8, 8)
    fast = _freed_after_fast(layer, layer)
    materialize(layer)
    assert torch.equal(layer.weight, fast["weight"]) and torch.equal(layer.bias, fast["bias"])
    assert tensor_values(layer.weight) == "fast"


def test_a_part_freed_with_fast_values_gets_eager_values_with_rng_exact():
    eager, layer = eager_and_deferred(lambda: nn.Linear(8, 8))
    _freed_after_fast(layer, layer)
    materialize(layer, rng="exact")
    assert torch.equal(layer.weight, eager.weight) and tensor_values(layer.weight) == "exact"


def test_a_default_materialize_gives_eager_values_to_parts_beside_a_freed_fast_part():
    eager, m = eager_and_deferred(Net)
    fast = _freed_after_fast(m, m.layers[0])
    materialize(m)
    assert torch.equal(m.layers[0].weight, fast["weight"])
    assert torch.equal(m.layers[1].weight, eager.layers[1].weight)
    assert tensor_values(m.layers[1].weight) == "exact"


def test_a_view_over_a_freed_fast_tensor_shares_its_memory_and_values_again():
    with meta_init():
        m = Rope()
    fast = _freed_after_fast(m, m.lin)
    materialize(m)
    assert torch.equal(m.lin.weight, fast["weight"])
    assert m.w_t.data_ptr() == m.lin.weight.data_ptr()


def test_a_backward_through_an_output_made_before_the_free_leaves_the_tensor_deferred():
    with meta_init():
        layer = nn.Linear(4, 4)
    materialize(layer, keep_cache=True)
    loss = layer(torch.ones(2, 4)).sum()
    dematerialize(layer)
    loss.backward()
    assert is_deferred(layer.weight) and layer.weight.grad is None


def test_a_part_recorded_for_cuda_and_made_on_the_cpu_comes_back_on_the_cpu_after_a_free():
    with meta_init(device="cuda"):
        layer = nn.Linear(8, 8)
    materialize(layer, device="cpu", keep_cache=True)
    first = layer.weight.detach().clone()
    dematerialize(layer)
    materialize(layer)
    assert layer.weight.device.type == "cpu" and torch.equal(layer.weight, first)


def test_a_fast_part_made_on_an_explicit_device_comes_back_fast_after_a_free():
    with meta_init(device="cuda"):
        layer = nn.Linear(8, 8)
    materialize(layer, device="cpu", rng="fast", keep_cache=True)
    first = layer.weight.detach().clone()
    dematerialize(layer)
    materialize(layer)
    assert torch.equal(layer.weight, first) and tensor_values(layer.weight) == "fast"


# ---------------------------------------------------------------------------------------------
# tensors kept in other containers: dataclasses, SimpleNamespace, plain objects, deque, sets


@dataclasses.dataclass
class _TableHolder:
    table: torch.Tensor


class _SlottedHolder:
    __slots__ = ("table",)

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table


class _PlainHolder:
    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.me = self  # a cycle must not trap the walk


def _table_in(kind: str, table: torch.Tensor) -> object:
    if kind == "dataclass":
        return _TableHolder(table)
    if kind == "namespace":
        return types.SimpleNamespace(table=table)
    if kind == "slots":
        return _SlottedHolder(table)
    if kind == "plain object":
        return _PlainHolder(table)
    if kind == "deque":
        return collections.deque([table])
    return frozenset([table]) if kind == "frozenset" else {table}


def _table_of(holder: object) -> torch.Tensor:
    if isinstance(holder, (collections.deque, set, frozenset)):
        return next(iter(holder))
    return holder.table  # type: ignore[attr-defined]


class _KeepsTableIn(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.holder = _table_in(kind, torch.randn(1000))


_CONTAINER_KINDS = ["dataclass", "namespace", "slots", "plain object", "deque", "set", "frozenset"]


@pytest.mark.parametrize("kind", _CONTAINER_KINDS)
def test_a_tensor_kept_in_another_container_is_materialized_with_its_model(kind):
    eager, m = eager_and_deferred(lambda: _KeepsTableIn(kind))
    assert is_deferred(m)
    materialize(m)
    assert not is_deferred(_table_of(m.holder))
    assert torch.equal(_table_of(m.holder), _table_of(eager.holder))


@pytest.mark.parametrize("kind", _CONTAINER_KINDS)
def test_a_tensor_kept_in_another_container_is_freed_with_its_model(kind):
    _, m = eager_and_deferred(lambda: _KeepsTableIn(kind))
    materialize(m, keep_cache=True)
    table = _table_of(m.holder)
    assert not is_deferred(table)
    dematerialize(m)
    assert is_deferred(table)


@pytest.mark.parametrize("kind", _CONTAINER_KINDS)
def test_a_tensor_kept_in_another_container_counts_in_the_memory_table(kind):
    from jupyter_metainit.estimates import memory_table

    _, m = eager_and_deferred(lambda: _KeepsTableIn(kind))
    assert memory_table(m).loc["", "attribute_bytes"] == 4000
    materialize(m)
    assert memory_table(m).loc["", "attribute_bytes"] == 4000


# ---------------------------------------------------------------------------------------------
# non-leaf tensors keep eager's autograd link to the parameters they were computed from


class _KeepsScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.scaled = self.w * 2


def test_an_attribute_computed_from_a_parameter_passes_gradients_to_it():
    eager, m = eager_and_deferred(_KeepsScaled)
    materialize(m)
    assert torch.equal(m.scaled, eager.scaled) and not m.scaled.is_leaf
    m.scaled.sum().backward()
    eager.scaled.sum().backward()
    assert torch.equal(m.w.grad, eager.w.grad)


def test_a_pruned_weight_passes_gradients_to_weight_orig():
    from torch.nn.utils import prune

    eager, m = eager_and_deferred(lambda: prune.l1_unstructured(nn.Linear(6, 5), "weight", 0.5))
    materialize(m)
    assert torch.equal(m.weight, eager.weight)
    m.weight.sum().backward()
    eager.weight.sum().backward()
    assert torch.equal(m.weight_orig.grad, eager.weight_orig.grad)


def test_a_weight_norm_weight_passes_gradients_to_weight_g_and_weight_v():
    def build() -> nn.Module:
        with pytest.warns(FutureWarning):
            return nn.utils.weight_norm(nn.Linear(4, 3))

    eager, m = eager_and_deferred(build)
    materialize(m)
    m.weight.sum().backward()
    eager.weight.sum().backward()
    assert torch.equal(m.weight_g.grad, eager.weight_g.grad)
    assert torch.equal(m.weight_v.grad, eager.weight_v.grad)


class _KeepsCachedSnapshot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.orthogonal(nn.Linear(3, 3))
        with nn.utils.parametrize.cached():
            self.snapshot = self.lin.weight


def test_a_cached_parametrization_snapshot_passes_gradients_to_the_original():
    eager, m = eager_and_deferred(_KeepsCachedSnapshot)
    materialize(m)
    assert torch.equal(m.snapshot, eager.snapshot)
    m.snapshot.sum().backward()
    eager.snapshot.sum().backward()
    original = m.lin.parametrizations.weight.original
    assert torch.equal(original.grad, eager.lin.parametrizations.weight.original.grad)


def _forward_on_both() -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    eager, m = eager_and_deferred(lambda: nn.Linear(3, 2))
    x = torch.randn(4, 3)
    return eager, m, eager(x), m(x)


def test_a_forward_output_materialized_with_its_model_gives_eager_gradients():
    eager, m, eager_z, z = _forward_on_both()
    materialize([m, z])
    assert torch.equal(z, eager_z)
    z.sum().backward()
    eager_z.sum().backward()
    assert torch.equal(m.weight.grad, eager.weight.grad)


def test_a_forward_output_materialized_after_its_model_gives_eager_gradients():
    eager, m, eager_z, z = _forward_on_both()
    materialize(m)
    materialize(z)
    z.sum().backward()
    eager_z.sum().backward()
    assert torch.equal(m.bias.grad, eager.bias.grad)


def test_a_forward_output_without_its_deferred_parameters_warns_that_gradients_will_not_reach():
    _, m, eager_z, z = _forward_on_both()
    with pytest.warns(UserWarning, match=r"as a leaf.*2 of them are not being materialized"):
        materialize(z)
    assert torch.equal(z, eager_z) and is_deferred(m)


def test_an_attribute_computed_from_a_parameter_cast_by_dtype_passes_gradients_to_it():
    eager, m = eager_and_deferred(_KeepsScaled)
    materialize(m, dtype=torch.bfloat16)
    assert torch.equal(m.scaled, eager.scaled.bfloat16())
    m.scaled.float().sum().backward()
    assert torch.equal(m.w.grad, torch.full((4,), 2.0, dtype=torch.bfloat16))


class _ScaledThenZeroed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.scaled = self.w * 2
        with torch.no_grad():
            self.w.zero_()


def test_an_attribute_whose_parameter_was_written_after_keeps_its_values_and_warns():
    eager, m = eager_and_deferred(_ScaledThenZeroed)
    with pytest.warns(UserWarning, match=r"as a leaf.*written after it was computed"):
        materialize(m)
    assert torch.equal(m.scaled, eager.scaled)


class _MetaBuffer(nn.Module):
    """A buffer made with ``device="meta"`` inside the block: no data, no recording."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("pos", torch.empty(3, device="meta"))


def test_a_meta_buffer_is_refused_by_name_and_nothing_changes():
    with meta_init():
        m = _MetaBuffer()
    with pytest.raises(MaterializationError) as caught:
        materialize(m)
    message = str(caught.value)
    assert "`_MetaBuffer.pos` (buffer)" in message and "holds no data" in message
    assert "without device='meta'" in message and "Nothing was materialized" in message
    assert is_deferred(m.lin.weight) and is_deferred(m.lin.bias) and m.pos.is_meta
    materialize(m.lin)  # still usable
    assert not is_deferred(m.lin)


class _CopiedFromMeta(nn.Module):
    """A deferred buffer whose recording reads a meta tensor (eager refuses the copy at once)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.zeros(3))
        self.b.copy_(torch.empty(3, device="meta"))


def test_a_recording_that_reads_a_meta_tensor_is_refused_by_name_and_nothing_changes():
    with meta_init():
        m = _CopiedFromMeta()
    with pytest.raises(MaterializationError) as caught:
        materialize(m)
    message = str(caught.value)
    assert "`_CopiedFromMeta.b` (buffer)" in message and "holds no data" in message
    assert "aten.copy_" in message and "test_materialize.py" in message
    assert is_deferred(m.lin.weight) and is_deferred(m.b)
    materialize(m.lin)  # still usable
    assert not is_deferred(m.lin)
