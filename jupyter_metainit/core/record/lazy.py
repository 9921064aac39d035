"""Lazy modules (``nn.LazyLinear``) inside ``meta_init``: uninitialized parameters stay shapeless
until a dry run gives them a shape, then become deferred tensors on the device they were meant for,
in the dtype eager code gives them (left to the default: the block's ``meta_init(dtype=)``).

``UninitializedParameter``/``UninitializedBuffer`` are patched while any ``meta_init`` block is
active (counted, so nested and concurrent blocks share one patch); outside a block the patched
methods call PyTorch's own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from jupyter_metainit.core.record.state import default_device, default_dtype, tls
from jupyter_metainit.core.runtime.arguments import indexed_device
from jupyter_metainit.core.runtime.interrupts import critical
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.swap import swap_in_place

__all__ = ["lazy_module_support"]

_META = torch.device("meta")
_patch_count = 0
_patch_lock = threading.Lock()
_orig_materialize: Any = None
_orig_new: dict[type, Any] = {}


def _in_meta_init() -> bool:
    return tls.depth > 0


def _deferred_materialize(self: Any, shape: Any, device: Any = None, dtype: Any = None) -> None:
    """``UninitializedTensorMixin.materialize`` inside ``meta_init``: a deferred empty tensor."""
    if not _in_meta_init():
        return _orig_materialize(self, shape, device, dtype)
    if device is None:
        device = getattr(self, "_jmi_device", None) or default_device()
    if dtype is None:
        dtype = self.data.dtype
    new = torch.empty(shape, device=device, dtype=dtype)
    if self.cls_to_become is torch.nn.Parameter:
        new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
    swap_in_place(self, new)


def _uninitialized_new(
    cls: type, requires_grad: bool = True, device: Any = None, dtype: Any = None
) -> Any:
    # An uninitialized tensor holds nothing; it stays a plain (meta) tensor until a dry run
    # gives it a shape, and remembers the device its deferred replacement must report. Its
    # dtype is the one ``materialize`` gives the parameter: left to the default, that is the
    # block's (``meta_init(dtype=)``), as eager's would be under ``set_default_dtype``;
    # ``plain`` below would read the process-wide default instead.
    target = indexed_device(device) if device is not None else default_device()
    if dtype is None:
        dtype = default_dtype()
    with plain():
        data = torch.empty(0, device=_META, dtype=dtype)
    obj = torch.Tensor._make_subclass(cls, data, requires_grad)
    obj._jmi_device = target
    return obj


def _make_new(orig: Any) -> Any:
    def __new__(
        klass: type, requires_grad: bool = True, device: Any = None, dtype: Any = None
    ) -> Any:
        if not _in_meta_init():
            fn = orig.__func__ if hasattr(orig, "__func__") else orig
            return fn(klass, requires_grad, device, dtype)
        return _uninitialized_new(klass, requires_grad, device, dtype)

    return staticmethod(__new__)


@contextlib.contextmanager
def lazy_module_support() -> Iterator[None]:
    """Patch the uninitialized tensor classes for the duration of the block (counted)."""
    global _patch_count, _orig_materialize
    from torch.nn.parameter import (
        UninitializedBuffer,
        UninitializedParameter,
        UninitializedTensorMixin,
    )

    with critical(), _patch_lock:
        if _patch_count == 0:
            _orig_materialize = UninitializedTensorMixin.materialize
            UninitializedTensorMixin.materialize = _deferred_materialize
            for cls in (UninitializedParameter, UninitializedBuffer):
                _orig_new[cls] = cls.__dict__["__new__"]
                cls.__new__ = _make_new(_orig_new[cls])
        _patch_count += 1
    try:
        yield
    finally:
        with critical(), _patch_lock:
            _patch_count -= 1
            if _patch_count == 0:
                UninitializedTensorMixin.materialize = _orig_materialize
                for cls, orig in _orig_new.items():
                    cls.__new__ = orig
                _orig_new.clear()
