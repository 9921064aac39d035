"""Shard regions: replaying only the part of a large fill that a rank's shard is cut from.

FSDP2 and DTensor cut a rank's shard out of a whole parameter with one ``copy_`` of a contiguous
slice. When a plan reads only part of a storage after its last write (:func:`read_extents`), or
its only read is such a copy (:func:`copied_once`), the fill that makes it can generate that
part alone (:func:`fill_region`): a shard's peak memory stays its own size. A large storage
computed whole although only part was needed is noted for ``materialize_sharded``'s report
(:func:`noting_whole_intermediates`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from jupyter_metainit.core.record.graph import OpRecord, StorageRecord, TensorRecord
from jupyter_metainit.core.replay.planning import Plan, last_writes
from jupyter_metainit.core.replay.random_modes import call_with_generator
from jupyter_metainit.core.rng.draws import is_contiguous
from jupyter_metainit.core.rng.split_fill import FILLS, MIN_SKIP, fill_region_into
from jupyter_metainit.core.runtime.plain import iter_args

__all__ = [
    "copied_once",
    "copy_from_pending_fill",
    "fill_region",
    "noted_whole",
    "noting_whole_intermediates",
    "read_extents",
]

aten = torch.ops.aten


def _byte_range(r: TensorRecord) -> tuple[int, int]:
    if any(n == 0 for n in r.size):
        return (0, 0)
    last = r.offset + sum((n - 1) * st for n, st in zip(r.size, r.stride, strict=True))
    size = r.dtype.itemsize
    return (r.offset * size, (last + 1) * size)


def read_extents(p: Plan, keep: set[int]) -> dict[int, tuple[int, int]]:
    """Per storage, the byte range that the plan's ops read after its last write (the kept
    storages are read whole). Used to fill only the part of a parameter a shard is cut from.
    Storages written after being read, or read in ways not seen here, get their whole range."""
    last_write = last_writes(p)
    extents: dict[int, tuple[int, int]] = {}
    whole: set[int] = set(keep)
    for i, op in enumerate(p.ops):
        for x in iter_args(op.args, op.kwargs):
            if not isinstance(x, TensorRecord):
                continue
            sid = id(x.storage)
            written = last_write.get(sid, -1)
            if written == i and x.storage in op.overwrites:
                continue  # the last write itself, which does not read what it overwrites
            if written >= i:  # read before (or by) its last write
                whole.add(sid)
                continue
            lo, hi = _byte_range(x)
            cur = extents.get(sid)
            extents[sid] = (lo, hi) if cur is None else (min(cur[0], lo), max(cur[1], hi))
    for op in p.ops:
        for s in op.reads:
            if id(s) not in extents:
                whole.add(id(s))  # read without a visible geometry: all of it
    for sid in whole:
        extents.pop(sid, None)
    return extents


def copied_once(p: Plan, keep: set[int]) -> set[int]:
    """Storages whose last write is followed by exactly one read: a ``copy_`` of a contiguous
    slice of them into a contiguous tensor of the same dtype and size (how FSDP2 and DTensor cut
    a rank's shard out of a parameter)."""
    last_write = last_writes(p)
    readers: dict[int, list[tuple[int, OpRecord]]] = {}
    for i, op in enumerate(p.ops):
        for s in op.reads:
            readers.setdefault(id(s), []).append((i, op))
    out = set()
    for sid, ops in readers.items():
        if sid in keep or len(ops) != 1:
            continue
        i, op = ops[0]
        if op.func is not aten.copy_.default or last_write.get(sid, -1) >= i:
            continue
        dst, src = op.args[0], op.args[1]
        if (
            isinstance(dst, TensorRecord)
            and isinstance(src, TensorRecord)
            and id(src.storage) == sid
            and id(dst.storage) != sid
            and dst.dtype == src.dtype == src.storage.dtype
            and dst.size == src.size
            and is_contiguous(dst.size, dst.stride)
            and is_contiguous(src.size, src.stride)
            and not (src.conj or src.neg or dst.conj or dst.neg)
        ):
            out.add(sid)
    return out


def fill_region(
    op: OpRecord, extents_of: Callable[[], dict[int, tuple[int, int]]]
) -> tuple[int, int] | None:
    """The elements of a whole-storage fill that later ops read, when that is a small part
    of it (a shard), else None. ``extents_of``: :func:`read_extents` of the plan (asked only
    for a large fill)."""
    x = op.args[0] if op.args else None
    if op.func not in FILLS or not isinstance(x, TensorRecord):
        return None
    storage = x.storage
    if x.offset != 0 or x.nbytes != storage.nbytes or x.dtype != storage.dtype:
        return None
    if storage.nbytes // x.dtype.itemsize < MIN_SKIP:
        return None  # too small for a part to be worth a jump (value reads, small layers)
    extent = extents_of().get(id(storage))
    if extent is None:
        return None
    size = x.dtype.itemsize
    lo, hi = extent[0] // size, -(-extent[1] // size)
    n = storage.nbytes // size
    return (lo, hi) if hi - lo <= 0.75 * n else None


class _Noted(threading.local):
    whole: list[StorageRecord] | None = None


_noted = _Noted()


@contextlib.contextmanager
def noting_whole_intermediates() -> Iterator[list[StorageRecord]]:
    """Collect the large storages that replays on this thread compute whole although only part
    of them is needed: a parameter a shard is cut from, when its last write cannot be generated
    for the shard's rows alone (``materialize_sharded`` reports them)."""
    found: list[StorageRecord] = []
    saved, _noted.whole = _noted.whole, found
    try:
        yield found
    finally:
        _noted.whole = saved


def noted_whole() -> list[StorageRecord] | None:
    """The list :func:`noting_whole_intermediates` collects into on this thread, if any."""
    return _noted.whole


def copy_from_pending_fill(run: Any, op: OpRecord, device: torch.device) -> bool:
    """``dst.copy_(src)`` (an op of ``run``, a ``run.Run``) where ``src`` is a slice of a fill
    not run yet: write the slice's values straight into ``dst`` through a small buffer (the
    shard, never the whole)."""
    src = op.args[1] if len(op.args) > 1 else None
    if not isinstance(src, TensorRecord):
        return False
    pending = run.pending_fills.pop(id(src.storage), None)
    if pending is None:
        return False
    fill_op, rest, kwargs, gen = pending
    dst = run.arg(op.args[0], device)
    whole = fill_op.args[0]
    numel = whole.storage.nbytes // whole.dtype.itemsize
    at_end = run.random.fill_end(fill_op)
    done = fill_region_into(
        fill_op.func,
        numel,
        dst,
        src.offset,
        lambda t, g: call_with_generator(fill_op, (t, *rest), kwargs, g),
        gen,
        at_end=at_end,
    )
    if not done:  # not expected (checked when deferred): run the whole fill, then copy
        target = run.real(whole, device)
        call_with_generator(fill_op, (target, *rest), kwargs, gen)
        dst.copy_(run.real(src, device))
    return True
