"""Storages a materialization made real: the one rule for the values of deferred tensors over them.

``materialize(model.w)`` makes ``w``'s storage real; a deferred view of the same storage
(``self.w_t = self.w.t()``, a buffer ``w.data[2:4]``) stays deferred, and materializing it later
makes it a view of that memory, as in eager and in a whole-model call. So the values of such a
view are the memory's values *now*, whatever was done to it in place since (``w.data.mul_(2)``,
training): replaying its recording would give what the memory held before.

This module owns that rule, for every path that gives a deferred tensor's values: ``materialize``
(a view of the memory), ``save`` (``reads.values_to_write``), value reads (``.item()``, an op
that needs values) and ops on such a view while it is still deferred (``realized_view``:
recording runs them on the memory, as eager code does). It holds while the memory is still
what materialize made (same real tensor, same memory, nothing recorded on the storage since);
otherwise the recording is replayed.

:func:`real_view` is how any replay sees a record over real memory: its view of the storage.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from jupyter_metainit.core.record.graph import StorageRecord, TensorRecord
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.swap import content_references

__all__ = [
    "any_realized",
    "geometry_matches",
    "real_view",
    "recording_only",
    "current_values",
    "realized_memory",
    "realized_view",
    "remember_realized",
]


def geometry_matches(t: torch.Tensor, r: TensorRecord) -> bool:
    """Whether ``t`` is ``r``'s view of its storage as it is (no view to take)."""
    return (
        t.dtype == r.dtype
        and tuple(t.shape) == r.size
        and tuple(t.stride()) == r.stride
        and t.storage_offset() == r.offset
        and not r.conj
        and not r.neg
    )


def real_view(base: torch.Tensor, r: TensorRecord) -> torch.Tensor:
    """``r``'s view of the real storage ``base``: any geometry, any dtype (dtype views are views
    too), with the lazy conjugate/negative bits the deferred view had."""
    if geometry_matches(base, r):
        return base
    if base.dtype == r.dtype:
        view = base.as_strided(r.size, r.stride, r.offset)
    else:
        view = torch.empty(0, dtype=r.dtype, device=base.device)
        view.set_(base.untyped_storage(), r.offset, r.size, r.stride)
    if r.conj:
        view = view.conj()
    if r.neg:
        view = view._neg_view()
    return view


# Storages a materialization made real, with the tensor over each, the writes recorded on the
# storage then, and the memory's address.
_realized: weakref.WeakKeyDictionary[StorageRecord, tuple[weakref.ref, int, int]] = (
    content_references()  # a WeakKeyDictionary that torch.utils.swap_tensors can see through
)


def any_realized() -> bool:
    """Whether any storage was made real (a cheap test before taking the lock)."""
    return bool(_realized)


def _realized_tensor(storage: StorageRecord) -> torch.Tensor | None:
    """The real tensor an earlier call made over ``storage``, while it still holds that memory
    and nothing was recorded on the storage since."""
    entry = _realized.get(storage)
    if entry is None:
        return None
    ref, writes, address = entry
    real = ref()
    if real is None or isinstance(real, DeferredTensor) or real.is_meta:
        return None
    memory = real.untyped_storage()
    if (
        len(storage.writes) != writes
        or memory.data_ptr() != address
        or memory.nbytes() != storage.nbytes
    ):
        return None
    return real


def remember_realized(tensors: list[torch.Tensor], records: list[TensorRecord]) -> None:
    """After materialize's swap: note the storages now real whose memory holds them as
    recorded (not a cast copy, not a partial copy)."""
    for t, rec in zip(tensors, records, strict=True):
        if t.dtype != rec.dtype or isinstance(t, DeferredTensor):
            continue
        memory = t.untyped_storage()
        if memory.nbytes() == rec.storage.nbytes and _realized_tensor(rec.storage) is None:
            _realized[rec.storage] = (weakref.ref(t), len(rec.storage.writes), memory.data_ptr())


def realized_memory(storage: StorageRecord) -> torch.Tensor | None:
    """The real memory an earlier ``materialize`` made of ``storage``, as a flat tensor of the
    storage's dtype over all of it, while the rule above holds; else ``None`` (replay it)."""
    if not _realized:
        return None
    real = _realized_tensor(storage)
    if real is None:
        return None
    with plain():
        base = torch.empty(0, dtype=storage.dtype, device=real.device)
        base.set_(real.untyped_storage(), 0, (storage.nbytes // storage.dtype.itemsize,))
    return base


_recipes = threading.local()  # ``recording_only`` blocks open on this thread


@contextlib.contextmanager
def recording_only() -> Iterator[None]:
    """Inside: a deferred tensor over memory made real is its recording, not that memory.
    For ops that build a recipe from a recording (``dematerialize``'s record of a cast: a
    cast of the *values the memory holds* would keep e.g. rng="fast" values as the recipe)."""
    _recipes.depth = getattr(_recipes, "depth", 0) + 1
    try:
        yield
    finally:
        _recipes.depth -= 1


def realized_view(rec: TensorRecord, grad: bool) -> torch.Tensor | None:
    """``rec``'s view of the real memory an earlier ``materialize`` made of its storage, while
    the rule above holds; else ``None``. With ``grad`` (the deferred view requires grad, in
    grad mode) it is a view of the real tensor itself, so autograd reaches it (the caller
    lets autograd record); else of a detached alias (same memory and version counter, so a
    write through it is seen as a write of the real tensor). One look-up; none when nothing
    was made real (the common case)."""
    if not _realized or getattr(_recipes, "depth", 0):
        return None
    real = _realized_tensor(rec.storage)
    if real is None:
        return None
    if grad and real.requires_grad:
        with plain(), torch.enable_grad():
            return real_view(real, rec)
    with plain():
        return real_view(real.detach(), rec)


def current_values(records: list[TensorRecord]) -> dict[int, torch.Tensor]:
    """New contiguous CPU copies of the current values of the records whose storage is real
    memory (by index in ``records``); the others are not in it and need a replay. Call it
    under the lock (``runtime.lock.exclusive``), as ``materialize`` holds it."""
    out: dict[int, torch.Tensor] = {}
    if not _realized:
        return out
    for k, r in enumerate(records):
        base = realized_memory(r.storage)
        if base is not None:
            with plain():
                view = real_view(base, r)
                copy = torch.empty(view.shape, dtype=view.dtype)
                copy.copy_(view)  # resolves the lazy conjugate/negative bits too
            out[k] = copy
    return out
