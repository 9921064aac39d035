"""Recording: deferred tensors report real metadata, allocate nothing, and record every op."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from _twins import assert_same, eager_and_deferred
from torch import nn

from jupyter_metainit import is_deferred, is_meta_init, materialize, meta_init
from jupyter_metainit.core import DeferredTensor
from jupyter_metainit.core.errors import UnsupportedOperatorError


def test_reference_example_keep_cache():
    with meta_init():
        t1 = torch.ones([3])
        t2 = t1 + 2
    assert "deferred" in repr(t1)
    materialize(t1, keep_cache=True)
    assert repr(t1) == "tensor([1., 1., 1.])"
    materialize(t2)
    assert repr(t2) == "tensor([3., 3., 3.])"


def test_is_meta_init_inside_and_outside():
    assert not is_meta_init()
    with meta_init():
        assert is_meta_init()
        with meta_init():
            assert is_meta_init()
        assert is_meta_init()
    assert not is_meta_init()


def test_meta_init_is_thread_local():
    seen = {}

    def worker():
        seen["inside"] = is_meta_init()
        seen["tensor"] = type(torch.ones(2))

    with meta_init():
        th = threading.Thread(target=worker)
        th.start()
        th.join()
    assert seen == {"inside": False, "tensor": torch.Tensor}


def test_reports_real_metadata():
    with meta_init():
        t = torch.empty(4, 6, dtype=torch.float16).t()
        p = nn.Parameter(torch.empty(3, 5))
    assert isinstance(t, DeferredTensor)
    assert t.shape == (6, 4) and t.stride() == (1, 6) and t.dtype == torch.float16
    assert t.device == torch.device("cpu") and not t.is_meta
    assert isinstance(p, nn.Parameter) and p.requires_grad


def test_explicit_cuda_device_is_reported_without_a_gpu():
    with meta_init():
        lin = nn.Linear(4, 4, device="cuda:1")
        default = torch.zeros(2)
    assert lin.weight.device == torch.device("cuda", 1)
    assert lin.weight.is_cuda
    assert default.device == torch.device("cpu")


def test_meta_init_device_argument_sets_default_device():
    with meta_init(device="cuda:0"):
        t = torch.zeros(2)
        c = torch.zeros(2, device="cpu")
    assert t.device == torch.device("cuda", 0)
    assert c.device == torch.device("cpu")


def test_device_dependent_init_takes_the_eager_path():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            x = torch.ones(3)
            self.register_buffer("b", x + (1 if x.is_cpu else 2))

    with meta_init():
        m = M()
    materialize(m)
    assert torch.equal(m.b, torch.full((3,), 2.0))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_construction_allocates_no_storage():
    before = _rss()
    with meta_init():
        m = nn.Linear(50_000, 50_000)  # 10 GB if it were real
    assert m.weight.shape == (50_000, 50_000)
    assert _rss() - before < 50 * 2**20


def test_ops_after_construction_are_recorded_outside_the_context():
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    with torch.no_grad():
        eager.weight.mul_(2)
    eager = eager.half()
    torch.manual_seed(0)
    with meta_init():
        m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.mul_(2)
    m = m.half()
    assert m.weight.dtype == torch.float16 and is_deferred(m)
    materialize(m)
    assert torch.equal(m.weight, eager.weight) and torch.equal(m.bias, eager.bias)


def test_to_cuda_retargets_and_allocates_nothing():
    with meta_init():
        m = nn.Linear(4, 3)
    m.to("cuda")
    assert m.weight.device == torch.device("cuda", 0) and is_deferred(m)


def test_apply_and_requires_grad_after_construction():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    eager.apply(lambda mod: nn.init.zeros_(mod.bias) if isinstance(mod, nn.Linear) else None)
    eager.requires_grad_(False)
    torch.manual_seed(0)
    with meta_init():
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    m.apply(lambda mod: nn.init.zeros_(mod.bias) if isinstance(mod, nn.Linear) else None)
    m.requires_grad_(False)
    materialize(m)
    assert not m[0].weight.requires_grad
    for a, b in zip(eager.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tying_after_construction_keeps_one_object():
    with meta_init():
        emb = nn.Embedding(10, 4)
        head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    materialize(model)
    assert model["head"].weight is model["emb"].weight
    assert not is_deferred(model)


def test_view_then_inplace_through_base():
    with meta_init():
        a = torch.ones(2, 2)
        b = a.view(-1)
        a.add_(2)
    materialize(b)
    assert torch.equal(b, torch.full((4,), 3.0))


def test_inplace_through_a_view_updates_the_base():
    with meta_init():
        w = torch.zeros(3, 4)
        w[:, :2].fill_(5)
        w[1].add_(1)
    expected = torch.zeros(3, 4)
    expected[:, :2] = 5
    expected[1] += 1
    materialize(w)
    assert torch.equal(w, expected)


def test_data_reads_and_assignment():
    with meta_init():
        p = nn.Parameter(torch.zeros(2, 3))
        p.data.fill_(4)
        p.data = torch.ones(3, 2)
    assert p.shape == (3, 2) and isinstance(p, nn.Parameter)
    materialize(p)
    assert torch.equal(p, torch.ones(3, 2)) and isinstance(p, nn.Parameter)


def test_tensor_from_list_and_numpy_are_captured():
    arr = np.arange(4, dtype=np.float32)
    with meta_init():
        a = torch.tensor([1.0, 2.0])
        b = torch.as_tensor(arr) * 2
    assert is_deferred(a) and is_deferred(b)
    arr[:] = 0  # the recording took the values at that time
    materialize([a, b])
    assert torch.equal(a, torch.tensor([1.0, 2.0]))
    assert torch.equal(b, torch.tensor([0.0, 2.0, 4.0, 6.0]))


def _large():
    return torch.ones(512, 1024)  # 2 MiB: referenced by the recording, not copied


@pytest.mark.parametrize(
    "write",
    [
        lambda x: x.add_(1),
        lambda x: x.data.add_(1),
        lambda x: x.detach().mul_(2),
        lambda x: x.numpy().__setitem__((0, 0), 5.0),
    ],
    ids=["in_place", "data", "detach", "numpy"],
)
def test_large_external_tensor_written_after_recording_is_a_clear_error(write):
    outside = _large()
    with meta_init():
        t = outside * 2
    write(outside)
    with pytest.raises(RuntimeError, match="written after it was recorded"):
        materialize(t)
    assert is_deferred(t)


def test_from_numpy_memory_written_after_recording_is_a_clear_error():
    array = np.ones((512, 1024), dtype=np.float32)
    shared = torch.from_numpy(array)
    with meta_init():
        t = torch.zeros(512, 1024) + shared
    array[3, 3] = 7.0
    with pytest.raises(RuntimeError, match="written after it was recorded"):
        materialize(t)


def test_small_external_tensor_is_replayed_with_its_values_at_recording_time():
    outside = torch.ones(3)
    with meta_init():
        t = outside * 2
    outside.add_(1)
    materialize(t)
    assert torch.equal(t, torch.full((3,), 2.0))  # what eager code computed then


def test_explicit_generator_is_replayed_exactly():
    g = torch.Generator().manual_seed(123)
    eager = torch.empty(5).normal_(generator=g)
    g2 = torch.Generator().manual_seed(123)
    with meta_init():
        t = torch.empty(5).normal_(generator=g2)
    materialize(t)
    assert torch.equal(t, eager)


def test_item_computes_the_exact_value_and_keeps_the_tensor_deferred():
    with meta_init():
        t = torch.arange(5.0)
        s = t.sum()
        assert s.item() == 10.0
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert bool(t[1] > 0)
    assert is_deferred(t)


def test_numpy_of_a_deferred_tensor_gives_values():
    with meta_init():
        t = torch.full((2,), 7.0)
    assert t.numpy().tolist() == [7.0, 7.0]


def test_operator_without_meta_kernel_is_computed_on_values_and_recorded():
    with meta_init():
        t = torch.arange(3.0)
    op = torch.library.Library("jmi_test", "DEF")
    op.define("double(Tensor x) -> Tensor")
    op.impl("double", lambda x: x * 2, "CPU")
    with meta_init():
        d = torch.ops.jmi_test.double(t)
    assert is_deferred(d) and d.shape == (3,)
    materialize(d)
    assert torch.equal(d, torch.tensor([0.0, 2.0, 4.0]))


def test_operator_without_meta_kernel_on_unreplayable_input_names_op_and_caller():
    source = _large()
    with meta_init():
        t = torch.zeros(512, 1024) + source
    source.add_(1)  # the recording's input is gone
    op = torch.library.Library("jmi_test2", "DEF")
    op.define("noop(Tensor x) -> Tensor")
    op.impl("noop", lambda x: x.clone(), "CPU")
    with pytest.raises(UnsupportedOperatorError, match=r"jmi_test2.noop.*test_record.py"):
        torch.ops.jmi_test2.noop(t)


def test_no_grad_blocks_are_recorded():
    with meta_init():
        w = nn.Parameter(torch.ones(2))
        with torch.no_grad():
            w.mul_(3)
    materialize(w)
    assert torch.equal(w.detach(), torch.full((2,), 3.0))


def test_deepcopy_of_a_deferred_module_clones_values():
    import copy

    torch.manual_seed(0)
    with meta_init():
        a = nn.Linear(3, 3)
        b = copy.deepcopy(a)
    assert b.weight is not a.weight
    materialize([a, b])
    assert torch.equal(a.weight, b.weight)


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.t_(),
        lambda t: t.transpose_(0, 1),
        lambda t: t.swapdims_(0, 1),
        lambda t: t.unsqueeze_(1),
        lambda t: t.squeeze_(0),
        lambda t: t.as_strided_((3, 2), (1, 3)),
        lambda t: t.resize_(3),
    ],
    ids=["t_", "transpose_", "swapdims_", "unsqueeze_", "squeeze_", "as_strided_", "resize_"],
)
def test_in_place_view_ops_update_the_metadata_of_the_same_object(op):
    eager = torch.arange(6.0).reshape(2, 3)
    op(eager)
    with meta_init():
        t = torch.arange(6.0).reshape(2, 3)
        same = op(t)
    assert same is t
    assert t.shape == t.size() == eager.shape and t.stride() == eager.stride()
    materialize(t)
    assert t.shape == eager.shape and t.stride() == eager.stride()
    assert torch.equal(t, eager)


def test_orthogonal_init_of_a_wide_matrix_is_exact():
    eager, t = eager_and_deferred(lambda: nn.init.orthogonal_(torch.empty(3, 7)))
    materialize(t)
    assert torch.equal(t, eager)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(4.0).view(torch.int32),
        lambda: torch.arange(8.0).view(torch.int16)[1::3],
        lambda: torch.arange(4, dtype=torch.int64).view(torch.uint8),
        lambda: torch.view_as_complex(torch.arange(8.0).reshape(4, 2)),
        lambda: torch.view_as_real(torch.randn(3, dtype=torch.cfloat)),
        lambda: torch.view_as_complex(torch.randn(3, 2)).real,
        lambda: torch.randn(4, 4, dtype=torch.cdouble).imag.view(torch.int64),
    ],
    ids=[
        "f32_as_i32",
        "strided_i16",
        "i64_as_u8",
        "as_complex",
        "as_real",
        "complex_real",
        "cdouble_imag_bits",
    ],
)
def test_dtype_changing_views_materialize_with_their_own_dtype(make):
    eager, t = eager_and_deferred(make)
    assert (t.dtype, t.shape, t.stride()) == (eager.dtype, eager.shape, eager.stride())
    materialize(t)
    assert t.dtype == eager.dtype and torch.equal(t, eager)


def test_writes_through_a_dtype_view_reach_the_base():
    def make():
        base = torch.zeros(4)
        base.view(torch.int32).fill_(0x3F800000)  # the bits of 1.0
        return base

    with meta_init():
        t = make()
    materialize(t)
    assert torch.equal(t, make())


def test_complex_parameters_are_exact():
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 5, dtype=torch.cfloat) * 0.02)
            self.u = nn.Parameter(torch.empty(6, dtype=torch.complex128).uniform_())

    eager, deferred = eager_and_deferred(Spectral)
    assert deferred.w.dtype == torch.cfloat and deferred.w.requires_grad
    materialize(deferred)
    assert_same(eager, deferred)


def test_requires_grad_of_derived_tensors_equals_eager():
    def make():
        w = nn.Parameter(torch.randn(6, 2))
        with torch.no_grad():
            frozen = w * 2
        return [w.chunk(3)[0], w[1], w * 2, w.detach(), frozen, w.t(), torch.ones(2) + w]

    eager = make()
    with meta_init():
        deferred = make()
    assert [t.requires_grad for t in deferred] == [t.requires_grad for t in eager]
    assert [t.is_leaf for t in deferred] == [t.is_leaf for t in eager]
    materialize(deferred)
    assert [t.requires_grad for t in deferred] == [t.requires_grad for t in eager]


def test_legacy_weight_norm_attributes_require_grad():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = nn.utils.weight_norm(nn.Linear(4, 3))
        with meta_init():
            deferred = nn.utils.weight_norm(nn.Linear(4, 3))
    assert deferred.weight.requires_grad == eager.weight.requires_grad is True


def test_normal_with_tensor_mean_and_std():
    eager, t = eager_and_deferred(lambda: torch.normal(torch.zeros(5), torch.ones(5)))
    materialize(t)
    assert torch.equal(t, eager)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.nonzero(x > 0.5),
        lambda x: torch.unique(torch.round(x * 4)),
        lambda x: x[x > 0.5],
        lambda x: torch.masked_select(x, x < 0.3),
        lambda x: torch.linalg.qr(x.reshape(4, 4))[0],
    ],
    ids=["nonzero", "unique", "boolean_index", "masked_select", "qr"],
)
def test_data_dependent_and_meta_less_ops_are_deferred_and_exact(make):
    eager, t = eager_and_deferred(lambda: make(torch.rand(16)))
    assert is_deferred(t) and t.shape == eager.shape
    materialize(t)
    assert torch.equal(t, eager)


@pytest.mark.parametrize("kind", ["orthogonal", "spectral_norm", "weight_norm"])
def test_parametrizations_are_exact(kind):

    wrap = getattr(nn.utils.parametrizations, kind)

    def ctor():
        return wrap(nn.Linear(6, 4))

    eager, deferred = eager_and_deferred(ctor)
    materialize(deferred)
    assert_same(eager, deferred)
    assert torch.equal(eager.weight, deferred.weight)


def test_register_parametrization_with_a_custom_module():
    from torch.nn.utils import parametrize

    class Symmetric(nn.Module):
        def forward(self, x):
            return x.triu() + x.triu(1).transpose(-1, -2)

    def ctor():
        m = nn.Linear(5, 5)
        parametrize.register_parametrization(m, "weight", Symmetric())
        return m

    eager, deferred = eager_and_deferred(ctor)
    materialize(deferred)
    assert_same(eager, deferred)
    assert torch.equal(eager.weight, deferred.weight)


def test_set_makes_a_deferred_tensor_share_another_ones_memory():
    def make():
        a, b = torch.arange(6.0), torch.zeros(2)
        b.set_(a[2:])
        a.add_(1)
        return b

    with meta_init():
        t = make()
    materialize(t)
    assert torch.equal(t, make())


def _creator(t):
    return t._rec.storage.writes[0]


def test_a_repeated_factory_call_is_recorded_as_the_first_one_was():
    with meta_init():
        first = [torch.arange(0, 1, 0.125), torch.zeros(2, 3), torch.full((2,), 7)]
        again = [torch.arange(0, 1, 0.125), torch.zeros(2, 3), torch.full((2,), 7)]
    for a, b in zip(first, again, strict=True):
        ra, rb = _creator(a), _creator(b)
        assert (ra.func, ra.args, ra.kwargs) == (rb.func, rb.args, rb.kwargs)
        assert rb.seq > ra.seq and rb.where.line != ra.where.line
        assert (b.shape, b.stride(), b.dtype, b.device) == (a.shape, a.stride(), a.dtype, a.device)
        assert torch.equal(materialize(a), materialize(b))


def test_a_repeated_factory_call_follows_the_default_dtype_in_force():
    saved = torch.get_default_dtype()
    with meta_init():
        assert torch.zeros(3).dtype == torch.float32
        torch.set_default_dtype(torch.float64)
        try:
            doubles = torch.zeros(3)
        finally:
            torch.set_default_dtype(saved)
        with meta_init(dtype=torch.bfloat16):
            halves = torch.zeros(3)
        with torch.device("meta"):
            plain_meta = torch.zeros(3)
    assert doubles.dtype == torch.float64 and materialize(doubles).dtype == torch.float64
    assert halves.dtype == torch.bfloat16 and materialize(halves).dtype == torch.bfloat16
    assert type(plain_meta) is torch.Tensor and plain_meta.is_meta


_FILLS = {
    "zero_": lambda t: t.zero_(),
    "fill_": lambda t: t.fill_(2.5),
    "normal_": lambda t: t.normal_(0.0, 0.02),
    "uniform_ with a generator": lambda t: t.uniform_(-1, 1, generator=torch.Generator()),
    "fill_ of a row": lambda t: t[1].fill_(3.0),
    "normal_ of a column": lambda t: t[:, 2].normal_(),
    "random_ of integers": lambda t: t.long().random_(0, 10),
}


def _recorded_fill(fill):
    torch.manual_seed(0)
    with meta_init():
        t = torch.empty(4, 6)
        filled = fill(t)
    return filled, filled._rec.storage.writes[-1]


@pytest.mark.parametrize("fill", _FILLS.values(), ids=_FILLS.keys())
def test_a_fill_is_recorded_as_the_general_path_records_it(fill, monkeypatch):
    """Fills take a short path of their own (they are most of a model's ops): same record."""
    from jupyter_metainit.core.record.dispatch import triage

    short, short_op = _recorded_fill(fill)
    # internal: the short path off, to compare with the general path (a switch costs every fill)
    monkeypatch.setattr(triage, "record_fill", lambda func, args, kwargs: None)
    general, general_op = _recorded_fill(fill)
    assert short_op.func is general_op.func
    assert (short_op.args[1:], short_op.kwargs) == (general_op.args[1:], general_op.kwargs)
    geometry = lambda r: (r.size, r.stride, r.offset, r.dtype)  # noqa: E731
    assert geometry(short_op.args[0]) == geometry(general_op.args[0])
    assert short_op.outputs == general_op.outputs == (None,)
    assert [len(short_op.reads), len(short_op.mutates), len(short_op.overwrites)] == [
        len(general_op.reads), len(general_op.mutates), len(general_op.overwrites)]  # fmt: skip
    if general_op.rng is None:
        assert short_op.rng is None
    else:
        spec = lambda op: op.rng.segment.specs[op.rng.index]  # noqa: E731
        assert spec(short_op) == spec(general_op)
    assert torch.equal(materialize(short), materialize(general))


def test_as_subclass_of_a_deferred_tensor_raises_a_clear_error():
    class Tagged(torch.Tensor):
        pass

    with meta_init():
        t = torch.randn(3)
        with pytest.raises(UnsupportedOperatorError, match=r"as_subclass\(Tagged\).*materializ"):
            t.as_subclass(Tagged)


def test_sparse_tensor_made_under_meta_init_is_computed_with_eager_values():
    def build():
        dense = torch.randn(3, 4) * (torch.rand(3, 4) > 0.5)
        return dense.to_sparse(), torch.sparse_coo_tensor(
            torch.tensor([[0, 2]]), torch.randn(2), (3,)
        )

    expected, got = eager_and_deferred(build)
    for e, g in zip(expected, got, strict=True):
        assert g.layout == torch.sparse_coo
        assert torch.equal(g.to_dense(), e.to_dense())


def test_nested_tensor_made_under_meta_init_is_computed_with_eager_values():
    expected, got = eager_and_deferred(
        lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    )
    assert got.is_nested
    assert all(torch.equal(g, e) for g, e in zip(got.unbind(), expected.unbind(), strict=True))


def test_jagged_nested_tensor_under_meta_init_raises_a_clear_error():
    with meta_init(), pytest.raises(UnsupportedOperatorError, match="outside meta_init"):
        torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged)


def test_quantize_dynamic_on_a_deferred_model_says_to_materialize_first_and_names_the_line():
    with meta_init():
        m = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(
        UnsupportedOperatorError, match=r"quantized.*test_record\.py:\d+.*Materialize first"
    ):
        torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
    materialize(m)  # the model is left deferred and usable
    assert not is_deferred(m)


def test_set_with_the_storage_of_a_deferred_tensor_says_it_holds_no_memory():
    with meta_init():
        source = torch.arange(8.0)
        u = torch.empty(0)
        with pytest.raises(
            UnsupportedOperatorError, match=r"storage of a deferred tensor.*materialize"
        ):
            u.set_(source.untyped_storage(), 2, (2, 3), (3, 1))


class _OtherTensor(torch.Tensor):
    pass


def test_make_subclass_of_a_deferred_tensor_says_to_build_outside_meta_init_and_names_the_line():
    with meta_init():
        data = torch.randn(3)
        with pytest.raises(
            UnsupportedOperatorError,
            match=r"_OtherTensor.*test_record\.py:\d+.*outside meta_init",
        ):
            torch.Tensor._make_subclass(_OtherTensor, data)


def test_reading_the_bytes_of_a_deferred_tensors_storage_says_to_read_the_tensor_or_materialize():
    with meta_init():
        w = nn.Linear(2, 2).weight
    with pytest.raises(
        UnsupportedOperatorError, match=r"test_record\.py:\d+.*t\.tolist\(\).*materialize"
    ):
        bytes(w.untyped_storage())


def _optimizer_steps(make_opt) -> list[torch.Tensor]:
    """Two steps of an optimizer on two parameters with gradients: params, then state tensors."""
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = make_opt(params)
    for _ in range(2):
        opt.step()
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return params + state


def _implementation(impl: str) -> dict:
    return {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}


_OPTIMIZERS = {
    f"{cls.__name__}-{impl}": (
        lambda params, cls=cls, impl=impl, kw=kw: cls(params, lr=0.1, **kw, **_implementation(impl))
    )
    for cls, kw in (
        (torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"amsgrad": True}),
    )
    for impl in ("for-loop", "foreach", "fused")
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("parts", [False, True], ids=["whole", "params_alone_first"])
def test_optimizer_steps_inside_meta_init_equal_eager(name, parts):
    make_opt = _OPTIMIZERS[name]
    expected, got = eager_and_deferred(lambda: _optimizer_steps(make_opt))
    if parts:
        materialize(got[0])
        assert torch.equal(got[0], expected[0])
    materialize(got)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(g, e) and g.dtype == e.dtype


def test_clip_grad_norm_with_foreach_scales_deferred_grads_as_eager():
    def clipped():
        params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
        for p in params:
            p.grad = torch.randn_like(p) * 10
        norm = nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        return [p.grad for p in params] + [norm]

    expected, got = eager_and_deferred(clipped)
    materialize(got)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_foreach_lerp_ema_update_of_a_teacher_equals_eager():
    def ema():
        student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
        with torch.no_grad():
            for _ in range(3):
                torch._foreach_lerp_(list(teacher.parameters()), list(student.parameters()), 0.1)
                torch._foreach_mul_(list(student.parameters()), 1.5)
        return list(teacher.parameters()) + list(student.parameters())

    expected, got = eager_and_deferred(ema)
    materialize(got)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_one_foreach_write_to_real_and_deferred_tensors_together_equals_eager():
    real, expected_real = torch.ones(3), torch.ones(3)
    torch.manual_seed(0)
    expected = torch.randn(3)
    torch._foreach_add_([expected_real, expected], [torch.ones(3), torch.full((3,), 2.0)])
    expected_after = torch.randn(2)
    torch.manual_seed(0)
    with meta_init():
        got = torch.randn(3)
        torch._foreach_add_([real, got], [torch.ones(3), torch.full((3,), 2.0)])
        after = torch.randn(2)
    assert torch.equal(real, expected_real)
    materialize([got, after])
    assert torch.equal(got, expected) and torch.equal(after, expected_after)


def test_grad_scaler_unscale_of_deferred_grads_into_a_real_found_inf_equals_eager():
    found, expected_found = torch.zeros(1), torch.zeros(1)
    expected = [torch.tensor([4.0, float("inf")])]
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, torch.tensor(0.5))
    with meta_init():
        grads = [torch.tensor([4.0, float("inf")])]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.tensor(0.5))
    assert torch.equal(found, expected_found)
    materialize(grads)
    assert torch.equal(grads[0], expected[0])


def test_a_foreach_out_variant_writes_its_out_list_as_eager():
    def add_into():
        a = [torch.randn(3), torch.randn(2)]
        out = [torch.zeros(3), torch.zeros(2)]
        torch.ops.aten._foreach_add.List_out(a, a, out=out)
        return out

    expected, got = eager_and_deferred(add_into)
    materialize(got)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


# Calls eager PyTorch refuses for mixing float64 and float32 while PyTorch's meta kernels accept
# them (each ATen op the recorder checks: mm, addmm, addmm_, addbmm, mv, convolution, nll_loss).
_F64, _F32 = torch.float64, torch.float32
_MIXED_DTYPES = {
    "mm": lambda: torch.ones(2, 3, dtype=_F64) @ torch.ones(3, 4),
    "linear": lambda: nn.functional.linear(torch.ones(2, 3, dtype=_F64), torch.ones(4, 3)),
    "linear bias": lambda: nn.functional.linear(
        torch.ones(2, 3, dtype=_F64), torch.ones(4, 3, dtype=_F64), torch.ones(4)
    ),
    "addmm_": lambda: torch.ones(2, 4, dtype=_F64).addmm_(torch.ones(2, 3), torch.ones(3, 4)),
    "addbmm": lambda: torch.addbmm(
        torch.ones(2, 4, dtype=_F64), torch.ones(1, 2, 3, dtype=_F64), torch.ones(1, 3, 4)
    ),
    "mv": lambda: torch.ones(2, 3, dtype=_F64) @ torch.ones(3),
    "conv2d": lambda: nn.functional.conv2d(
        torch.ones(1, 2, 5, 5, dtype=_F64), torch.ones(3, 2, 3, 3)
    ),
    "cross_entropy weight": lambda: nn.functional.cross_entropy(
        torch.ones(2, 3, dtype=_F64), torch.zeros(2, dtype=torch.long), weight=torch.ones(3)
    ),
}


@pytest.mark.parametrize("name", list(_MIXED_DTYPES))
def test_mixed_dtypes_eager_refuses_are_refused_while_recording(name):
    call = _MIXED_DTYPES[name]
    with pytest.raises(RuntimeError):
        call()
    with meta_init(), pytest.raises(RuntimeError, match="to have the same dtype"):
        call()


def test_mixed_dtypes_error_says_what_to_cast():
    with meta_init():
        x, w = torch.ones(2, 3, dtype=torch.float64), torch.ones(4, 3)
        with pytest.raises(RuntimeError, match=r"self: torch.float64, mat2: torch.float32.*cast"):
            nn.functional.linear(x, w)


def test_lazy_layer_made_before_a_float64_block_refuses_a_float64_input():
    layer = nn.LazyLinear(3)  # float32, as eager's made under the float32 default
    with meta_init(dtype=torch.float64), pytest.raises(RuntimeError, match="same dtype"):
        layer(torch.randn(2, 5))


def test_same_dtype_products_under_a_float64_block_equal_eager():
    def build() -> tuple[nn.Module, torch.Tensor]:
        m = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(27, 2))
        return m, m(torch.randn(1, 2, 5, 5))

    (eager, eager_out), (m, out) = eager_and_deferred(build, dtype=torch.float64)
    assert out.dtype == torch.float64
    materialize(m)
    assert_same(eager, m)
    assert torch.equal(materialize(out), eager_out)
