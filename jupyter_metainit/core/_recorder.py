"""Recording: the dispatch handler every op on a deferred tensor goes through, and ``meta_init``.

Two interception points, as in ``torch._subclasses.fake_tensor``:

* ``DeferredTensor.__torch_dispatch__`` sees every ATen op that has a deferred input, inside or
  outside ``meta_init`` (so ``model.half()`` or ``model.apply(init)`` later are recorded too);
* inside ``meta_init``, a dispatch mode also sees factory ops (``torch.ones``) and ops on real
  tensors, and a torch-function mode rewrites ``device=`` arguments to ``meta`` before PyTorch's
  argument parser sees them (so ``device="cuda:1"`` works on a machine without CUDA), remembering
  the device each new tensor must report.

An op is run on the meta tensors underneath to learn its outputs' metadata, then stored as an
``OpRecord`` on the storages it creates or writes. Pure views are not recorded at all: a view is a
new geometry over the same storage record, rebuilt at replay time with ``as_strided``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from jupyter_metainit.core._graph import (
    Constant,
    External,
    OpRecord,
    RngUse,
    StorageRecord,
    TensorRecord,
    constant_op,
    next_seq,
)
from jupyter_metainit.core._ops import bind_arguments, op_info, user_frame
from jupyter_metainit.core._plain import iter_args, map_args, plain
from jupyter_metainit.core._rng import make_spec, record_random
from jupyter_metainit.core._tensor import INTERNAL_ATTRS, DeferredTensor
from jupyter_metainit.core.errors import UnsupportedOperatorError

__all__ = ["handle_function", "handle_op", "is_meta_init", "meta_init", "read_value", "set_data"]

aten = torch.ops.aten
_META = torch.device("meta")


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.devices: list[torch.device] = []
        self.pending_device: torch.device | None = None
        self.modes: tuple[Any, Any] | None = None


_tls = _State()

# Python functions that create tensors from data the user hands over: kept as constants.
_DATA_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.Tensor.new_tensor,
}  # fmt: skip
# torch functions whose default device is the current default device.
_FACTORIES = {
    torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.arange, torch.range, torch.linspace,
    torch.logspace, torch.eye, torch.scalar_tensor, torch.tril_indices, torch.triu_indices,
    torch.normal, torch.empty_permuted, torch.zeros_like, torch.ones_like, torch.empty_like,
    torch.full_like, torch.rand_like, torch.randn_like, torch.randint_like,
}  # fmt: skip
_LIKE = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like,
}  # fmt: skip
_OVERWRITES_SELF = {
    aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.cauchy_.default, aten.fill_.Scalar,
    aten.zero_.default,
}  # fmt: skip
_TO_METHODS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type}


def is_meta_init() -> bool:
    """True inside a :func:`meta_init` block on this thread.

    Module authors can use it to take another path while their module is being deferred, e.g. to
    skip loading data from disk in ``__init__``.
    """
    return _tls.depth > 0


def _default_device() -> torch.device:
    if _tls.devices and _tls.devices[-1] is not None:
        return _tls.devices[-1]
    return torch.get_default_device()


def _canonical(device: Any) -> torch.device:
    d = torch.device(device)
    if d.type in ("cuda", "xpu") and d.index is None:
        # Mirrors eager: an index-less CUDA device means the current device (0 without CUDA).
        current = 0
        if d.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
            current = torch.cuda.current_device()
        d = torch.device(d.type, current)
    return d


# ---------------------------------------------------------------------------------------------
# torch-function level: devices and data factories


@contextlib.contextmanager
def _pending(device: torch.device) -> Iterator[None]:
    saved = _tls.pending_device
    _tls.pending_device = device
    try:
        yield
    finally:
        _tls.pending_device = saved


def _rewrite_device(func: Any, args: tuple, kwargs: dict, in_context: bool) -> Any:
    """Call ``func`` with ``device=meta``, remembering the device the result must report."""
    device = kwargs.get("device")
    if device is None and not (in_context and func in _FACTORIES and func not in _LIKE):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    target = _canonical(device) if device is not None else _default_device()
    if target.type == "meta":
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    kwargs = dict(kwargs)
    kwargs["device"] = _META
    with _pending(target), torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _data_factory(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    if func is torch.Tensor.new_tensor:
        self, data = args[0], args[1]
        kwargs.setdefault("dtype", self.dtype)
        kwargs.setdefault("device", self.device)
        func, args = torch.tensor, (data,)
    device = kwargs.pop("device", None)
    target = _canonical(device) if device is not None else _default_device()
    with plain():
        real = func(*args, **kwargs)
        if real.device.type != "cpu":
            real = real.cpu()
        if func is not torch.tensor:
            # as_tensor/from_numpy share the caller's memory: keep the values as they are now.
            real = real.clone()
    return _wrap_constant(real, target)


def _retarget(func: Any, self: DeferredTensor, args: tuple, kwargs: dict) -> Any:
    """``t.to(...)``, ``t.cuda()``, ``t.cpu()``: a recorded copy that reports the new device."""
    if func is torch.Tensor.cpu:
        device, dtype, copy = torch.device("cpu"), None, False
    elif func is torch.Tensor.cuda:
        device = args[0] if args else kwargs.get("device")
        device, dtype, copy = _canonical(device if device is not None else "cuda"), None, False
    elif func is torch.Tensor.type:
        with torch._C.DisableTorchFunctionSubclass():
            return func(self, *args, **kwargs)
    else:
        copy = bool(kwargs.pop("copy", False))
        device, dtype, _nb, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is not None and memory_format != torch.preserve_format:
            with torch._C.DisableTorchFunctionSubclass():
                return aten._to_copy.default(
                    self, dtype=dtype or self.dtype, memory_format=memory_format
                )
        if device is not None:
            device = _canonical(device)
    device = device or self.device
    dtype = dtype or self.dtype
    if device == self.device and dtype == self.dtype and not copy:
        return self
    with _pending(device), torch._C.DisableTorchFunctionSubclass():
        out = aten._to_copy.default(self, dtype=dtype, device=_META)
    return out


def handle_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """``DeferredTensor.__torch_function__``: device-changing calls, everything else unchanged."""
    if func in _TO_METHODS and args and isinstance(args[0], DeferredTensor):
        return _retarget(func, args[0], args[1:], dict(kwargs))
    if func is torch.Tensor.numpy or func is torch.Tensor.tolist:
        value = read_value(args[0])
        return func(value, *args[1:], **kwargs)
    if func is torch.Tensor.new_tensor:
        return _data_factory(func, args, dict(kwargs))
    if "device" in kwargs:
        return _rewrite_device(func, args, kwargs, in_context=False)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


class _FunctionMode(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DATA_FACTORIES:
            return _data_factory(func, args, dict(kwargs))
        if func in _TO_METHODS and args and isinstance(args[0], DeferredTensor):
            return func(*args, **kwargs)  # handled by DeferredTensor.__torch_function__
        if "device" in kwargs or func in _FACTORIES:
            return _rewrite_device(func, args, kwargs, in_context=True)
        return func(*args, **kwargs)


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        return handle_op(func, args, kwargs or {}, self)


# ---------------------------------------------------------------------------------------------
# dispatch level: record one op


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DeferredTensor):
        return t._meta
    with plain():
        n = t.untyped_storage().nbytes() // t.element_size() if t.element_size() else 0
        base = torch.empty(max(n, 1), dtype=t.dtype, device=_META)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _wrap_constant(real: torch.Tensor, device: torch.device) -> DeferredTensor:
    with plain():
        meta = _to_meta(real)
    storage = StorageRecord(_storage_nbytes(meta), meta.dtype, device)
    rec = TensorRecord(storage, meta)
    op = OpRecord(next_seq(), constant_op, (Constant(real),), {}, (), (rec,), None, user_frame())
    storage.writes.append(op)
    return DeferredTensor(meta, rec, device)


def _storage_nbytes(meta: torch.Tensor) -> int:
    try:
        return meta.untyped_storage().nbytes()
    except Exception:
        return meta.numel() * meta.element_size()


def _output_device(kwargs: dict, flat: list, mode: Any) -> torch.device:
    if _tls.pending_device is not None:
        return _tls.pending_device
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != "meta":
        return _canonical(dev)
    for x in flat:
        if isinstance(x, DeferredTensor):
            return x.device
    for x in flat:
        if isinstance(x, torch.Tensor):
            return x.device
    return _default_device()


def handle_op(func: Any, args: tuple, kwargs: dict, mode: Any) -> Any:
    flat = iter_args(args, kwargs)
    deferred = [x for x in flat if isinstance(x, DeferredTensor)]
    info = op_info(func) if isinstance(func, torch._ops.OpOverload) else None
    if info is None:
        raise UnsupportedOperatorError(f"{func} is not an ATen operator; it cannot be deferred")
    bound = bind_arguments(func, args, kwargs)
    mutated_real = any(
        isinstance(t, torch.Tensor) and not isinstance(t, DeferredTensor)
        for i in info.mutated
        for t in (bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]])
    )
    if not deferred:
        # Only reached through the dispatch mode, inside meta_init.
        if func is aten.lift_fresh.default:
            return _wrap_constant(args[0], _output_device(kwargs, flat, mode))
        if mutated_real or func.is_view or not info.returns_tensors:
            with plain():
                return func(*args, **kwargs)
    elif mutated_real or not info.returns_tensors:
        return _run_on_values(func, args, kwargs)
    return _record(func, info, bound, flat, args, kwargs, mode)


def _run_on_values(func: Any, args: tuple, kwargs: dict) -> Any:
    """Ops that need data (``.item()``, ``bool(t)``, writing into a real tensor): compute the
    deferred inputs' exact values by replay, on the CPU, leaving them deferred."""
    from jupyter_metainit.core._replay import compute_values

    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = compute_values([d._rec for d in deferred])
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}
    a, k = map_args(lambda x: by_id.get(id(x), x), args, kwargs)
    with plain():
        return func(*a, **k)


def read_value(t: DeferredTensor) -> torch.Tensor:
    """The exact current values of a deferred tensor, as a new real CPU tensor."""
    from jupyter_metainit.core._replay import compute_values

    return compute_values([t._rec])[0]


def _record(
    func: Any, info: Any, bound: list, flat: list, args: tuple, kwargs: dict, mode: Any
) -> Any:
    device = _output_device(kwargs, flat, mode)
    where = user_frame()

    def meta_of(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _to_meta(x)
        if isinstance(x, torch.device):
            return _META
        return x

    meta_args, meta_kwargs = map_args(meta_of, args, kwargs)
    if "device" in meta_kwargs and meta_kwargs["device"] is not None:
        meta_kwargs["device"] = _META
    try:
        if func in _OVERWRITES_SELF and isinstance(bound[0], DeferredTensor):
            # The output is `self`, unchanged in shape; the meta kernels of random fills are
            # slow Python decompositions, and they are the bulk of model initialisation.
            out = meta_args[0]
        else:
            with plain():
                out = func(*meta_args, **meta_kwargs)
    except NotImplementedError as e:
        raise UnsupportedOperatorError(
            f"{func} cannot run on deferred tensors (it has no meta kernel); called at {where}. "
            "Build this part outside meta_init, or guard it with `if is_meta_init():`."
        ) from e
    except (torch._subclasses.fake_tensor.DynamicOutputShapeException,
            torch._subclasses.fake_tensor.DataDependentOutputException):  # fmt: skip
        return _run_on_values(func, args, kwargs)
    except RuntimeError as e:
        msg = str(e)
        if "meta" in msg.lower() and ("not implemented" in msg or "NotImplemented" in msg):
            raise UnsupportedOperatorError(
                f"{func} cannot run on deferred tensors: {msg.splitlines()[0]}; called at {where}"
            ) from e
        raise

    # Arguments as recorded: tensors become records, devices become the real one.
    def record_arg(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            return x._rec
        if isinstance(x, torch.Tensor):
            return External(x, x._version, where)
        if isinstance(x, torch.device) and x.type == "meta":
            return device
        return x

    rec_args, rec_kwargs = map_args(record_arg, args, kwargs)
    if "device" in rec_kwargs:
        rec_kwargs["device"] = device
    reads = tuple(
        {id(x._rec.storage): x._rec.storage for x in flat if isinstance(x, DeferredTensor)}.values()
    )

    outs = out if isinstance(out, (tuple, list)) else (out,)
    results: list[Any] = []
    new_records: list[TensorRecord | None] = []
    written: list[StorageRecord] = []
    for i, o in enumerate(outs):
        alias = info.return_alias[i] if i < len(info.return_alias) else None
        if alias is None and len(info.return_alias) == 1 and isinstance(out, list):
            alias = info.return_alias[0]
        writes = (
            info.return_writes[min(i, len(info.return_writes) - 1)] if info.return_writes else False
        )
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
                results.append(DeferredTensor(o, rec, src.device))
                new_records.append(None)
                continue
        storage = StorageRecord(_storage_nbytes(o), o.dtype, device)
        rec = TensorRecord(storage, o)
        results.append(DeferredTensor(o, rec, device))
        new_records.append(rec)
        written.append(storage)
    for i in info.mutated:
        targets = bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]]
        for t in targets:
            if isinstance(t, DeferredTensor):
                written.append(t._rec.storage)

    if written:
        rng = None
        if info.is_random:
            gen = bound[info.arg_names.index("generator")] if info.has_generator else None
            nbytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
            segment, index = record_random(
                gen, make_spec(func, tuple(meta_args), meta_kwargs, info.has_generator, nbytes)
            )
            rng = RngUse(segment, index)
            if "generator" in rec_kwargs:
                rec_kwargs["generator"] = None
            elif info.has_generator:
                gi = info.arg_names.index("generator")
                if gi < len(rec_args):
                    rec_args = tuple(None if j == gi else a for j, a in enumerate(rec_args))
        op = OpRecord(
            next_seq(), func, tuple(rec_args), rec_kwargs, reads, tuple(new_records), rng, where
        )
        seen: set[int] = set()
        for s in written:
            if id(s) not in seen:
                seen.add(id(s))
                s.writes.append(op)

    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]


# ---------------------------------------------------------------------------------------------
# .data assignment


def set_data(self: DeferredTensor, new: torch.Tensor) -> None:
    """``t.data = x`` on a deferred tensor: ``t`` now stands for ``x``'s values (same object)."""
    if isinstance(new, DeferredTensor):
        replacement = DeferredTensor(new._meta, new._rec, new.device, self._rg)
    else:
        replacement = new.detach()
        if getattr(self, "_is_param", False):
            replacement = torch.nn.Parameter(replacement, requires_grad=self._rg)
        else:
            replacement.requires_grad_(self._rg)
    for k, v in self.__dict__.items():
        if k not in INTERNAL_ATTRS:
            setattr(replacement, k, v)
    from jupyter_metainit.core._swap import swap_in_place

    swap_in_place(self, replacement)


# ---------------------------------------------------------------------------------------------
# lazy modules


_lazy_patch_count = 0
_lazy_lock = threading.Lock()
_orig_uninit_materialize: Any = None


def _deferred_uninitialized_materialize(
    self: Any, shape: Any, device: Any = None, dtype: Any = None
) -> None:
    if not is_meta_init():
        return _orig_uninit_materialize(self, shape, device, dtype)
    if device is None:
        device = getattr(self, "_jmi_device", None) or _default_device()
    if dtype is None:
        dtype = self.data.dtype
    new = torch.empty(shape, device=device, dtype=dtype)
    if self.cls_to_become is torch.nn.Parameter:
        new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
    from jupyter_metainit.core._swap import swap_in_place

    swap_in_place(self, new)


_orig_uninit_new: dict[type, Any] = {}


def _uninitialized_new(cls: type, requires_grad: bool = True, device: Any = None,
                       dtype: Any = None) -> Any:  # fmt: skip
    # An uninitialized tensor holds nothing; it stays a plain (meta) tensor until a dry run
    # gives it a shape, and remembers the device its deferred replacement must report.
    target = _canonical(device) if device is not None else _default_device()
    with plain():
        data = torch.empty(0, device=_META, dtype=dtype)
    obj = torch.Tensor._make_subclass(cls, data, requires_grad)
    obj._jmi_device = target
    return obj


@contextlib.contextmanager
def _lazy_module_support() -> Iterator[None]:
    global _lazy_patch_count, _orig_uninit_materialize
    from torch.nn.parameter import (
        UninitializedBuffer,
        UninitializedParameter,
        UninitializedTensorMixin,
    )

    with _lazy_lock:
        if _lazy_patch_count == 0:
            _orig_uninit_materialize = UninitializedTensorMixin.materialize
            UninitializedTensorMixin.materialize = _deferred_uninitialized_materialize
            for cls in (UninitializedParameter, UninitializedBuffer):
                _orig_uninit_new[cls] = cls.__dict__["__new__"]
                cls.__new__ = _make_uninit_new(cls, _orig_uninit_new[cls])
        _lazy_patch_count += 1
    try:
        yield
    finally:
        with _lazy_lock:
            _lazy_patch_count -= 1
            if _lazy_patch_count == 0:
                UninitializedTensorMixin.materialize = _orig_uninit_materialize
                for cls, orig in _orig_uninit_new.items():
                    cls.__new__ = orig
                _orig_uninit_new.clear()


def _make_uninit_new(cls: type, orig: Any) -> Any:
    def __new__(
        klass: type, requires_grad: bool = True, device: Any = None, dtype: Any = None
    ) -> Any:
        if not is_meta_init():
            fn = orig.__func__ if hasattr(orig, "__func__") else orig
            return fn(klass, requires_grad, device, dtype)
        return _uninitialized_new(klass, requires_grad, device, dtype)

    return staticmethod(__new__)


# ---------------------------------------------------------------------------------------------
# the context manager


@contextlib.contextmanager
def meta_init(device: Any = None, dtype: torch.dtype | None = None) -> Iterator[None]:
    """Defer every tensor created in the block: no memory, every operation recorded.

    Use it to build a model of any size for inspection, sharding or partial use, then
    :func:`materialize` the parts you need with exactly the values eager construction gives.
    Tensors report the shape, dtype, stride, ``requires_grad`` and device they would really have
    (an explicit ``device="cuda:1"`` is honoured even without a GPU).

    Args:
        device: device reported by tensors whose code names none (default: PyTorch's default).
        dtype: default floating dtype inside the block (``torch.set_default_dtype``).

    Re-entrant and thread-local: other threads are unaffected.
    """
    target = _canonical(device) if device is not None else None
    saved_dtype = torch.get_default_dtype()
    _tls.devices.append(target)
    outermost = _tls.depth == 0
    _tls.depth += 1
    stack = contextlib.ExitStack()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        if outermost:
            stack.enter_context(_lazy_module_support())
            stack.enter_context(_FunctionMode())
            stack.enter_context(_DispatchMode())
        with stack:
            yield
    finally:
        _tls.depth -= 1
        _tls.devices.pop()
        if dtype is not None:
            torch.set_default_dtype(saved_dtype)
