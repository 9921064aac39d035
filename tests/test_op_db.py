"""Differential test against PyTorch's own operator test data (``op_db``).

Every operator with CPU float32 samples runs, with its in-place variant where there is one, on
inputs created inside ``meta_init``; the deferred results are materialized and compared with
eager results: same dtype, shape and strides, values ``torch.equal`` (NaN equal to NaN). A
sample is skipped only when eager code itself raises or gives different results on two runs;
deferral may raise a clear ``MetaInitError`` only for the operators listed in ``CLEAR_ERRORS``.

``python tests/test_op_db.py`` prints the counts.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core import DeferredTensor
from jupyter_metainit.core.errors import MetaInitError

common_methods_invocations = pytest.importorskip(
    "torch.testing._internal.common_methods_invocations"
)
OP_DB = [op for op in common_methods_invocations.op_db
         if torch.float32 in op.supported_dtypes("cpu")]  # fmt: skip
SAMPLES_PER_VARIANT = 12  # bounds the run (about a minute); every operator is covered

# Operators for which deferral raises a clear error instead of giving values, and why.
CLEAR_ERRORS = {
    "addbmm": "the CPU kernel resizes `self` in place when it broadcasts; deferred tensors keep "
    "their shape, so the in-place form is refused (the out-of-place form works)",
    "to_sparse": "sparse outputs cannot be deferred",
}
# Results whose values are uninitialized memory in eager code too, or differ from one eager run
# to the next (LAPACK's multithreaded gelsy): only metadata is compared.
UNINITIALIZED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
                 "new_empty_strided"}  # fmt: skip
NONDETERMINISTIC = {"linalg.lstsq"}
METADATA_ONLY = UNINITIALIZED | NONDETERMINISTIC


def _equal(a: Any, b: Any, values: bool = True) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
            return False
        if a.layout != torch.strided:
            return not values or torch.equal(a.to_dense(), b.to_dense())
        # Strides of dimensions of size 1, or of empty tensors, say nothing about the layout.
        if a.numel() and [s for s, n in zip(a.stride(), a.shape, strict=True) if n > 1] != [
            s for s, n in zip(b.stride(), b.shape, strict=True) if n > 1
        ]:
            return False
        if a.is_conj() != b.is_conj() or a.is_neg() != b.is_neg():
            return False
        if not values:
            return True
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_equal(x, y, values) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return a == b


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _eager(fn: Callable, sample: Any) -> Any:
    torch.manual_seed(0)
    inp, args, kwargs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
    return fn(inp, *args, **kwargs)


def _deferred(fn: Callable, sample: Any) -> Any:
    torch.manual_seed(0)
    with meta_init():
        inp, args, kwargs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
        out = fn(inp, *args, **kwargs)
    materialize([t for t in tree_flatten(out)[0] if isinstance(t, DeferredTensor)])
    return out


def _variants(op: Any) -> Iterator[tuple[str, Callable]]:
    yield "op", op.op
    if op.inplace_variant is not None:
        yield "inplace", op.inplace_variant


def check_op(op: Any) -> collections.Counter:
    """Run every variant and sample of ``op``; return the counts, assert on any mismatch."""
    counts: collections.Counter = collections.Counter()
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    for variant, fn in _variants(op):
        for i, sample in enumerate(samples[:SAMPLES_PER_VARIANT]):
            where = f"{op.name} ({variant}, sample {i})"
            try:
                expected = _eager(fn, sample)
            except Exception:
                counts["skipped: eager raises"] += 1
                continue
            if op.name not in METADATA_ONLY and not _equal(expected, _eager(fn, sample)):
                counts["skipped: eager is not deterministic"] += 1
                continue
            try:
                got = _deferred(fn, sample)
            except MetaInitError as e:
                assert op.name in CLEAR_ERRORS, f"{where}: unexpected {type(e).__name__}: {e}"
                counts["clear error"] += 1
                continue
            assert _equal(expected, got, values=op.name not in METADATA_ONLY), where
            counts["exact" if op.name not in METADATA_ONLY else "metadata only"] += 1
    return counts


@pytest.fixture(autouse=True)
def _collect_garbage():
    """Overrides conftest's collection after every test: 700 quick tests, no large tensors."""
    yield


@pytest.mark.parametrize(
    "op", OP_DB, ids=[f"{op.name}.{op.variant_test_name}".rstrip(".") for op in OP_DB]
)
def test_operator_matches_eager(op):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = check_op(op)
    assert counts, f"{op.name}: no sample ran"


if __name__ == "__main__":  # the counts for the README and the closing note
    total: collections.Counter = collections.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in OP_DB:
            total += check_op(op)
    print(f"{len(OP_DB)} operators with CPU float32 samples:", dict(total))


# Random operators: ``op_db`` wraps each in ``wrapper_set_seed`` (reseed to 42, restore the RNG
# state afterwards), which would hide where the op leaves the generator. Here the wrapper is
# bypassed, so each op draws from the stream a model's code would: between a draw before it and
# a tensor drawn after it, which is materialized alone first (it needs the generator's position
# after the op).
RANDOM_OPS = [
    op for op in OP_DB
    if any("wrapper_set_seed" in fn.__code__.co_names for _, fn in _variants(op)
           if hasattr(fn, "__code__"))
]  # fmt: skip


def _in_stream(
    fn: Callable, sample: Any, deferred: bool
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the op's output, a tensor drawn after it, the state read right after the op through the
    generator object itself, the RNG state after both)."""
    torch.manual_seed(0)
    if deferred:
        with meta_init():
            torch.randn(5)
            inp, args, kwargs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
            out = fn(inp, *args, **kwargs)
            right_after = torch.default_generator.get_state()
            later = torch.randn(7)
    else:
        torch.randn(5)
        inp, args, kwargs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
        out = fn(inp, *args, **kwargs)
        right_after = torch.default_generator.get_state()
        later = torch.randn(7)
    return out, later, right_after, torch.get_rng_state()


@pytest.mark.parametrize(
    "op", RANDOM_OPS, ids=[f"{op.name}.{op.variant_test_name}".rstrip(".") for op in RANDOM_OPS]
)
def test_random_operator_matches_eager_in_the_stream_and_leaves_the_rng_state_as_eager(
    op, monkeypatch
):
    # outside the package: torch's test helper reseeds around each sample; off, the stream runs on
    monkeypatch.setattr(
        common_methods_invocations, "wrapper_set_seed", lambda f, *a, **k: f(*a, **k)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _check_in_stream(op), f"{op.name}: no sample ran"


def _check_in_stream(op: Any) -> int:
    ran = 0
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    for variant, fn in _variants(op):
        for i, sample in enumerate(samples[:SAMPLES_PER_VARIANT]):
            where = f"{op.name} ({variant}, sample {i})"
            try:
                expected, expected_later, expected_after, expected_state = _in_stream(
                    fn, sample, deferred=False
                )
            except Exception:
                continue
            got, later, after, state = _in_stream(fn, sample, deferred=True)
            assert torch.equal(after, expected_after), f"{where}: get_state() right after it"
            assert torch.equal(state, expected_state), f"{where}: RNG state after the build"
            materialize(later)
            assert torch.equal(later, expected_later), f"{where}: a tensor drawn after it"
            materialize([t for t in tree_flatten(got)[0] if isinstance(t, DeferredTensor)])
            assert _equal(expected, got, values=op.name not in METADATA_ONLY), where
            ran += 1
    return ran


# Outputs whose requires_grad autograd cannot tell from meta tensors (no meta kernel for the
# probe): every floating output of such an op requires grad when an input does.
GRAD_RULE_UNKNOWN = {"linalg.lstsq"}
GRAD_SAMPLES_PER_VARIANT = 2


def _grad_flags(out: Any) -> list[tuple[bool, bool]]:
    return [(t.requires_grad, t.is_leaf) for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)]  # fmt: skip


def check_requires_grad(op: Any) -> int:
    """On inputs that require grad: every output's ``requires_grad`` and ``is_leaf`` as eager's,
    deferred and after materializing (``requires_grad``). Returns the samples compared."""
    compared = 0
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))
    for variant, fn in _variants(op):
        for i, sample in enumerate(samples[:GRAD_SAMPLES_PER_VARIANT]):
            where = f"{op.name} ({variant}, sample {i})"
            try:
                expected = _eager(fn, sample)
            except Exception:
                continue
            torch.manual_seed(0)
            try:
                with meta_init():
                    inp, args, kwargs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
                    got = fn(inp, *args, **kwargs)
            except MetaInitError:
                continue  # CLEAR_ERRORS, checked by test_operator_matches_eager
            assert _grad_flags(got) == _grad_flags(expected), where
            materialize([t for t in tree_flatten(got)[0] if isinstance(t, DeferredTensor)])
            assert [f[0] for f in _grad_flags(got)] == [f[0] for f in _grad_flags(expected)], where
            compared += 1
    return compared


@pytest.mark.parametrize(
    "op",
    [op for op in OP_DB if op.name not in GRAD_RULE_UNKNOWN and op.supports_autograd],
    ids=lambda op: f"{op.name}.{op.variant_test_name}".rstrip("."),
)
def test_operator_output_requires_grad_matches_eager(op):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_requires_grad(op)


def check_inputs_after(op: Any) -> int:
    """Every tensor handed to the op holds eager's values afterwards: writes the op makes into
    its inputs (declared in its schema or not, such as batch norm's running statistics) are
    recorded. Returns the samples compared."""
    compared = 0
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    for variant, fn in _variants(op):
        for i, sample in enumerate(samples[:GRAD_SAMPLES_PER_VARIANT]):
            where = f"{op.name} ({variant}, sample {i})"
            torch.manual_seed(0)
            eager_inputs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
            try:
                fn(eager_inputs[0], *eager_inputs[1], **eager_inputs[2])
            except Exception:
                continue
            torch.manual_seed(0)
            try:
                with meta_init():
                    inputs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
                    fn(inputs[0], *inputs[1], **inputs[2])
            except MetaInitError:
                continue  # CLEAR_ERRORS, checked by test_operator_matches_eager
            deferred = [t for t in tree_flatten(inputs)[0] if isinstance(t, DeferredTensor)]
            materialize(deferred)
            values = op.name not in METADATA_ONLY
            assert _equal(tree_flatten(eager_inputs)[0], tree_flatten(inputs)[0], values), where
            compared += 1
    return compared


@pytest.mark.parametrize(
    "op", OP_DB, ids=[f"{op.name}.{op.variant_test_name}".rstrip(".") for op in OP_DB]
)
def test_operator_leaves_its_inputs_as_eager_does(op):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_inputs_after(op)


# The ``_foreach_*`` ops (what SGD/Adam with ``foreach=True``, ``clip_grad_norm_`` and EMA
# updates run): their in-place variants write every tensor of a list argument
# (``Tensor(a!)[]``) and return nothing.
FOREACH_OP_DB = [
    op for name in sorted(n for n in dir(common_methods_invocations)
                          if n.startswith("foreach_") and n.endswith("_op_db"))
    for op in getattr(common_methods_invocations, name)
]  # fmt: skip
FOREACH_SAMPLES = 4


def check_foreach_op(op: Any) -> int:
    """Each variant's outputs and every tensor handed to it (lists included) afterwards, as
    eager's. Returns the samples compared."""
    compared = 0
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    for variant, fn in _variants(op):
        for i, sample in enumerate(samples[:FOREACH_SAMPLES]):
            where = f"{op.name} ({variant}, sample {i})"
            torch.manual_seed(0)
            eager_inputs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
            try:
                expected = fn(eager_inputs[0], *eager_inputs[1], **eager_inputs[2])
            except Exception:
                continue
            torch.manual_seed(0)
            with meta_init():
                inputs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
                got = fn(inputs[0], *inputs[1], **inputs[2])
            deferred = [t for t in tree_flatten((inputs, got))[0] if isinstance(t, DeferredTensor)]
            materialize(deferred)
            assert _equal(tree_flatten(eager_inputs)[0], tree_flatten(inputs)[0]), where
            assert _equal(expected, got), where
            compared += 1
    return compared


@pytest.mark.parametrize("op", FOREACH_OP_DB, ids=lambda op: op.name)
def test_foreach_operator_writes_and_outputs_match_eager(op):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check_foreach_op(op), f"{op.name}: no sample ran"


def _all_overloads() -> Iterator[torch._ops.OpOverload]:
    for full in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = full.partition("::")
        name, _, overload = rest.partition(".")
        try:
            yield getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
        except (AttributeError, RuntimeError):
            continue


def test_every_argument_a_schema_marks_written_is_recorded_as_written():
    """The forms of ``(a!)`` in every registered schema are ``Tensor(a!)`` and ``Tensor(a!)[]``
    (a new form, such as ``Tensor(a!)?``, would need the recorder to look inside it), and
    ``op_info`` lists each such argument as written."""
    from jupyter_metainit.core.record.ops import op_info

    forms = set()
    for op in _all_overloads():
        mutated = op_info(op).mutated
        for i, arg in enumerate(op._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write and "Tensor" in str(arg.type):
                forms.add(str(arg.type))
                assert i in mutated, f"{op}: {arg.name}"
    assert forms == {"Tensor", "List[Tensor]"}
