"""Recording: what happens to every ATen op that touches a deferred tensor.

Two interception points feed :func:`handle_op`, as in ``torch._subclasses.fake_tensor``:

* ``DeferredTensor.__torch_dispatch__`` sees every ATen op that has a deferred input, inside or
  outside ``meta_init`` (so ``model.half()`` or ``model.apply(init)`` later are recorded too);
* inside ``meta_init``, a dispatch mode (``_context``) also sees factory ops (``torch.ones``) and
  ops on real tensors.

An op is run on the ``meta`` tensors underneath to learn its outputs' metadata, then stored as an
``OpRecord`` on the storages it creates or writes (see ``_graph``). Ops that need values
(``.item()``, writing into a real tensor, ops with no meta kernel or a data-dependent output
shape) get them by exact replay on the CPU (``_replay.compute_values``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from jupyter_metainit.core.errors import MetaInitError, UnsupportedOperatorError
from jupyter_metainit.core.materialize.digest import digest
from jupyter_metainit.core.record.files import FileRegion, read_file_bytes, storage_region
from jupyter_metainit.core.record.graph import (
    Constant,
    External,
    OpRecord,
    RngUse,
    StorageRecord,
    TensorRecord,
    constant_op,
    next_seq,
)
from jupyter_metainit.core.record.ops import OpInfo, Where, bind_arguments, op_info, user_frame
from jupyter_metainit.core.record.state import (
    _global_default_dtype,
    canonical_device,
    default_device,
    dtype_override,
    tls,
)
from jupyter_metainit.core.record.tensor import (
    INTERNAL_ATTRS,
    PARAMETER_ATTRS,
    SHARE_MEMORY_ATTR,
    DeferredTensor,
    as_parameter,
)
from jupyter_metainit.core.replay.replay import compute_values, default_dtype_as
from jupyter_metainit.core.replay.values import value_cache
from jupyter_metainit.core.rng import streams as _rng
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain
from jupyter_metainit.core.runtime.swap import swap_in_place

__all__ = [
    "SUBCLASS_SENSITIVE",
    "call_site",
    "handle_op",
    "read_value",
    "record_call",
    "set_data",
    "wrap_constant",
    "wrap_file_region",
]

aten = torch.ops.aten
META = torch.device("meta")

# In-place random fills and fills: the output is ``self``, unchanged in shape; their meta
# kernels are slow Python decompositions, and they are the bulk of model initialisation.
_OVERWRITES_SELF = {
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default, aten.fill_.Scalar,
    aten.zero_.default,
}  # fmt: skip
_NO_META_KERNEL = (
    NotImplementedError,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.DataDependentOutputException,
)


def call_site() -> Where:
    """Where user code made the call being recorded."""
    return tls.where if tls.where is not None else user_frame()


_COPY_EXTERNALS_BELOW = 1 << 20
# Digests of large real inputs, per tensor object and version (one model uses a tensor often).
_external_digests: dict[int, tuple[Any, int, tuple]] = {}


def external(x: torch.Tensor, where: Where) -> External | Constant:
    """How a real tensor input is kept in the recording: small ones are copied now (nothing can
    change them), large ones are referenced with a digest of their memory, checked at replay."""
    if x.is_meta:  # metadata only (`empty_like(meta_tensor, device="cpu")`): nothing to check
        return External(x, x._version, where)
    with plain():
        if x.untyped_storage().nbytes() <= _COPY_EXTERNALS_BELOW and x.device.type == "cpu":
            return Constant(x.clone())
        cached = _external_digests.get(id(x))
        if cached is not None and cached[0]() is x and cached[1] == x._version:
            content = cached[2]
        else:
            content = digest(x)
            _external_digests[id(x)] = (weakref.ref(x), x._version, content)
            if len(_external_digests) > 4096:
                _external_digests.clear()
    return External(x, x._version, where, content)


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DeferredTensor):
        return t._meta
    if t.layout != torch.strided:
        raise UnsupportedOperatorError(
            f"{t.layout} tensors cannot be used in deferred code (called at {call_site()}); "
            "build them outside meta_init, or use dense tensors"
        )
    with plain():
        n = t.untyped_storage().nbytes() // t.element_size() if t.element_size() else 0
        base = torch.empty(max(n, 1), dtype=t.dtype, device=META)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh meta tensor with ``t``'s geometry (for outputs computed on real values)."""
    with plain():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=META)


def _storage_nbytes(meta: torch.Tensor) -> int:
    try:
        return meta.untyped_storage().nbytes()
    except Exception:
        return meta.numel() * meta.element_size()


# One storage record per file region while it lives: memory-mapped tensors over the same bytes
# alias each other eagerly (two views of one storage in a torch.save file), so they do here.
_file_storages: weakref.WeakValueDictionary[tuple, StorageRecord] = weakref.WeakValueDictionary()


def wrap_file_region(region: FileRegion, device: torch.device) -> DeferredTensor:
    """A deferred ``uint8`` tensor whose recording is "these bytes of this file"."""
    with plain():
        meta = torch.empty(region.nbytes, dtype=torch.uint8, device=META)
    key = (region, device)
    storage = _file_storages.get(key)
    if storage is None:
        storage = StorageRecord(region.nbytes, torch.uint8, device)
        rec = TensorRecord(storage, meta)
        op = OpRecord(next_seq(), read_file_bytes, (region,), {}, (), (rec,), None, call_site())
        storage.writes.append(op)
        _file_storages[key] = storage
    return DeferredTensor(meta, TensorRecord(storage, meta), device)


def wrap_constant(real: torch.Tensor, device: torch.device) -> DeferredTensor:
    """A deferred tensor whose recording is "these values" (data the user handed over)."""
    with plain():
        meta = _to_meta(real)
    storage = StorageRecord(_storage_nbytes(meta), meta.dtype, device)
    rec = TensorRecord(storage, meta)
    op = OpRecord(next_seq(), constant_op, (Constant(real),), {}, (), (rec,), None, call_site())
    storage.writes.append(op)
    return DeferredTensor(meta, rec, device)


def _output_device(kwargs: dict, flat: list) -> torch.device:
    if tls.pending_device is not None:
        return tls.pending_device
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != "meta":
        return canonical_device(dev)
    for x in flat:
        if isinstance(x, DeferredTensor):
            return x.device
    for x in flat:
        if isinstance(x, torch.Tensor):
            return x.device
    return default_device()


def _requires_grad(t: torch.Tensor) -> bool:
    return t._rg if isinstance(t, DeferredTensor) else t.requires_grad


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def handle_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record one ATen call (see :func:`_handle_op`)."""
    try:
        return _handle_op(func, args, kwargs)
    except NotImplementedError as e:
        if "NestedTensorMeta" not in str(e) and "SparseMeta" not in str(e):
            raise
        # Nested (jagged) and sparse tensors built on PyTorch's meta device inside meta_init.
        raise UnsupportedOperatorError(
            f"{func} on a nested or sparse tensor cannot be deferred (called at {call_site()}); "
            "build nested and sparse tensors outside meta_init, or use dense tensors"
        ) from None


def _handle_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record one ATen call that involves a deferred tensor (or any call inside ``meta_init``).

    Use it only as the dispatch handler of ``DeferredTensor`` and of the ``meta_init`` mode.
    What it does, and the rules replay (``_replay.plan``) relies on:

    * **No deferred input** (only seen inside ``meta_init``): views of real tensors, ops that
      write a real tensor and ops that return no tensor run for real; everything else (factory
      calls, new tensors computed from real ones) is recorded, real inputs kept as ``External``
      (their version is checked at replay).
    * **Values needed**: an op that returns no tensor (``.item()``, ``equal``) or writes a real
      tensor from deferred ones gets the deferred inputs' exact values by replay, and runs.
    * **Views** are not recorded: the output is a new ``TensorRecord`` (geometry, dtype) over
      the input's ``StorageRecord``, so everything done through any view lands on the storage.
    * **In-place view ops** (``t_``, ``squeeze_``, ``as_strided_``, ``set_``) change the
      tensor's own geometry: the same Python object gets the new metadata; no data is written.
    * **Everything else** becomes one ``OpRecord`` appended to the ``writes`` of each storage
      it creates (its non-aliasing outputs) or writes in place (``mutated`` arguments), in
      recording order (``seq``), with the storages it ``reads`` as of that moment.

    See :func:`_record` for what an ``OpRecord`` holds.
    """
    if not isinstance(func, torch._ops.OpOverload):
        raise UnsupportedOperatorError(f"{func} is not an ATen operator; it cannot be deferred")
    if func.is_view and args and type(args[0]) is DeferredTensor:
        return _view(func, args, kwargs)
    if func in _OVERWRITES_SELF and type(args[0]) is DeferredTensor:
        made = _record_fill(func, args, kwargs)
        if made is not None:
            return made
    if func in _recipe_funcs and tls.pending_device is not None:
        made = _record_from_recipe(func, args, kwargs)
        if made is not None:
            return made
    info = op_info(func)
    flat = iter_args(args, kwargs)
    has_deferred = any(isinstance(x, DeferredTensor) for x in flat)
    bound = bind_arguments(func, args, kwargs)
    # Every tensor the op writes: ``Tensor(a!)``, each element of ``Tensor(a!)[]`` (the
    # ``_foreach_*_`` ops, fused optimizers, ``out=`` lists) and undeclared writes.
    written = [
        t
        for i in info.written(bound)
        for t in (bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]])
        if isinstance(t, torch.Tensor)
    ]
    mutated_real = any(not isinstance(t, DeferredTensor) for t in written)
    mutated_deferred = any(isinstance(t, DeferredTensor) for t in written)
    if not has_deferred:
        if func is aten.lift_fresh.default:
            return wrap_constant(args[0], _output_device(kwargs, flat))
        if _on_meta(kwargs, flat):
            # PyTorch's own meta device, asked for explicitly (`with torch.device("meta")`, as
            # transformers builds a model before loading it): plain meta tensors, as eagerly;
            # random ops on them draw nothing.
            with plain():
                return func(*args, **kwargs)
        if mutated_real or func.is_view or not info.returns_tensors:
            if info.is_random:
                # Real random work: the generator must be where eager code has it.
                _rng.before_real_draw(_generator_argument(info, bound))
            with plain():
                return func(*args, **kwargs)
    elif mutated_real or (not info.returns_tensors and not mutated_deferred):
        # Values needed now. (An op that returns nothing but writes deferred tensors, as
        # ``_foreach_mul_`` and the fused optimizers do, is recorded like any in-place op.)
        if info.is_random:
            _rng.before_real_draw(_generator_argument(info, bound))
        if mutated_deferred:
            return _run_on_values_and_record_writes(func, args, kwargs, written)
        return _run_on_values(func, args, kwargs)
    if _makes_quantized(func, kwargs):
        raise UnsupportedOperatorError(
            f"{func} makes a quantized tensor, which cannot be deferred (called at "
            f"{call_site()}; e.g. torch.ao.quantization.quantize_dynamic on a deferred model). "
            "Materialize first (jupyter_metainit.materialize(model)), then quantize; or build "
            "the quantized tensor outside meta_init"
        )
    if info.is_inplace_view:
        return _inplace_view(func, info, bound, args, kwargs)
    return _record(func, info, bound, flat, args, kwargs)


_QUANTIZED_DTYPES = frozenset(
    {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)


def _makes_quantized(func: Any, kwargs: dict) -> bool:
    """Whether ``func`` returns a quantized tensor (``quantize_per_tensor``,
    ``_empty_affine_quantized``, a factory with a quantized dtype): replay has no way to make
    one (its values are integers plus scales, and they copy into no plain tensor)."""
    name = func._schema.name.split("::")[-1]
    if "fake_quantize" in name:  # returns a float tensor: recorded like any op
        return False
    return (
        name.startswith("quantize_per")
        or "affine_quantized" in name
        or kwargs.get("dtype") in _QUANTIZED_DTYPES
    )


def _generator_argument(info: OpInfo, bound: list) -> torch.Generator | None:
    gen = bound[info.arg_index("generator")] if info.has_generator else None
    return gen if isinstance(gen, torch.Generator) else None


def _view(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a deferred tensor: new geometry over the same storage, nothing recorded.

    The most frequent op in model code (``view``, ``t``, slicing), so it skips everything else.
    """
    self: DeferredTensor = args[0]
    meta_args = [self._meta]
    for a in args[1:]:
        meta_args.append(_to_meta(a) if isinstance(a, torch.Tensor) else a)
    with plain():
        out = func(*meta_args, **kwargs)
    rg = self._rg and func is not aten.detach.default and torch.is_grad_enabled()
    storage, device = self._rec.storage, self.device
    # The tensor this is a view of, as eager's ``_base``: an in-place op through the view that
    # makes it require grad makes the base require grad too (``pad(mode="circular")``).
    base = getattr(self, "_view_of", None)
    if base is None:
        base = self
    if isinstance(out, torch.Tensor):
        r = rg and _is_float(out.dtype)
        made = DeferredTensor(out, TensorRecord(storage, out), device, r, r)
        made._view_of = base
        return made
    results = []
    for o in out:
        r = rg and _is_float(o.dtype)
        made = DeferredTensor(o, TensorRecord(storage, o), device, r, r)
        made._view_of = base
        results.append(made)
    return type(out)(results)


def _on_meta(kwargs: dict, flat: list) -> bool:
    """An op on meta tensors, or a factory told ``device="meta"`` (not by our own rewrite)."""
    if tls.pending_device is not None:
        return False  # the call named a real device; `meta` is our rewrite of it
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if tensors:
        return all(t.is_meta for t in tensors)
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def _run_on_values(func: Any, args: tuple, kwargs: dict) -> Any:
    """Ops that need data (``.item()``, ``bool(t)``, writing into a real tensor): compute the
    deferred inputs' exact values by replay, on the CPU, leaving them deferred."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = _values_of(deferred, func)
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}
    a, k = map_args(lambda x: by_id.get(id(x), x), args, kwargs)
    with plain():
        return func(*a, **k)


def _run_on_values_and_record_writes(
    func: Any, args: tuple, kwargs: dict, written: list[torch.Tensor]
) -> Any:
    """An op that writes real and deferred tensors together (``_foreach_add_([real,
    deferred], 1)``): it runs now on the deferred inputs' exact values, so the real tensors get
    their writes, and each written deferred tensor gets the values it came out with as a
    recorded ``copy_``."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = _values_of(deferred, func)
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}
    a, k = map_args(lambda x: by_id.get(id(x), x), args, kwargs)
    with plain():
        out = func(*a, **k)
    for t in written:
        if isinstance(t, DeferredTensor):
            t.copy_(by_id[id(t)])
    # An output that is a written input is the deferred tensor itself, as eagerly.
    back = {id(v): d for d, v in zip(deferred, values, strict=True)}
    if isinstance(out, torch.Tensor):
        return back.get(id(out), out)
    if isinstance(out, (tuple, list)):
        return type(out)(back.get(id(o), o) for o in out)
    return out


def _values_of(deferred: list[DeferredTensor], func: Any) -> list[torch.Tensor]:
    try:
        return compute_values([d._rec for d in deferred])
    except MetaInitError as e:
        raise UnsupportedOperatorError(
            f"{func} needs the values of its deferred inputs, and they cannot be computed: {e}; "
            f"called at {call_site()}"
        ) from e


def read_value(t: DeferredTensor) -> torch.Tensor:
    """The exact current values of a deferred tensor, as a new real CPU tensor."""
    return compute_values([t._rec])[0]


def _set_geometry(
    t: DeferredTensor, meta: torch.Tensor, storage: StorageRecord | None = None
) -> None:
    """Give ``t`` (the same Python object) new metadata over ``storage`` (default: its own)."""
    rec = TensorRecord(storage if storage is not None else t._rec.storage, meta)
    new = DeferredTensor(meta, rec, t.device, t._rg, t._derived)
    torch._C._swap_tensor_impl(t, new)
    t._meta, t._rec = meta, rec


def _inplace_view(func: Any, info: OpInfo, bound: list, args: tuple, kwargs: dict) -> Any:
    """``t_()``, ``squeeze_()``, ``as_strided_()``, ``set_()``, ``resize_()``, ``detach_()``."""
    self = bound[0]
    where = call_site()
    if not isinstance(self, DeferredTensor):
        source = bound[1] if len(bound) > 1 else None
        if func in (aten.set_.source_Tensor, aten.set_.source_Tensor_storage_offset):
            raise UnsupportedOperatorError(
                f"a real tensor cannot be made to share a deferred tensor's memory ({func} at "
                f"{where}); use `real.copy_(deferred)` or materialize the deferred one first"
            )
        raise UnsupportedOperatorError(f"{func} with these arguments ({source!r}) at {where}")
    if func in (aten.set_.source_Storage, aten.set_.source_Storage_storage_offset):
        storage = bound[1]
        if isinstance(storage, torch.UntypedStorage) and _holds_no_memory(storage):
            raise UnsupportedOperatorError(
                f"`tensor.set_(storage, ...)` with the storage of a deferred tensor (called at "
                f"{where}): a deferred tensor's storage holds no memory to share. Pass the "
                "deferred tensor itself, `tensor.set_(deferred, offset, size, stride)`, or "
                "materialize it first (jupyter_metainit.materialize)"
            )
        region = storage_region(storage) if isinstance(storage, torch.UntypedStorage) else None
        if region is not None:
            # torch.load(mmap=True) rebuilds each tensor as `empty(0).set_(storage, ...)` over
            # a mapping of the file: the tensor becomes a view of "these bytes of that file".
            source = wrap_file_region(region, self.device)
            with plain():
                meta = torch.empty(0, dtype=self.dtype, device=META)
                meta.set_(source._meta.untyped_storage(), *args[2:], **kwargs)
            _set_geometry(self, meta, source._rec.storage)
            return self
        if isinstance(storage, torch.UntypedStorage) and storage.device.type != "meta":
            # `empty(0).set_(storage, ...)`, how torch.load rebuilds tensors: the deferred
            # tensor becomes that real tensor (memory-mapped ones stay mapped).
            with plain():
                real = torch.empty(0, dtype=self.dtype, device=storage.device)
                real.set_(storage, *args[2:], **kwargs)
            set_data(self, real)
            return self
        raise UnsupportedOperatorError(
            f"{func} with a storage object cannot be deferred (called at {where}); use "
            "`t.set_(other_tensor)` or a view instead"
        )
    source = bound[1] if len(bound) > 1 else None
    if func in (aten.set_.source_Tensor, aten.set_.source_Tensor_storage_offset) and not (
        isinstance(source, DeferredTensor)
    ):
        set_data(self, source)  # `deferred.set_(real)`: the object now is that real tensor
        return self
    with plain():
        meta = self._meta.detach()  # a new meta object; the old one may be held by views
        meta_args = (meta, *(_to_meta(a) if isinstance(a, torch.Tensor) else a for a in args[1:]))
        meta_kwargs = {
            k: _to_meta(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        }
        func(*meta_args, **meta_kwargs)
    storage = None
    if func in (aten.set_.source_Tensor, aten.set_.source_Tensor_storage_offset):
        storage = source._rec.storage
    elif func is aten.set_.default:
        storage = StorageRecord(0, meta.dtype, self.device)
        created = TensorRecord(storage, meta)
        kwargs = {"dtype": meta.dtype, "device": self.device}
        empty = OpRecord(
            next_seq(), aten.empty.memory_format, ((0,),), kwargs, (), (created,), None, where
        )
        storage.writes.append(empty)
    elif _storage_nbytes(meta) > self._rec.storage.nbytes:
        raise UnsupportedOperatorError(
            f"{func} grows a deferred tensor beyond its memory (called at {where}); create a new "
            "tensor of the size you need instead"
        )
    _set_geometry(self, meta, storage)
    if func is aten.detach_.default:
        self._rg = False
    return self


def _holds_no_memory(storage: torch.UntypedStorage) -> bool:
    """A deferred tensor's ``untyped_storage()``: PyTorch refuses to give its address."""
    if storage.device.type == "meta" or storage.nbytes() == 0:
        return False
    try:
        storage.data_ptr()
    except RuntimeError:
        return True
    return False


class _Unkeyable(Exception):
    pass


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)  # fmt: skip


_SCALAR_TYPES = frozenset(_SCALARS)


def _arg_key(x: Any, tensors: bool = True) -> Any:
    """A hashable key of an argument: values of plain ones, geometry of tensors (``tensors``;
    else a tensor is ``_Unkeyable``)."""
    kind = type(x)
    if kind in _SCALAR_TYPES:
        return (kind, x)
    if tensors and isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if kind is list or kind is tuple:
        if all(type(v) is int for v in x):
            return tuple(x)  # sizes: no (type, value) pairs needed, nothing else is a bare int
        return tuple(_arg_key(v, tensors) for v in x)
    if isinstance(x, _SCALARS):
        return (kind, x)
    raise _Unkeyable


def _call_key(func: Any, args: tuple, kwargs: dict, tensors: bool = True) -> Any:
    """What an op's result depends on besides values: its arguments' keys and the default
    dtypes in force (``_Unkeyable`` if an argument has no key)."""
    return (func, _global_default_dtype(), dtype_override(), _arg_key(args, tensors),
            tuple((k, _arg_key(v, tensors)) for k, v in kwargs.items()))  # fmt: skip


# Output geometry of ops that create new tensors, by (op, input geometry, scalars): a model's
# repeated blocks run the same ops on the same shapes, and many meta kernels are slow Python.
_meta_cache: dict[Any, tuple[type | None, tuple[tuple, ...]]] = {}
_META_CACHE_SIZE = 8192


def _meta_outputs(
    func: Any, bound: list, meta_args: tuple, meta_kwargs: dict, info: OpInfo | None = None
) -> Any:
    if func in _OVERWRITES_SELF and isinstance(bound[0], DeferredTensor):
        return meta_args[0]
    key = None
    if info is not None and not info.mutated and not any(a is not None for a in info.return_alias):
        try:
            key = _call_key(func, meta_args, meta_kwargs)
        except _Unkeyable:
            key = None
        hit = _meta_cache.get(key) if key is not None else None
        if hit is not None:
            container, outs = hit
            with plain():
                made = [torch.empty_strided(size, stride, dtype=dtype, device=META)
                        for size, stride, dtype in outs]  # fmt: skip
            return made[0] if container is None else container(made)
    with plain():
        out = func(*meta_args, **meta_kwargs)
    if key is not None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if all(isinstance(o, torch.Tensor) and o.storage_offset() == 0 for o in outs):
            if len(_meta_cache) >= _META_CACHE_SIZE:
                _meta_cache.clear()
            _meta_cache[key] = (
                type(out) if isinstance(out, (tuple, list)) else None,
                tuple((tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs),
            )
    return out


def _full_overwrite(func: Any, bound: list) -> StorageRecord | None:
    """The storage ``func`` writes completely without reading it, if any.

    Fills (``normal_``, ``uniform_``, ``zero_``, ``fill_``) and ``copy_`` from another storage,
    through a view that covers every byte of its storage.
    """
    self = bound[0] if bound else None
    if not isinstance(self, DeferredTensor):
        return None
    if func is aten.copy_.default:
        src = bound[1]
        if isinstance(src, DeferredTensor) and src._rec.storage is self._rec.storage:
            return None
    elif func not in _OVERWRITES_SELF:
        return None
    meta, storage = self._meta, self._rec.storage
    if meta.numel() * meta.element_size() != storage.nbytes:
        return None
    return storage if meta.is_contiguous() or _dense(meta.shape, meta.stride()) else None


def _dense(size: Any, stride: Any) -> bool:
    """Non-overlapping and dense: the elements are one block of memory in some dim order."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride, strict=True) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True


# Outputs that PyTorch's meta kernels lay out row-major while the CPU kernels (LAPACK) return
# them column-major; recording the CPU layout keeps the deferred tensor's strides eager's.
_COLUMN_MAJOR_OUTPUTS = {aten._linalg_svd.default: (2,), aten.linalg_eig.default: (1,)}


# Ops whose meta kernels give outputs another layout (FFTs, unpooling) or shape (the unused
# statistics of batch_norm in eval mode, some outputs of embedding_bag) than the CPU kernels,
# depending on the arguments: the CPU's is learned by running the real kernel on zeros of the
# same geometry, when that is small, and remembered per geometry. (Larger ones keep the meta
# kernel's; an output whose real shape then differs cannot be materialized, with a clear error.)
_PROBED = {
    aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default,
    aten.max_unpool2d.default, aten.max_unpool3d.default, aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_no_training.default,
    aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
}  # fmt: skip
_PROBE_BYTES = 16 << 20
_probed: dict[Any, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None] = {}


def _has_size_one_or_zero(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and any(n <= 1 for n in t.shape)


def _layout_may_differ(info: OpInfo, meta_args: tuple, meta_kwargs: dict, out: Any) -> bool:
    """True for a new tensor whose strides PyTorch's Python meta kernels may choose otherwise
    than the CPU kernels: on dimensions of size 1 (or 0), elementwise ops and ``*_like`` keep or
    drop the input's stride there by other rules (``empty_like`` of a ``(1, 3, 3)`` tensor with
    strides ``(3, 3, 1)``: ``(9, 3, 1)`` on meta, ``(3, 3, 1)`` on the CPU). Those get the CPU's
    layout by :func:`_probe_layout`."""
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


def _probe_layout(
    func: Any, meta_args: tuple, meta_kwargs: dict, out: Any, has_generator: bool = False
) -> Any:
    try:
        key = (func, _arg_key(meta_args), _arg_key(tuple(meta_kwargs.items())))
    except _Unkeyable:
        return out
    if has_generator:
        # A generator of its own: the probe's draws touch no generator the user has.
        meta_kwargs = {**meta_kwargs, "generator": torch.Generator()}
    if key not in _probed:
        _probed[key] = None
        tensors = [x for x in iter_args(meta_args, meta_kwargs) if isinstance(x, torch.Tensor)]
        # Outputs count too: small inputs can make a large result (``x.repeat(20000, 20000)``).
        results = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor)]  # fmt: skip
        probe_bytes = sum(t.untyped_storage().nbytes() for t in tensors) + sum(
            o.numel() * o.element_size() for o in results
        )
        if probe_bytes <= _PROBE_BYTES:

            def zeros(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                base = torch.zeros(x.untyped_storage().nbytes() // x.element_size(),
                                   dtype=x.dtype)  # fmt: skip
                return base.as_strided(x.shape, x.stride(), x.storage_offset())

            with plain():
                try:
                    real = func(*map_args(zeros, meta_args, meta_kwargs)[0],
                                **map_args(zeros, meta_args, meta_kwargs)[1])  # fmt: skip
                    reals = real if isinstance(real, (tuple, list)) else (real,)
                    _probed[key] = tuple((tuple(r.shape), tuple(r.stride())) for r in reals)
                except Exception:  # the real kernel rejects zeros: keep the meta layout
                    _probed[key] = None
    geometry = _probed[key]
    if geometry is None:
        return out
    outs = out if isinstance(out, (tuple, list)) else (out,)
    with plain():
        fixed = [torch.empty_strided(size, stride, dtype=o.dtype, device=META)
                 for o, (size, stride) in zip(outs, geometry, strict=True)]  # fmt: skip
    return type(out)(fixed) if isinstance(out, (tuple, list)) else fixed[0]


def _cpu_layout(func: Any, out: Any) -> Any:
    indices = _COLUMN_MAJOR_OUTPUTS.get(func)
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


def _meta_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x._meta if type(x) is DeferredTensor else _to_meta(x)
    if isinstance(x, torch.device):
        return META
    return x


def _uses_default_dtype(flat: list, out: Any) -> bool:
    """True if ``out``'s floating dtype can only have come from the default dtype."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not any(isinstance(o, torch.Tensor) and _is_float(o.dtype) for o in outs):
        return False
    return not any(isinstance(x, torch.Tensor) and _is_float(x.dtype) for x in flat)


def _explicit_default_dtype(
    func: Any, info: OpInfo, args: tuple, kwargs: dict, dtype: torch.dtype, out: Any
) -> tuple[tuple, dict] | None:
    """The same op with its result dtype made explicit, where that changes no value.

    An op whose floating result comes from the default dtype (``int_t / 16``, ``int_t * 0.5``,
    ``torch.sqrt(int_t)``) promotes its inputs to that dtype and computes in it. Giving it a
    0-dim ``dtype`` tensor for each Python number, or (pointwise ops without numbers) its first
    integer input cast to ``dtype``, promotes to the same dtype and computes the same values,
    and makes replay independent of the default in force then. None when neither applies.
    """
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, torch.Tensor) and o.is_complex() for o in outs):
        return None
    schema = func._schema.arguments
    tensor_slots = {a.name for a in schema if str(a.type) in ("Tensor", "Optional[Tensor]")}

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def zero_dim(x: Any) -> torch.Tensor:
        with plain():
            return torch.tensor(x, dtype=dtype)

    new_args = list(args)
    new_kwargs = dict(kwargs)
    changed = False
    for i, x in enumerate(args):
        if i < len(schema) and schema[i].name in tensor_slots and number(x):
            new_args[i], changed = zero_dim(x), True
    for k, x in kwargs.items():
        if k in tensor_slots and number(x):
            new_kwargs[k], changed = zero_dim(x), True
    if not changed and torch.Tag.pointwise in func.tags:
        for i, x in enumerate(args):
            if i < len(schema) and schema[i].name in tensor_slots and isinstance(x, torch.Tensor):
                new_args[i] = aten._to_copy.default(x, dtype=dtype)
                changed = True
                break
    return (tuple(new_args), new_kwargs) if changed else None


# Recipes of factory calls (``torch.empty``, ``zeros``, ``ones``, ``full``, ``arange``: no tensor
# argument, no random draw), by (op, arguments, default dtypes, device). A model makes the same
# factory calls over and over (every layer's parameters), and each was a full recording: binding,
# meta kernel, dtype resolution. A recipe is what that recording produced, so replaying it makes
# the same deferred tensor and the same ``OpRecord``, for about a third of the cost.
_recipes: dict[Any, tuple[tuple, tuple, torch.dtype, tuple, dict]] = {}
_recipe_funcs: set[Any] = set()
_RECIPES_SIZE = 8192


def _factory_key(func: Any, args: tuple, kwargs: dict) -> Any:
    """The recipe key, or None when an argument is not a plain value (a tensor, anything odd)."""
    try:
        return tls.pending_device, _call_key(func, args, kwargs, tensors=False)
    except _Unkeyable:
        return None


def _keep_recipe(func: Any, args: tuple, kwargs: dict, out: torch.Tensor, op: OpRecord) -> None:
    key = _factory_key(func, args, kwargs)
    if key is None:
        return
    if len(_recipes) >= _RECIPES_SIZE:
        _recipes.clear()
    _recipes[key] = (tuple(out.shape), tuple(out.stride()), out.dtype, _copied(op.args),
                     dict(op.kwargs))  # fmt: skip
    _recipe_funcs.add(func)


def _new_output(
    meta: torch.Tensor, device: torch.device, rg: bool
) -> tuple[DeferredTensor, TensorRecord, StorageRecord]:
    """A deferred tensor over a new storage (an op's non-aliasing output): the one way both a
    recording and a recipe make them."""
    storage = StorageRecord(_storage_nbytes(meta), meta.dtype, device)
    rec = TensorRecord(storage, meta)
    return DeferredTensor(meta, rec, device, rg, rg), rec, storage


def _copied(args: tuple) -> tuple:
    """Each record gets its own size lists: nothing recorded is shared between two ops."""
    return tuple(list(a) if type(a) is list else a for a in args)


def _record_from_recipe(func: Any, args: tuple, kwargs: dict) -> DeferredTensor | None:
    """The recording of a factory call seen before with the same arguments (see ``_recipes``)."""
    key = _factory_key(func, args, kwargs)
    recipe = _recipes.get(key) if key is not None else None
    if recipe is None:
        return None
    size, stride, dtype, rec_args, rec_kwargs = recipe
    where = call_site()
    device = tls.pending_device
    with plain():
        meta = torch.empty_strided(size, stride, dtype=dtype, device=META)
    made, rec, storage = _new_output(meta, device, False)
    op = OpRecord(next_seq(), func, _copied(rec_args), dict(rec_kwargs), (), (rec,), None, where,
                  None, (), ())  # fmt: skip
    storage.writes.append(op)
    return made


def _record_fill(func: Any, args: tuple, kwargs: dict) -> DeferredTensor | None:
    """``t.zero_()``, ``t.fill_(v)``, ``t.normal_(...)`` on a deferred ``t`` with plain number
    arguments: the bulk of a model's initialisation, recorded as :func:`_record` would, without
    its general machinery (binding, meta kernels, dtypes: a fill changes none of them). None
    when an argument is not a plain value (``_record`` then takes it)."""
    for a in args[1:]:
        if type(a) not in _SCALAR_TYPES:
            return None
    generator = None
    for k, v in kwargs.items():
        if k == "generator":
            if v is not None and not isinstance(v, torch.Generator):
                return None
            generator = v
        elif type(v) not in _SCALAR_TYPES:
            return None
    self: DeferredTensor = args[0]
    where = call_site()
    storage = self._rec.storage
    overwrites = _full_overwrite(func, args)
    rng = None
    rec_kwargs = dict(kwargs)
    if func not in _PLAIN_FILLS:
        meta = self._meta
        rng, _ = _place_random(func, (meta, *args[1:]), kwargs, True, generator,
                               meta.numel() * meta.element_size(), self.device)  # fmt: skip
        if "generator" in rec_kwargs:
            rec_kwargs["generator"] = None
    op = OpRecord(
        next_seq(), func, (self._rec, *args[1:]), rec_kwargs,
        () if overwrites is not None else (storage,), (None,), rng, where, None, (storage,),
        () if overwrites is None else (overwrites,),
    )  # fmt: skip
    storage.writes.append(op)
    return self


_PLAIN_FILLS = frozenset({aten.fill_.Scalar, aten.zero_.default})


def _place_random(
    func: Any, meta_args: tuple, meta_kwargs: dict, has_generator: bool,
    generator: torch.Generator | None, nbytes: int, device: torch.device,
    real_call: tuple[tuple, dict, OpInfo] | None = None,
) -> tuple[RngUse, Any]:  # fmt: skip
    """The place of a new random op in its generator's stream (see ``_rng.record_random``),
    and the op's real outputs when its draw count depends on values (else None).

    ``device``: where the op's output is recorded; without an explicit generator the op draws
    from that device's default generator, as eagerly (``_rng.default_generator_for``).

    ``real_call``: the op's arguments and info, for an op whose draws may depend on the values
    it reads (``_rng.draws_depend_on_values``): its inputs are computed now and it runs from
    the exact generator state, so the stream after it is exact whatever is materialized later.
    """
    spec = _rng.BurnSpec(func, _spec_args(meta_args), _spec_kwargs(meta_kwargs), has_generator,
                         nbytes)  # fmt: skip
    if generator is None:
        generator = _rng.default_generator_for(device)
    gen = generator if generator is not None else torch.default_generator
    run = None
    if (
        real_call is not None
        and _rng.draws_depend_on_values(func)
        and _rng.known_draws(spec, gen.device) is None
    ):
        run = _real_random_call(func, *real_call, gen.device)
    segment, index, outputs = _rng.record_random(generator, spec, flush_now=tls.depth == 0, run=run)
    return RngUse(segment, index), outputs


def _real_random_call(
    func: Any, args: tuple, kwargs: dict, info: OpInfo, device: torch.device
) -> Any:
    """``func`` on the real values of its inputs (computed now, on ``device``), as a function
    of the generator it draws from. Arguments it writes get copies: nothing real is changed."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = _values_of(deferred, func)
    by_id = {id(d): v.to(device) for d, v in zip(deferred, values, strict=True)}
    bound = bind_arguments(func, args, kwargs)
    written = {id(x) for i in info.mutated for x in iter_args((bound[i],), {})}

    def real_of(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            v = by_id[id(x)]
            return v.clone() if id(x) in written else v
        if isinstance(x, torch.device):
            return device
        return x

    a, k = map_args(real_of, args, kwargs)
    gi = info.arg_index("generator") if info.has_generator else None

    def run(gen: torch.Generator | None) -> Any:
        call_args, call_kwargs = list(a), dict(k)
        if gi is not None and gi < len(call_args):
            call_args[gi] = gen
        elif gi is not None:
            call_kwargs["generator"] = gen
        with plain():
            return func(*call_args, **call_kwargs)

    return run


def _record(func: Any, info: OpInfo, bound: list, flat: list, args: tuple, kwargs: dict) -> Any:
    """Record ``func(*args, **kwargs)`` and return its deferred outputs.

    The ``OpRecord`` holds the op with tensors replaced by ``TensorRecord``s (deferred inputs),
    ``External``s (real inputs) or ``Constant``s, and explicit where replay must not depend on
    what is in force later: the device each output reports, the dtype of factories whose dtype
    was left to the default, a generator slot for every random op (``rand`` is recorded as
    ``rand.generator``), and the default dtype for the few ops whose result dtype comes from it.
    Random ops also get their place in their generator's stream (``_rng.record_random``).
    """
    where = call_site()
    device = _output_device(kwargs, flat)
    called_with = args, kwargs  # before dtype resolution rewrites them: the recipe's key
    called_func = func  # autograd's rule is the called overload's (``randint_like.default``)
    if info.generator_overload is not None:
        func, kwargs = info.generator_overload, {**kwargs, "generator": None}
        info = op_info(func)
        bound = bind_arguments(func, args, kwargs)

    meta_args, meta_kwargs = map_args(_meta_of, args, kwargs)
    if "device" in meta_kwargs and meta_kwargs["device"] is not None:
        meta_kwargs["device"] = META
    values: Any = None
    default_dtype: torch.dtype | None = None
    try:
        out = _cpu_layout(func, _meta_outputs(func, bound, meta_args, meta_kwargs, info))
        if _not_strided(out):
            return _computed_not_strided(func, args, kwargs, device, where)
        if func in _PROBED:
            out = _probe_layout(func, meta_args, meta_kwargs, out)
        elif _layout_may_differ(info, meta_args, meta_kwargs, out):
            out = _probe_layout(func, meta_args, meta_kwargs, out, info.has_generator)
    except _NO_META_KERNEL:
        try:
            out, values = _outputs_from_values(func, info, args, kwargs, where)
        except _NotStridedResult as e:
            return e.result
    except RuntimeError:
        # A meta kernel stricter than the real one (an in-place op that resizes): decide on
        # the real kernel when that is cheap; an error eager code gets too is raised as is.
        if _deferred_input_bytes(flat) > _VALUES_FOR_ERRORS:
            raise
        try:
            out, values = _outputs_from_values(func, info, args, kwargs, where)
        except _NotStridedResult as e:
            return e.result
    else:
        if info.dtype_index is not None and not info.takes_tensors:
            # A factory: replay gets the dtype explicitly, never the default in force then.
            if bound[info.dtype_index] is None:
                global_default, override = _global_default_dtype(), dtype_override()
                if (
                    override is not None
                    and override != global_default
                    and isinstance(out, torch.Tensor)
                    and out.dtype == global_default
                ):
                    meta_kwargs = {**meta_kwargs, "dtype": override}
                    out = _meta_outputs(func, bound, meta_args, meta_kwargs)
                kwargs = {**kwargs, "dtype": out.dtype}
                meta_kwargs = {**meta_kwargs, "dtype": out.dtype}
        elif _uses_default_dtype(flat, out):
            global_default, override = _global_default_dtype(), dtype_override()
            default_dtype = override if override is not None else global_default
            explicit = _explicit_default_dtype(func, info, args, kwargs, default_dtype, out)
            if explicit is not None:
                args, kwargs = explicit
                bound = bind_arguments(func, args, kwargs)
                return _record(func, info, bound, iter_args(args, kwargs), args, kwargs)
            if default_dtype != global_default:
                with default_dtype_as(default_dtype):
                    out = _meta_outputs(func, bound, meta_args, meta_kwargs)

    # Arguments as recorded: tensors become records, devices become the real one.
    grad = False
    reads: dict[int, StorageRecord] = {}

    def record_arg(x: Any) -> Any:
        nonlocal grad
        if type(x) is DeferredTensor:
            grad = grad or x._rg
            reads[id(x._rec.storage)] = x._rec.storage
            return x._rec
        if isinstance(x, torch.Tensor):
            grad = grad or x.requires_grad
            return external(x, where)
        if isinstance(x, torch.device) and x.type == "meta":
            return device
        return x

    rec_args, rec_kwargs = map_args(record_arg, args, kwargs)
    grad = grad and torch.is_grad_enabled()
    # Per output: does eager autograd make it require grad? (``ones_like(param)`` does not.)
    out_grads = _output_requires_grad(called_func, *called_with, out) if grad else None
    if "device" in rec_kwargs:
        rec_kwargs["device"] = device
    overwrites = _full_overwrite(func, bound)
    if overwrites is not None:
        reads.pop(id(overwrites), None)

    outs = out if isinstance(out, (tuple, list)) else (out,)
    results: list[Any] = []
    new_records: list[TensorRecord | None] = []
    created: list[StorageRecord] = []
    for i, o in enumerate(outs):
        alias = info.return_alias[i] if i < len(info.return_alias) else None
        if alias is None and len(info.return_alias) == 1 and isinstance(out, list):
            alias = info.return_alias[0]
        writes = (
            info.return_writes[min(i, len(info.return_writes) - 1)] if info.return_writes else False
        )
        out_grad = grad and (out_grads is None or (i < len(out_grads) and out_grads[i]))
        if not isinstance(o, torch.Tensor):
            results.append(o)
            new_records.append(None)
            continue
        if alias is not None:
            src = bound[alias]
            if isinstance(src, (list, tuple)):
                src = src[i]
            if writes:
                results.append(src)
                new_records.append(None)
                continue
            if isinstance(src, DeferredTensor):
                rec = TensorRecord(src._rec.storage, o)
                rg = out_grad and _is_float(o.dtype) and func is not aten.detach.default
                results.append(DeferredTensor(o, rec, src.device, rg, rg))
                new_records.append(None)
                continue
        made, rec, storage = _new_output(o, device, out_grad and _is_float(o.dtype))
        results.append(made)
        new_records.append(rec)
        created.append(storage)
    mutates: list[StorageRecord] = []
    for i in info.written(bound):
        targets = bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]]
        for t in targets:
            if isinstance(t, DeferredTensor):
                if t._rec.storage not in mutates:
                    mutates.append(t._rec.storage)
                if i not in info.mutated:
                    continue  # written behind autograd's back: eager's stats never need grad
                if grad and not t._rg and (out_grads is None or any(out_grads)):
                    t._rg = t._derived = True
                    base = getattr(t, "_view_of", None)
                    if base is not None and not base._rg:
                        base._rg = base._derived = True

    if created or mutates:
        rng = None
        if info.is_random:
            gen = bound[info.arg_index("generator")] if info.has_generator else None
            nbytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
            # An op writing a tensor draws where that tensor lives (`t.uniform_()`).
            on = mutates[0].device if mutates else device
            rng, computed = _place_random(func, meta_args, meta_kwargs, info.has_generator,
                                          gen, nbytes, on, (args, kwargs, info))  # fmt: skip
            computed_outs = computed if isinstance(computed, (tuple, list)) else [computed]
            if (
                computed is not None
                and values is None
                and not mutates
                and all(_same_layout(v, o) for v, o in zip(computed_outs, outs, strict=False))
            ):
                values = list(computed_outs)  # computed anyway: later reads start from here
            if "generator" in rec_kwargs:
                rec_kwargs["generator"] = None
            elif info.has_generator:
                gi = info.arg_index("generator")
                if gi < len(rec_args):
                    rec_args = tuple(None if j == gi else a for j, a in enumerate(rec_args))
        op = OpRecord(
            next_seq(), func, tuple(rec_args), rec_kwargs, tuple(reads.values()),
            tuple(new_records), rng, where, default_dtype, tuple(mutates),
            () if overwrites is None else (overwrites,),
        )  # fmt: skip
        for s in (*created, *mutates):
            s.writes.append(op)
        if (
            info.dtype_index is not None
            and not info.takes_tensors
            and not info.is_random
            and not mutates
            and values is None
            and default_dtype is None
            and len(new_records) == 1
            and not isinstance(out, (tuple, list))
            and out.storage_offset() == 0
            and tls.pending_device is not None
            and device == tls.pending_device
            and func not in _PROBED
            and func not in _COLUMN_MAJOR_OUTPUTS
        ):
            _keep_recipe(func, *called_with, out, op)
        if values is not None:
            # Computed anyway: later reads of these outputs start from here.
            for rec, v in zip(new_records, values, strict=False):
                if rec is not None and isinstance(v, torch.Tensor):
                    value_cache.put(rec.storage, 1, v)

    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]


# Which outputs eager autograd makes require grad, per (op, inputs that require grad, dtypes):
# learned once by running the op on meta tensors with autograd on. Ops with no derivative
# (``ones_like``, ``empty_like``, ``rand_like``, ``new_zeros``, ``full_like``, ...) give fresh
# tensors that do not require grad, whatever their inputs.
_grad_rules: dict[Any, tuple[bool, ...] | None] = {}
_AUTOGRAD_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | (
    torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
)


def _output_requires_grad(
    func: Any, args: tuple, kwargs: dict, out: Any
) -> tuple[bool, ...] | None:
    """Eager's ``requires_grad`` of each of ``func``'s outputs, or None if it cannot be learned
    (then every floating output of an op with an input that requires grad does)."""
    flags: list[Any] = []
    for x in iter_args(args, kwargs):
        if isinstance(x, torch.Tensor):
            flags.append((_requires_grad(x), x.dtype))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    key = (func, tuple(flags),
           tuple(o.dtype if isinstance(o, torch.Tensor) else None for o in outs))  # fmt: skip
    if key in _grad_rules:
        return _grad_rules[key]

    def probe_arg(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            m = _meta_of(x).detach()
            return m.requires_grad_() if _requires_grad(x) and _is_float(m.dtype) else m
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


def _same_layout(value: Any, meta: Any) -> bool:
    """Whether a real output can stand for the storage of its recorded (meta) output."""
    if not isinstance(value, torch.Tensor) or not isinstance(meta, torch.Tensor):
        return not isinstance(value, torch.Tensor) and not isinstance(meta, torch.Tensor)
    return (
        value.shape == meta.shape
        and value.stride() == meta.stride()
        and value.storage_offset() == meta.storage_offset() == 0
        and value.dtype == meta.dtype
        and value.untyped_storage().nbytes() == _storage_nbytes(meta)
    )


class _NotStridedResult(Exception):
    """Carries the real result of an op whose output cannot be deferred (see below)."""

    def __init__(self, result: Any) -> None:
        self.result = result


def _not_strided(out: Any) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(
        isinstance(o, torch.Tensor) and (o.layout != torch.strided or o.is_nested) for o in outs
    )


def device_of(args: tuple, kwargs: dict) -> torch.device:
    return _output_device(kwargs, iter_args(args, kwargs))


def _computed_not_strided(
    func: Any, args: tuple, kwargs: dict, device: torch.device, where: Where, real: Any = None
) -> Any:
    """Sparse and nested results (``torch.sparse_coo_tensor``, ``.to_sparse()``,
    ``torch.nested.nested_tensor``) have no deferred form: they are computed now, from the exact
    values of their deferred inputs, and returned as real CPU tensors (not deferred: materialize
    has nothing to do for them). On another device, a clear error."""
    layout = "nested" if kwargs.get("layout") is torch.jagged else "sparse or nested"
    if device.type != "cpu":
        raise UnsupportedOperatorError(
            f"{func} makes a {layout} tensor, which cannot be deferred, and it would be on "
            f"{device} (called at {where}); build it outside meta_init, or on the CPU "
            "(device='cpu') and move it after materializing"
        )
    if real is not None:
        return real
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = _values_of(deferred, func)
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}

    def real_of(x: Any) -> Any:
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return by_id.get(id(x), x)

    a, k = map_args(real_of, args, kwargs)
    with plain():
        return func(*a, **k)


_VALUES_FOR_ERRORS = 64 << 20  # bytes of deferred inputs worth computing to check an error


def _deferred_input_bytes(flat: list) -> int:
    storages = {id(x._rec.storage): x._rec.storage for x in flat if isinstance(x, DeferredTensor)}
    return sum(s.nbytes for s in storages.values())


def _outputs_from_values(
    func: Any, info: OpInfo, args: tuple, kwargs: dict, where: Where
) -> tuple[Any, list[Any]]:
    """Outputs' metadata for an op with no meta kernel (or a data-dependent output shape):
    run it on the deferred inputs' exact values, on the CPU. Returns (meta outputs, values)."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    try:
        inputs = _values_of(deferred, func)
    except UnsupportedOperatorError as e:
        raise UnsupportedOperatorError(
            f"{func} cannot run on deferred tensors (it has no meta kernel, and its inputs' "
            f"values cannot be computed); called at {where}. Build this part outside meta_init, "
            "or guard it with `if is_meta_init():`."
        ) from e
    by_id = {id(d): v for d, v in zip(deferred, inputs, strict=True)}

    def real_of(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            return by_id[id(x)]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    a, k = map_args(real_of, args, kwargs)
    if info.is_random:
        if not info.has_generator:
            raise UnsupportedOperatorError(
                f"{func} is random and has no meta kernel; it cannot be deferred (called at "
                f"{where})"
            )
        k = {**k, "generator": torch.Generator()}  # for the output's shape only: values unused
    with plain():
        real = func(*a, **k)
    reals = real if isinstance(real, (tuple, list)) else (real,)
    if _not_strided(real):
        device = device_of(args, kwargs)
        raise _NotStridedResult(_computed_not_strided(func, args, kwargs, device, where, real))
    metas = []
    for i, r in enumerate(reals):
        alias = info.return_alias[i] if i < len(info.return_alias) else None
        if isinstance(r, torch.Tensor) and alias is not None:
            src = _bound_value(info, args, kwargs, alias)
            if isinstance(src, DeferredTensor) and tuple(r.shape) != tuple(src.shape):
                raise UnsupportedOperatorError(
                    f"{func} changes the shape of a deferred tensor in place ({tuple(src.shape)} "
                    f"-> {tuple(r.shape)}), called at {where}; use the out-of-place form"
                )
            metas.append(src._meta if isinstance(src, DeferredTensor) else _meta_like(r))
        elif isinstance(r, torch.Tensor):
            metas.append(_meta_like(r))
        else:
            metas.append(r)
    out = type(real)(metas) if isinstance(real, (tuple, list)) else metas[0]
    return out, [None] * len(reals) if info.is_random else list(reals)


def _bound_value(info: OpInfo, args: tuple, kwargs: dict, index: int) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(info.arg_names[index])


def _spec_arg(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (torch.Generator, torch.device)):
        return None
    if isinstance(x, (list, tuple)):
        return type(x)(_spec_arg(v) for v in x)
    return x


def _spec_args(args: tuple) -> tuple:
    return tuple(_spec_arg(a) for a in args)


def _spec_kwargs(kwargs: dict) -> dict:
    return {k: _spec_arg(v) for k, v in kwargs.items() if k not in ("generator", "device")}


# Composite functions whose C++ implementation takes another branch for tensor subclasses
# (``_may_require_fw_or_bw_grad``: singular values computed with the singular vectors), which
# changes the last bits of the result. They are recorded as one call and replayed as one call
# on real tensors, so replay takes the branch eager code takes.
SUBCLASS_SENSITIVE = {
    torch.linalg.svdvals, torch.linalg.eigvalsh, torch.linalg.eigvals, torch.linalg.matrix_norm,
    torch.linalg.norm, torch.linalg.cond, torch.linalg.matrix_rank, torch.linalg.pinv, torch.norm,
    torch.Tensor.norm, torch.nuclear_norm, torch.svd, torch.Tensor.svd,
}  # fmt: skip


def record_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record a whole torch-level call as one op (see ``SUBCLASS_SENSITIVE``)."""
    where = call_site()
    flat = iter_args(args, kwargs)
    device = _output_device(kwargs, flat)
    with plain():
        out = func(*map_args(_to_meta_or_same, args, kwargs)[0],
                   **map_args(_to_meta_or_same, args, kwargs)[1])  # fmt: skip
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    grad = torch.is_grad_enabled() and any(
        _requires_grad(x) for x in flat if isinstance(x, torch.Tensor)
    )
    records: list[TensorRecord | None] = []
    results: list[Any] = []
    for o in outs:
        if not isinstance(o, torch.Tensor):
            records.append(None)
            results.append(o)
            continue
        rec = TensorRecord(StorageRecord(_storage_nbytes(o), o.dtype, device), o)
        rg = grad and _is_float(o.dtype)
        records.append(rec)
        results.append(DeferredTensor(o, rec, device, rg, rg))

    def record_arg(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            return x._rec
        if isinstance(x, torch.Tensor):
            return external(x, where)
        return x

    rec_args, rec_kwargs = map_args(record_arg, args, kwargs)
    reads = tuple(
        {id(x._rec.storage): x._rec.storage for x in flat if isinstance(x, DeferredTensor)}.values()
    )
    op = OpRecord(next_seq(), func, tuple(rec_args), rec_kwargs, reads, tuple(records), None, where)
    for rec in records:
        if rec is not None:
            rec.storage.writes.append(op)
    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]


def _to_meta_or_same(x: Any) -> Any:
    return _to_meta(x) if isinstance(x, torch.Tensor) else x


def set_data(self: DeferredTensor, new: torch.Tensor) -> None:
    """``t.data = x`` on a deferred tensor: ``t`` now stands for ``x``'s values (same object)."""
    if isinstance(new, DeferredTensor):
        replacement = DeferredTensor(new._meta, new._rec, new.device, self._rg)
        if new.__dict__.get(SHARE_MEMORY_ATTR):  # ``p.data = p`` (``Module._apply``) keeps it
            replacement.__dict__[SHARE_MEMORY_ATTR] = True
    else:
        replacement = new.detach()
        if getattr(self, "_is_param", False):
            replacement = as_parameter(self, replacement, self._rg)
        else:
            replacement.requires_grad_(self._rg)
    ours = (
        INTERNAL_ATTRS
        if isinstance(replacement, DeferredTensor)
        else INTERNAL_ATTRS | PARAMETER_ATTRS
    )
    for k, v in self.__dict__.items():
        if k not in ours:
            setattr(replacement, k, v)
    swap_in_place(self, replacement)


DeferredTensor.handle_op = staticmethod(handle_op)
DeferredTensor.set_data = staticmethod(set_data)
