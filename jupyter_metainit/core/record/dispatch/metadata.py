"""Outputs' metadata: shape, strides, dtype and ``requires_grad`` of an op's outputs, as eager.

An op runs on the meta tensors underneath (:func:`meta_outputs`, cached per call key: a model's
repeated blocks run the same ops on the same shapes). Where PyTorch's meta kernels lay outputs out
otherwise than the CPU kernels, the CPU's layout is learned (:func:`probe_layout`,
:func:`cpu_layout`); which outputs require grad is learned from autograd itself
(:func:`output_requires_grad`).
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.inputs import (
    META,
    is_float,
    meta_of,
    requires_grad,
    storage_nbytes,
)
from jupyter_metainit.core.record.ops import OpInfo
from jupyter_metainit.core.record.state import _global_default_dtype, dtype_override
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain

aten = torch.ops.aten

# In-place random fills and fills: the output is ``self``, unchanged in shape; their meta
# kernels are slow Python decompositions, and they are the bulk of model initialisation.
OVERWRITES_SELF = {
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default, aten.fill_.Scalar,
    aten.zero_.default,
}  # fmt: skip


class Unkeyable(Exception):
    pass


_SCALARS = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


# Argument types of ATen ops that hold no tensor: one home for the recorder's argument keys and
# for ``estimates``' walk of an op's arguments (``core.ATEN_SCALAR_TYPES``).
ATEN_SCALAR_TYPES = frozenset(_SCALARS)


def _arg_key(x: Any, tensors: bool = True) -> Any:
    """A hashable key of an argument: values of plain ones, geometry of tensors (``tensors``;
    else a tensor is ``Unkeyable``)."""
    kind = type(x)
    if kind in ATEN_SCALAR_TYPES:
        return (kind, x)
    if tensors and isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if kind is list or kind is tuple:
        for v in x:
            if type(v) is not int:
                return tuple([_arg_key(v, tensors) for v in x])
        return tuple(x)  # sizes: no (type, value) pairs needed, nothing else is a bare int
    if isinstance(x, _SCALARS):
        return (kind, x)
    raise Unkeyable


def call_key(func: Any, args: tuple, kwargs: dict, tensors: bool = True) -> Any:
    """What an op's result depends on besides values: its arguments' keys and the default
    dtypes in force (``Unkeyable`` if an argument has no key)."""
    return (
        func,
        _global_default_dtype(),
        dtype_override(),
        _arg_key(args, tensors),
        tuple((k, _arg_key(v, tensors)) for k, v in kwargs.items()),
    )


# Output geometry of ops that create new tensors, by (op, input geometry, scalars): a model's
# repeated blocks run the same ops on the same shapes, and many meta kernels are slow Python.
_meta_cache: dict[Any, tuple[type | None, tuple[tuple, ...]]] = {}


_META_CACHE_SIZE = 8192


def meta_outputs(
    func: Any, bound: list, meta_args: tuple, meta_kwargs: dict, info: OpInfo | None = None
) -> Any:
    if func in OVERWRITES_SELF and isinstance(bound[0], DeferredTensor):
        return meta_args[0]
    key = None
    if info is not None and not info.mutated and not any(a is not None for a in info.return_alias):
        try:
            key = call_key(func, meta_args, meta_kwargs)
        except Unkeyable:
            key = None
        hit = _meta_cache.get(key) if key is not None else None
        if hit is not None:
            container, outs = hit
            with plain():
                made = [
                    torch.empty_strided(size, stride, dtype=dtype, device=META)
                    for size, stride, dtype in outs
                ]
            return made[0] if container is None else container(made)
    with plain():
        out = func(*meta_args, **meta_kwargs)
    if key is not None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # (A sparse result is not kept: the geometry kept here is a strided tensor's.)
        if all(
            isinstance(o, torch.Tensor) and o.layout is torch.strided and o.storage_offset() == 0
            for o in outs
        ):
            if len(_meta_cache) >= _META_CACHE_SIZE:
                _meta_cache.clear()
            _meta_cache[key] = (
                type(out) if isinstance(out, (tuple, list)) else None,
                tuple((tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs),
            )
    return out


# Outputs that PyTorch's meta kernels lay out row-major while the CPU kernels (LAPACK) return
# them column-major; recording the CPU layout keeps the deferred tensor's strides eager's.
COLUMN_MAJOR_OUTPUTS = {aten._linalg_svd.default: (2,), aten.linalg_eig.default: (1,)}


# Ops whose meta kernels give outputs another layout (FFTs, unpooling) or shape (the unused
# statistics of batch_norm in eval mode, some outputs of embedding_bag) than the CPU kernels,
# depending on the arguments: the CPU's is learned by running the real kernel on zeros of the
# same geometry, when that is small, and remembered per geometry. (Larger ones keep the meta
# kernel's; an output whose real shape then differs cannot be materialized, with a clear error.)
PROBED = {
    aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default,
    aten.max_unpool2d.default, aten.max_unpool3d.default, aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_no_training.default,
    aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
}  # fmt: skip


_PROBE_BYTES = 16 << 20


_probed: dict[Any, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None] = {}


def _has_size_one_or_zero(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and any(n <= 1 for n in t.shape)


def layout_may_differ(info: OpInfo, meta_args: tuple, meta_kwargs: dict, out: Any) -> bool:
    """True for a new tensor whose strides PyTorch's Python meta kernels may choose otherwise
    than the CPU kernels: on dimensions of size 1 (or 0), elementwise ops and ``*_like`` keep or
    drop the input's stride there by other rules (``empty_like`` of a ``(1, 3, 3)`` tensor with
    strides ``(3, 3, 1)``: ``(9, 3, 1)`` on meta, ``(3, 3, 1)`` on the CPU). Those get the CPU's
    layout by :func:`probe_layout`."""
    if info.mutated or any(a is not None for a in info.return_alias):
        return False  # writes or views: the layout is the input's own
    if info.is_random and not info.has_generator:
        return False  # the probe must not draw from the global generator
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not any(isinstance(o, torch.Tensor) and o.dim() for o in outs):
        return False
    return any(_has_size_one_or_zero(o) for o in outs) or any(
        _has_size_one_or_zero(x) for x in iter_args(meta_args, meta_kwargs)
    )


def probe_layout(
    func: Any, meta_args: tuple, meta_kwargs: dict, out: Any, has_generator: bool = False
) -> Any:
    try:
        key = (func, _arg_key(meta_args), _arg_key(tuple(meta_kwargs.items())))
    except Unkeyable:
        return out
    if has_generator:
        # A generator of its own: the probe's draws touch no generator the user has.
        meta_kwargs = {**meta_kwargs, "generator": torch.Generator()}
    if key not in _probed:
        _probed[key] = None
        tensors = [x for x in iter_args(meta_args, meta_kwargs) if isinstance(x, torch.Tensor)]
        # Outputs count too: small inputs can make a large result (``x.repeat(20000, 20000)``).
        results = [
            o
            for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor)
        ]
        probe_bytes = sum(t.untyped_storage().nbytes() for t in tensors) + sum(
            o.numel() * o.element_size() for o in results
        )
        if probe_bytes <= _PROBE_BYTES:

            def zeros(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                base = torch.zeros(x.untyped_storage().nbytes() // x.element_size(), dtype=x.dtype)
                return base.as_strided(x.shape, x.stride(), x.storage_offset())

            with plain():
                try:
                    zero_args, zero_kwargs = map_args(zeros, meta_args, meta_kwargs)
                    real = func(*zero_args, **zero_kwargs)
                    reals = real if isinstance(real, (tuple, list)) else (real,)
                    _probed[key] = tuple((tuple(r.shape), tuple(r.stride())) for r in reals)
                except Exception:  # the real kernel rejects zeros: keep the meta layout
                    _probed[key] = None
    geometry = _probed[key]
    if geometry is None:
        return out
    outs = out if isinstance(out, (tuple, list)) else (out,)
    with plain():
        fixed = [
            torch.empty_strided(size, stride, dtype=o.dtype, device=META)
            for o, (size, stride) in zip(outs, geometry, strict=True)
        ]
    return type(out)(fixed) if isinstance(out, (tuple, list)) else fixed[0]


def cpu_layout(func: Any, out: Any) -> Any:
    indices = COLUMN_MAJOR_OUTPUTS.get(func)
    if indices is None:
        return out
    outs = list(out)
    for i in indices:
        t = outs[i]
        if t.dim() >= 2 and t.numel() and t.is_contiguous():
            size = tuple(t.shape)
            stride = list(torch.empty(size, device=META).mT.contiguous().mT.stride())
            with plain():
                outs[i] = torch.empty_strided(size, stride, dtype=t.dtype, device=META)
    return type(out)(outs)


def same_layout(value: Any, meta: Any) -> bool:
    """Whether a real output can stand for the storage of its recorded (meta) output."""
    if not isinstance(value, torch.Tensor) or not isinstance(meta, torch.Tensor):
        return not isinstance(value, torch.Tensor) and not isinstance(meta, torch.Tensor)
    return (
        value.shape == meta.shape
        and value.stride() == meta.stride()
        and value.storage_offset() == meta.storage_offset() == 0
        and value.dtype == meta.dtype
        and value.untyped_storage().nbytes() == storage_nbytes(meta)
    )


# Which outputs eager autograd makes require grad, per (op, inputs that require grad, dtypes):
# learned once by running the op on meta tensors with autograd on. Ops with no derivative
# (``ones_like``, ``empty_like``, ``rand_like``, ``new_zeros``, ``full_like``, ...) give fresh
# tensors that do not require grad, whatever their inputs.
_grad_rules: dict[Any, tuple[bool, ...] | None] = {}


_AUTOGRAD_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | (
    torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
)


def output_requires_grad(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[bool, ...] | None:
    """Eager's ``requires_grad`` of each of ``func``'s outputs, or None if it cannot be learned
    (then every floating output of an op with an input that requires grad does)."""
    flags: list[Any] = []
    for x in iter_args(args, kwargs):
        if isinstance(x, torch.Tensor):
            flags.append((requires_grad(x), x.dtype))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    key = (
        func,
        tuple(flags),
        tuple(o.dtype if isinstance(o, torch.Tensor) else None for o in outs),
    )
    if key in _grad_rules:
        return _grad_rules[key]

    def probe_arg(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            m = meta_of(x).detach()
            return m.requires_grad_() if requires_grad(x) and is_float(m.dtype) else m
        if isinstance(x, torch.device):
            return META
        if isinstance(x, torch.Generator):
            return None
        return x

    rule: tuple[bool, ...] | None = None
    try:
        with plain():
            probe_args, probe_kwargs = map_args(probe_arg, args, kwargs)
            # Inside a dispatch handler autograd is switched off for this thread: switch it
            # back on for the probe alone (meta tensors: no data is touched).
            include = torch._C._dispatch_tls_local_include_set()
            exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
            with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
                probed = func(*probe_args, **probe_kwargs)
        results = probed if isinstance(probed, (tuple, list)) else (probed,)
        rule = tuple(isinstance(r, torch.Tensor) and r.requires_grad for r in results)
    except Exception:  # no meta kernel, or autograd refuses the probe: keep the general rule
        rule = None
    if len(_grad_rules) >= 4096:
        _grad_rules.clear()
    _grad_rules[key] = rule
    return rule


# ---------------------------------------------------------------------------------------------
# questions about metadata only: answered from the recording, never by computing values


def made_pinned(storage: Any, device: torch.device | None = None) -> bool:
    """Whether ``storage`` is page-locked memory once replayed (on ``device``, else where it
    was recorded), as eager code made it: its creating op asked for it (``torch.empty(...,
    pin_memory=True)``, ``t.pin_memory()``). Views and in-place writes keep the memory they
    were given; any other op makes new memory, not pinned."""
    creator = storage.writes[0] if storage.writes else None
    if creator is None or (device or storage.device).type != "cpu":
        return False
    return creator.func is aten._pin_memory.default or creator.kwargs.get("pin_memory") is True


def _is_pinned(t: torch.Tensor, device: Any = None) -> bool:
    if isinstance(t, DeferredTensor):
        return made_pinned(t._rec.storage)
    with plain():
        return t.is_pinned() if device is None else t.is_pinned(device)


def _is_set_to(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same memory and geometry: for deferred tensors, the same storage record."""
    if isinstance(a, DeferredTensor) and isinstance(b, DeferredTensor):
        x, y = a._rec, b._rec
        return x.storage is y.storage and (x.size, x.stride, x.offset, x.dtype) == (
            y.size,
            y.stride,
            y.offset,
            y.dtype,
        )
    if isinstance(a, DeferredTensor) or isinstance(b, DeferredTensor):
        return False  # a deferred tensor has no memory a real one could share
    with plain():
        return a.is_set_to(b)


def _on_meta(func: Any) -> Any:
    def answer(*args: Any, **kwargs: Any) -> Any:
        a, k = map_args(meta_of, args, kwargs)
        with plain():
            return func(*a, **k)

    return answer


# Ops that return no tensor and depend on metadata only: without an answer here they would take
# the path of ops that need values (``value_reads``), computing each value of their inputs by replay
# (``torch.distributed.checkpoint`` asks ``is_pinned()`` of every tensor it saves), and failing
# with an error naming an op the user never called where the values cannot be computed.
METADATA_QUERIES: dict[Any, Any] = {
    aten.is_pinned.default: _is_pinned,
    aten.is_set_to.default: _is_set_to,
    **{
        f: _on_meta(f)
        for f in (
            aten.is_same_size.default, aten.is_contiguous.default,
            aten.is_contiguous.memory_format, aten.is_non_overlapping_and_dense.default,
            aten.is_strides_like_format.default, aten.dim.default, aten.numel.default,
            aten.size.default, aten.size.int, aten.stride.default, aten.stride.int,
            aten.storage_offset.default, aten.sym_numel.default, aten.sym_size.default,
            aten.sym_size.int, aten.sym_stride.default, aten.sym_stride.int,
            aten.sym_storage_offset.default, aten.is_complex.default, aten.dense_dim.default,
            aten.sparse_dim.default,
        )
    },
}  # fmt: skip
