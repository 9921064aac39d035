"""Draw counts: how many 32-bit MT19937 outputs a CPU random op consumes.

As a function of the output's size, dtype and layout and of the op's scalar arguments
(:func:`known_draws`; per element: :func:`draws_per_element`, the one table of it, which
``split_fill`` uses too). Measured on the kernels and, since another PyTorch build may differ,
checked against the real kernel once per process and per (op, dtype, scalar arguments) before
being trusted; an op whose formula does not hold is re-run on scratch memory instead.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.rng.mt19937 import jump_state
from jupyter_metainit.core.rng.scratch import scratch_op
from jupyter_metainit.core.rng.segments import BurnSpec
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["draws_depend_on_values", "draws_per_element", "is_contiguous", "known_draws"]


aten = torch.ops.aten

_HALF = (torch.float16, torch.bfloat16)


_SINGLE = (torch.float32, *_HALF)


def _numel(size: tuple) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _normal_draws(n: int, dtype: torch.dtype, contiguous: bool) -> int | None:
    # normal_fill: blocks of 16 from uniforms; a partial last block redraws the last 16.
    # Below 16 elements (or strided) the serial kernel uses the generator's Box-Muller cache.
    if n < 16 or not contiguous:
        return None
    if dtype == torch.float32:
        return n + (16 if n % 16 else 0)
    if dtype in _HALF:
        return -(-n // 16) * 16
    if dtype == torch.float64:
        return 2 * n + (32 if n % 16 else 0)
    return None


def draws_per_element(dtype: torch.dtype, single: int = 1, double: int = 2) -> int | None:
    """32-bit draws per element of a floating fill: ``single`` for float32/float16/bfloat16,
    ``double`` for float64 (``uniform_``, ``normal_``'s uniforms: 1 and 2), None for others."""
    if dtype in _SINGLE:
        return single
    if dtype == torch.float64:
        return double
    return None


def _random_range_draws(low: Any, high: Any) -> int:
    return 2 if (int(high) - int(low)) >= (1 << 32) else 1


def _output_geometry(spec: BurnSpec) -> tuple[int, torch.dtype, bool] | None:
    """(elements, dtype, contiguous) of the tensor a random op fills or creates."""
    f = spec.func
    if f in _FACTORY_SIZE_ARG:
        size = spec.args[_FACTORY_SIZE_ARG[f]] if len(spec.args) > _FACTORY_SIZE_ARG[f] else None
        if f is aten.randperm.generator:
            size = (spec.args[0],)
        dtype = spec.kwargs.get("dtype")
        if size is None or dtype is None:
            return None
        return _numel(tuple(size)), dtype, True
    target = spec.args[0] if spec.args else None
    if not (isinstance(target, tuple) and len(target) == 4 and target[0] == "tensor"):
        return None
    _, size, stride, dtype = target
    if f in _LIKE_OPS:
        dtype = spec.kwargs.get("dtype") or dtype
        return _numel(size), dtype, True
    return _numel(size), dtype, is_contiguous(size, stride)


def is_contiguous(size: tuple, stride: tuple) -> bool:
    """Whether ``size``/``stride`` is the row-major contiguous layout (size-1 dims ignored)."""
    expected = 1
    for n, st in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


_FACTORY_SIZE_ARG = {
    aten.rand.generator: 0, aten.randn.generator: 0, aten.normal.float_float: 2,
    aten.randint.generator: 1, aten.randint.low_generator: 2, aten.randperm.generator: 0,
}  # fmt: skip


def _overloads(packet: Any, name: str) -> set:
    """``packet.name`` as a one-element set, or empty where this torch has no such overload.

    Read by capability, never by version: ``rand_like.generator`` and ``randn_like.generator``
    exist from torch 2.10; on an older torch the ``*_like`` ops take no generator, so the ones
    it has are re-run on scratch memory like any op without a formula, and importing works."""
    return {getattr(packet, name)} if name in packet.overloads() else set()


_LIKE_OPS = _overloads(aten.rand_like, "generator") | _overloads(aten.randn_like, "generator")
_UNIFORM_OPS = {
    aten.uniform_.default, aten.rand.generator, *_overloads(aten.rand_like, "generator"),
}  # fmt: skip
_NORMAL_OPS = {
    aten.normal_.default, aten.randn.generator, aten.normal.float_float,
    *_overloads(aten.randn_like, "generator"),
}  # fmt: skip


def _argument(spec: BurnSpec, name: str) -> Any:
    for i, a in enumerate(spec.func._schema.arguments):
        if a.name == name:
            if i < len(spec.args):
                return spec.args[i]
            return spec.kwargs.get(name, a.default_value)
    return None


def _draws_nothing(spec: BurnSpec) -> bool:
    """Random ops switched off by their arguments: no dropout probability, not training."""
    names = {a.name for a in spec.func._schema.arguments}
    if "dropout_p" in names:
        return _argument(spec, "dropout_p") == 0
    if "train" in names:
        p = _argument(spec, "p" if "p" in names else "dropout")
        return not _argument(spec, "train") or p == 0
    if "training" in names:
        return not _argument(spec, "training")
    return False


def _draws(spec: BurnSpec, nothing: bool = True) -> int | None:
    """Draws ``spec`` consumes on the CPU generator, or None if not known. ``nothing``: check
    first whether its arguments switch it off."""
    if nothing and _draws_nothing(spec):
        return 0
    if spec.func is aten.native_dropout.default:
        target = spec.args[0]
        n, dtype = _numel(target[1]), target[3]
        return 2 * n if dtype in (*_SINGLE, torch.float64) else None
    geometry = _output_geometry(spec)
    if geometry is None:
        return None
    n, dtype, contiguous = geometry
    f = spec.func
    if f in _UNIFORM_OPS:
        per = draws_per_element(dtype, 1, 2)
        return None if per is None else per * n
    if f in _NORMAL_OPS:
        return _normal_draws(n, dtype, contiguous)
    if f in (
        aten.exponential_.default,
        aten.cauchy_.default,
        aten.geometric_.default,
        aten.bernoulli_.float,
    ):
        return 2 * n if dtype in (*_SINGLE, torch.float64) else None
    if f is aten.random_.default:
        if dtype in (torch.int64, torch.float64):
            return 2 * n
        return (
            n
            if dtype in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, *_SINGLE)
            else None
        )
    if f is aten.random_.to:
        return n * _random_range_draws(0, spec.args[1])
    if f is getattr(aten.random_, "from"):
        to = spec.args[2] if len(spec.args) > 2 else None
        return None if to is None else n * _random_range_draws(spec.args[1], to)
    if f is aten.randint.generator:
        return n * _random_range_draws(0, spec.args[0])
    if f is aten.randint.low_generator:
        return n * _random_range_draws(spec.args[0], spec.args[1])
    if f is aten.randperm.generator:
        return max(n - 1, 0) if n < (1 << 24) else None
    return None


def _shrunk(x: Any) -> Any:
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
        size = tuple(min(d, 1) for d in x[1])
        return ("tensor", size, torch.empty(size, device="meta").stride(), x[3])
    if isinstance(x, (list, tuple)):
        return type(x)(_shrunk(v) for v in x)
    return x


def _probe(spec: BurnSpec, n: int, nothing: bool) -> BurnSpec:
    """``spec`` on a contiguous 1-D output of ``n`` elements (same op, dtype and scalars); for
    an op switched off by its arguments, the same call with every tensor shrunk to one element."""
    f = spec.func
    if nothing:
        kwargs = {k: _shrunk(v) for k, v in spec.kwargs.items()}
        return BurnSpec(f, _shrunk(spec.args), kwargs, spec.has_generator, 0)
    if f in _FACTORY_SIZE_ARG:
        args = list(spec.args)
        args[_FACTORY_SIZE_ARG[f]] = n if f is aten.randperm.generator else [n]
        return BurnSpec(f, tuple(args), spec.kwargs, spec.has_generator, 0)
    dtype = spec.args[0][3]
    return BurnSpec(
        f, (("tensor", (n,), (1,), dtype), *spec.args[1:]), spec.kwargs, spec.has_generator, 0
    )


# Random ops whose number of draws depends only on their arguments' sizes, dtypes and scalars,
# never on the values they read: re-running them on scratch memory moves a generator exactly as
# they do. Every other random op (``poisson``, ``binomial``, ``_standard_gamma`` and
# ``_sample_dirichlet`` behind ``torch.distributions``, ``rrelu_with_noise``: rejection loops,
# draws only for negative inputs; and any op not known here) is run on its real inputs at
# recording, from the exact state, and the state it ends in is kept.
_VALUE_INDEPENDENT = frozenset({
    "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "uniform", "uniform_",
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "random", "random_", "exponential", "exponential_", "cauchy", "cauchy_", "geometric",
    "geometric_", "log_normal", "log_normal_", "native_dropout", "dropout", "alpha_dropout",
    "feature_dropout", "feature_alpha_dropout", "_fused_dropout", "lstm", "gru", "rnn_tanh",
    "rnn_relu", "_cudnn_rnn", "miopen_rnn",
})  # fmt: skip


def draws_depend_on_values(func: Any) -> bool:
    """Whether the draws of random op ``func`` may depend on the values of its inputs."""
    name = func._schema.name.split("::")[-1]
    return name not in _VALUE_INDEPENDENT and "attention" not in name


_verified: dict[Any, bool] = {}


def _formula_key(spec: BurnSpec, nothing: bool) -> Any:
    if nothing:
        scalars = tuple(a for a in spec.args if not isinstance(a, (tuple, list)))
        return (spec.func, "draws nothing", scalars, tuple(sorted(map(str, spec.kwargs.items()))))
    geometry = _output_geometry(spec) if spec.func is not aten.native_dropout.default else None
    scalars = tuple(a for a in spec.args[1:] if not isinstance(a, (tuple, list)))
    return (
        spec.func,
        geometry[1] if geometry else None,
        scalars,
        tuple(sorted((k, str(v)) for k, v in spec.kwargs.items())),
    )


def _formula_holds(spec: BurnSpec, nothing: bool) -> bool:
    key = _formula_key(spec, nothing)
    ok = _verified.get(key)
    if ok is None:
        ok = True
        with plain():
            for n in (37, 64, 1000):
                probe = _probe(spec, n, nothing)
                expected = _draws(probe, nothing)
                if expected is None:
                    ok = False
                    break
                a = torch.Generator().manual_seed(n)
                try:
                    scratch_op(probe, a)
                except Exception:  # the probe's shapes do not suit the op: trust nothing
                    ok = False
                    break
                b = jump_state(torch.Generator().manual_seed(n).get_state(), expected)
                ok = ok and torch.equal(a.get_state(), b)
        _verified[key] = ok
    return ok


_known: dict[Any, int | None] = {}


def known_draws(spec: BurnSpec, device: torch.device) -> int | None:
    """Draws the op consumes on ``device``'s generator, if known and verified (CPU only)."""
    if device.type != "cpu":
        return None
    try:
        key = (spec.func, spec.args, tuple(spec.kwargs.items()))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _known:
        return _known[key]
    if _draws_nothing(spec) and _formula_holds(spec, nothing=True):
        draws: int | None = 0
    else:
        draws = _draws(spec, nothing=False)
        if draws is not None and not _formula_holds(spec, nothing=False):
            draws = None
    if key is not None:
        if len(_known) > 65536:
            _known.clear()
        _known[key] = draws
    return draws
