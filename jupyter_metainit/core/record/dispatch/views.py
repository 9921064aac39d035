"""Views and in-place view ops of deferred tensors: where aliasing between tensors is decided.

A view (``view``, ``t``, slicing) is not recorded: :func:`record_view` gives a new
``TensorRecord`` (geometry, dtype) over the input's ``StorageRecord``, so everything done
through any view lands on the one storage. In-place view ops (``t_``, ``squeeze_``,
``as_strided_``, ``set_``) give the same Python object new metadata (:func:`inplace_view`), and
``t.data = x`` makes it stand for ``x`` (:func:`set_data`). (Outputs of recorded ops that alias
an input are decided by ``record_op._wrap_outputs`` from the op's schema.)
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.errors import UnsupportedOperatorError
from jupyter_metainit.core.record.dispatch.file_memory import storage_region
from jupyter_metainit.core.record.dispatch.inputs import (
    META,
    call_site,
    is_float,
    storage_nbytes,
    to_meta,
    wrap_file_region,
)
from jupyter_metainit.core.record.graph import OpRecord, StorageRecord, TensorRecord, next_seq
from jupyter_metainit.core.record.ops import OpInfo
from jupyter_metainit.core.record.state import tls
from jupyter_metainit.core.record.tensor import (
    INTERNAL_ATTRS,
    PARAMETER_ATTRS,
    SHARE_MEMORY_ATTR,
    DeferredTensor,
    as_parameter,
)
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.swap import swap_in_place

aten = torch.ops.aten


def _deferred_view(
    self: DeferredTensor, out: torch.Tensor, device: torch.device, rg: bool
) -> DeferredTensor:
    """``out`` (a view of ``self``'s meta tensor) as a deferred view of ``self``: the same
    storage, reporting ``device``. As eager's views: it requires grad where ``self`` does
    (``rg``: not for a detach) and its dtype can, made under no_grad too (a leaf then: no
    grad_fn); it keeps the tensor it is a view of, as eager's ``_base``: an in-place op through
    the view that makes it require grad makes the base require grad too
    (``pad(mode="circular")``)."""
    r = rg and is_float(out.dtype)
    made = DeferredTensor(
        out, TensorRecord(self._rec.storage, out), device, r, r and torch.is_grad_enabled()
    )
    base = getattr(self, "_view_of", None)
    made._view_of = self if base is None else base
    return made


def record_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """A view of a deferred tensor: new geometry over the same storage, nothing recorded.

    The most frequent op in model code (``view``, ``t``, slicing), so it skips everything else.
    """
    self: DeferredTensor = args[0]
    meta_args = [self._meta]
    for a in args[1:]:
        meta_args.append(to_meta(a) if isinstance(a, torch.Tensor) else a)
    with plain():
        out = func(*meta_args, **kwargs)
    rg = self._rg and func is not aten.detach.default
    device = self.device
    if isinstance(out, torch.Tensor):
        return _deferred_view(self, out, device, rg)
    results = [_deferred_view(self, o, device, rg) for o in out]
    return type(out)(results)


# Tensor methods, implemented in C++, that give a view of their input (``reshape`` and
# ``flatten`` when they can; a copy otherwise): what loading a checkpoint does to each tensor
# (``view(dtype)``, ``reshape``, ``t[...]``, ``nn.Parameter``'s ``detach``).
VIEW_METHODS = frozenset({
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.__getitem__, torch.Tensor.detach,
    torch.Tensor.t, torch.Tensor.transpose, torch.Tensor.permute, torch.Tensor.unsqueeze,
    torch.Tensor.squeeze, torch.Tensor.flatten, torch.Tensor.expand, torch.Tensor.narrow,
    torch.Tensor.select,
})  # fmt: skip
_MAY_COPY = frozenset({torch.Tensor.reshape, torch.Tensor.flatten})  # when not viewable
_SIMPLE = (int, torch.dtype, type(None), type(Ellipsis))
_len_function_modes = torch._C._len_torch_function_stack
_len_dispatch_modes = torch._C._len_torch_dispatch_stack
_getitem, _detach = torch.Tensor.__getitem__, torch.Tensor.detach
_NoDispatch = torch._C._DisableTorchDispatch
_NoSubclassFunctions = torch._C.DisableTorchFunctionSubclass
_cpp_device = torch._C.TensorBase.device.__get__
NOT_A_VIEW = object()  # what view_method and on_meta_tensor answer for a call they leave alone


def _recorder_alone() -> bool:
    """No mode is active but the recorder's dispatch mode (the caller's torch-function mode is
    off while it runs): no other mode needs to see the call go through the general path."""
    return _len_function_modes() == 0 and _len_dispatch_modes() == 1


def _simple(x: Any, lists: bool = True) -> bool:
    """A size, dim, dtype or basic index (no tensor, no bool; no list where ``lists`` is
    false: in an index, a list is advanced indexing)."""
    if type(x) in _SIMPLE:
        return True
    if type(x) is tuple or type(x) is torch.Size or (lists and type(x) is list):
        return all(type(v) is int or _simple(v, lists) for v in x)
    if type(x) is slice:
        return _simple((x.start, x.stop, x.step))
    return False


def _simple_arguments(func: Any, args: tuple, kwargs: dict) -> bool:
    """Every argument after the tensor is :func:`_simple`."""
    lists = func is not _getitem
    for a in args[1:]:
        if type(a) is not int and not _simple(a, lists):
            return False
    return not kwargs or all(_simple(v) for v in kwargs.values())


def view_method(func: Any, args: tuple, kwargs: dict) -> Any:
    """A :data:`VIEW_METHODS` call on a deferred tensor, answered at the torch-function level
    inside ``meta_init``: the method runs on the meta tensor, and its result, if it is a view of
    it, becomes a deferred view as :func:`record_view` makes it, without the trip through ATen
    dispatch (several per op, a third of recording a checkpoint). ``NOT_A_VIEW`` when it is not
    such a view (a copy, a tensor or list argument) or another mode is active (it must see the
    call as usual): the caller then takes the general path, which gives the same result."""
    self = args[0] if args else None
    if (
        type(self) is not DeferredTensor
        or not _recorder_alone()
        or not _simple_arguments(func, args, kwargs)
    ):
        return NOT_A_VIEW
    meta = self._meta
    # (the caller's torch-function mode is off while it runs, and ``meta`` never requires grad:
    # the dispatch mode is all there is to switch off)
    with _NoDispatch():
        out = func(meta, *args[1:], **kwargs)
    if func in _MAY_COPY and out.untyped_storage()._cdata != meta.untyped_storage()._cdata:
        return NOT_A_VIEW  # a copy: recorded as one by the general path
    with _NoSubclassFunctions():  # the device it reports (``self.device``, in a critical section)
        device = _cpp_device(self)
    return _deferred_view(self, out, device, self._rg and func is not _detach)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_init = torch.nn.init
# ``nn.init`` functions that only run in-place ops on their tensor: what a model built under
# ``torch.device("meta")`` (as ``from_pretrained`` builds it) calls on each of its parameters.
INIT_FUNCTIONS = frozenset({
    _init.kaiming_uniform_, _init.kaiming_normal_, _init.xavier_uniform_, _init.xavier_normal_,
    _init.uniform_, _init.normal_, _init.zeros_, _init.ones_, _init.constant_,
})  # fmt: skip
_SCALARS = (int, float, bool, str, torch.dtype, type(None))


def on_meta_tensor(func: Any, args: tuple, kwargs: dict) -> Any:
    """A :data:`VIEW_METHODS` or :data:`INIT_FUNCTIONS` call on a plain ``meta`` tensor inside
    ``meta_init`` (``state_dict()`` of a model built on ``torch.device("meta")`` detaches each
    tensor, twice per checkpoint tensor in ``from_pretrained``; its constructor initialises
    them), run without the recorder's dispatch mode: triage would run each of its ATen ops as
    it is, on meta tensors, drawing nothing (autograd sees it as eagerly). ``NOT_A_VIEW`` when
    it is not such a call (other arguments than sizes, dims, scalars or basic indices)."""
    # (``nn.init`` functions pass every argument by keyword to torch-function handlers)
    self = args[0] if args else kwargs.get("tensor")
    if (
        type(self) not in _PLAIN_TYPES
        or not self.is_meta
        or tls.pending_device is not None
        or not _recorder_alone()
    ):
        return NOT_A_VIEW
    if func in INIT_FUNCTIONS:
        rest = (*args[1:], *(v for k, v in kwargs.items() if k != "tensor"))
        if not all(type(a) in _SCALARS for a in rest):
            return NOT_A_VIEW
    elif not _simple_arguments(func, args, kwargs):
        return NOT_A_VIEW
    with _NoDispatch():
        return func(*args, **kwargs)


def meta_factory(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """A factory asked for ``meta`` tensors, with no tensor argument (``with
    torch.device("meta")``, as ``from_pretrained`` builds a model): triage would run each of its
    ATen ops as it is, so it runs without the recorder's dispatch mode when no other mode is
    there to see it."""
    if tls.pending_device is None and _recorder_alone():
        with _NoDispatch():
            return func(*args, **kwargs)
    return func(*args, **kwargs)


def _set_geometry(
    t: DeferredTensor, meta: torch.Tensor, storage: StorageRecord | None = None
) -> None:
    """Give ``t`` (the same Python object) new metadata over ``storage`` (default: its own)."""
    rec = TensorRecord(storage if storage is not None else t._rec.storage, meta)
    new = DeferredTensor(meta, rec, t.device, t._rg, t._derived)
    torch._C._swap_tensor_impl(t, new)
    t._meta, t._rec = meta, rec


def inplace_view(func: Any, info: OpInfo, bound: list, args: tuple, kwargs: dict) -> Any:
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
        meta_args = (meta, *(to_meta(a) if isinstance(a, torch.Tensor) else a for a in args[1:]))
        meta_kwargs = {
            k: to_meta(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
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
    elif storage_nbytes(meta) > self._rec.storage.nbytes:
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
