"""Inputs as recording sees them, and how real inputs are kept.

Every argument of a recorded op has a meta tensor standing for it (:func:`to_meta`,
:func:`meta_of`); outputs get the device the call asked for (:func:`output_device`). The rule
owned here: **a real tensor handed to deferred code is kept as it is now** — small ones copied
(``Constant``), large ones referenced with a digest of their memory (``External``, checked at
replay) — and data the user hands over (``torch.tensor(...)``, a memory-mapped file region)
becomes a recording of its own (:func:`wrap_constant`, :func:`wrap_file_region`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from jupyter_metainit.core.errors import UnsupportedOperatorError
from jupyter_metainit.core.record.files import FileRegion, read_file_bytes
from jupyter_metainit.core.record.graph import (
    Constant,
    External,
    OpRecord,
    StorageRecord,
    TensorRecord,
    constant_op,
    next_seq,
)
from jupyter_metainit.core.record.ops import Where, user_frame
from jupyter_metainit.core.record.state import default_device, tls
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.arguments import indexed_device
from jupyter_metainit.core.runtime.digest import digest
from jupyter_metainit.core.runtime.plain import iter_args, plain
from jupyter_metainit.core.runtime.swap import cache_by_id

META = torch.device("meta")


def call_site() -> Where:
    """Where user code made the call being recorded."""
    return tls.where if tls.where is not None else user_frame()


_COPY_EXTERNALS_BELOW = 1 << 20


# Digests of large real inputs, per tensor object and version (one model uses a tensor often).
_external_digests: dict[int, tuple[Any, int, tuple]] = cache_by_id({})  # swaps drop entries


def external(x: torch.Tensor, where: Where) -> External | Constant:
    """How a real tensor input is kept in the recording: small ones are copied now (nothing can
    change them), large ones are referenced with a digest of their memory, checked at replay."""
    if x.is_meta:  # metadata only (`empty_like(meta_tensor, device="cpu")`): nothing to check
        return External(x, x._version, where)
    with plain():
        if x.layout is not torch.strided or x.is_nested:
            # A sparse adjacency made inside meta_init (real): no one storage to digest, so
            # copied, as eager code computes with its values of this moment.
            return Constant(x.clone())
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


def to_meta(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DeferredTensor):
        return t._meta
    if t.layout is not torch.strided or t.is_nested:
        return _not_strided_meta(t)
    with plain():
        n = t.untyped_storage().nbytes() // t.element_size() if t.element_size() else 0
        base = torch.empty(max(n, 1), dtype=t.dtype, device=META)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _not_strided_meta(t: torch.Tensor) -> torch.Tensor:
    """A real sparse tensor's meta twin (its layout, shape and dtype): few meta kernels take
    one, so an op on it mostly runs on values (``record_op``)."""
    try:
        with plain():
            return t.to(META)
    except (RuntimeError, NotImplementedError):
        raise UnsupportedOperatorError(
            f"{t.layout} tensors cannot be used in deferred code (called at {call_site()}); "
            "build them outside meta_init, or use dense tensors"
        ) from None


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh meta tensor with ``t``'s geometry (for outputs computed on real values)."""
    with plain():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=META)


def storage_nbytes(meta: torch.Tensor) -> int:
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
        meta = to_meta(real)
    storage = StorageRecord(storage_nbytes(meta), meta.dtype, device)
    rec = TensorRecord(storage, meta)
    op = OpRecord(next_seq(), constant_op, (Constant(real),), {}, (), (rec,), None, call_site())
    storage.writes.append(op)
    return DeferredTensor(meta, rec, device)


def output_device(kwargs: dict, flat: list) -> torch.device:
    if tls.pending_device is not None:
        return tls.pending_device
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != "meta":
        return indexed_device(dev)
    for x in flat:
        if isinstance(x, DeferredTensor):
            return x.device
    for x in flat:
        if isinstance(x, torch.Tensor):
            return x.device
    return default_device()


def device_of(args: tuple, kwargs: dict) -> torch.device:
    return output_device(kwargs, iter_args(args, kwargs))


def requires_grad(t: torch.Tensor) -> bool:
    return t._rg if isinstance(t, DeferredTensor) else t.requires_grad


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def meta_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x._meta if type(x) is DeferredTensor else to_meta(x)
    if isinstance(x, torch.device):
        return META
    return x


def to_meta_or_same(x: Any) -> Any:
    return to_meta(x) if isinstance(x, torch.Tensor) else x


def new_output(
    meta: torch.Tensor, device: torch.device, rg: bool
) -> tuple[DeferredTensor, TensorRecord, StorageRecord]:
    """A deferred tensor over a new storage (an op's non-aliasing output): the one way both a
    recording and a recipe make them."""
    storage = StorageRecord(storage_nbytes(meta), meta.dtype, device)
    rec = TensorRecord(storage, meta)
    return DeferredTensor(meta, rec, device, rg, rg), rec, storage
