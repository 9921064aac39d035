"""Planning a replay: the recorded ops a set of tensors depends on, and nothing else.

:func:`plan` walks backwards from the requested storages through the ops that wrote them and the
storages those ops read *before* they ran, so the work is proportional to the requested subtree;
its docstring states the rules of the records it relies on (which ``core.record``'s
``handle_op`` guarantees). Dead writes (a storage overwritten completely later) are skipped.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from jupyter_metainit.core.errors import DeferredDataError
from jupyter_metainit.core.record.graph import (
    External,
    GradCall,
    OpRecord,
    StorageRecord,
    TensorRecord,
)
from jupyter_metainit.core.replay.read_cache import ValueCache

__all__ = ["Plan", "last_writes", "plan"]


class Plan:
    """The ops to replay (in recording order), the storages that must come out, the storages
    that start from a value already computed (``seeds``: id -> (record, value)), and the
    storages whose creating op is skipped because a later op overwrites them completely
    (``allocate``: id -> the creating op's output record, allocated empty instead)."""

    def __init__(
        self,
        ops: list[OpRecord],
        targets: list[StorageRecord],
        seeds: dict[int, tuple[StorageRecord, torch.Tensor]],
        versions: dict[int, tuple[StorageRecord, int]],
        allocate: dict[int, TensorRecord],
    ) -> None:
        self.ops = ops
        self.targets = targets
        self.seeds = seeds
        self.versions = versions  # id -> (record, writes applied once the plan has run)
        self.allocate = allocate

    def __len__(self) -> int:
        return len(self.ops)

    def meta_input_op(self) -> OpRecord | None:
        """The first op recorded on a plain tensor of PyTorch's meta device (no data:
        ``deferred.copy_(torch.empty(3, device="meta"))``): why a replay that failed could not
        run, for an error that says so instead of PyTorch's "Cannot copy out of meta tensor"."""
        return next(
            (
                op
                for op in self.ops
                for x in (*op.args, *op.kwargs.values())
                if isinstance(x, External) and x.tensor.is_meta
            ),
            None,
        )


def _writes_before(storage: StorageRecord, seq: int) -> int:
    """How many of ``storage``'s writes were recorded before op number ``seq``."""
    return bisect.bisect_left(storage.writes, seq, key=lambda op: op.seq)


def _last_overwrite(storage: StorageRecord, lo: int, hi: int) -> int:
    """Index of the last write in ``writes[lo:hi]`` that overwrites ``storage`` completely
    without reading it (everything before it is dead), else ``lo``."""
    writes = storage.writes
    for i in range(hi - 1, lo, -1):
        if storage in writes[i].overwrites:
            return i
    return lo


class _CacheConflict(Exception):
    def __init__(self, *storages: StorageRecord) -> None:
        self.storages = storages


def plan(records: Iterable[TensorRecord], cache: ValueCache | None = None) -> Plan:
    """The ops that produce the current values of ``records``' storages.

    The rules it relies on, which the recorder (``core.record``'s ``handle_op``) guarantees:

    * **Storages, not tensors, have histories.** Every op that creates or writes memory is
      appended to ``writes`` of each storage it creates or writes, in recording order; views
      are not ops but geometries (``TensorRecord``) over a storage, so a write through any view
      is a write of the storage.
    * **Reads are as of the op.** An op's ``reads`` are the storages of its tensor inputs; it
      saw each one after exactly the writes recorded before it (``seq`` order). So the value of
      storage ``S`` "as op ``o`` read it" needs ``S``'s writes with ``seq < o.seq``, and,
      recursively, what those writes read.
    * **Dead writes are skipped.** Of those writes, only the ones from the last write that
      ``overwrites`` ``S`` completely without reading it (``normal_`` after the constructor's
      ``kaiming_uniform_``) are needed; such an op does not list ``S`` in its ``reads``. A
      skipped random op costs nothing in ``fast`` mode, and in ``exact`` mode the generator is
      moved past it by ``streams.state_before`` (jump-ahead or regeneration) without filling memory.
    * **Recording order is a valid execution order** for any subset closed this way.

    With ``cache`` (reads during recording), a storage whose value after its first ``k`` writes
    is cached starts from it, unless some op of the plan reads it at an earlier version or a
    gradient call of the plan runs again the forward that writes it.
    """
    targets: dict[int, StorageRecord] = {}
    for r in records:
        targets.setdefault(id(r.storage), r.storage)
    disabled: set[int] = set()
    while True:
        try:
            return _closure(targets, cache, disabled)
        except _CacheConflict as conflict:
            disabled.update(id(s) for s in conflict.storages)


def _closure(
    targets: dict[int, StorageRecord], cache: ValueCache | None, disabled: set[int]
) -> Plan:
    inf = 1 << 62
    starts: dict[int, int] = {}  # storage id -> writes already in a cached value (0: none)
    final: dict[int, int] = {}  # storage id -> writes applied once the plan has run
    seeds: dict[int, tuple[StorageRecord, torch.Tensor]] = {}
    storages: dict[int, StorageRecord] = {}
    requested: set[tuple[int, int]] = set()
    included: dict[int, OpRecord] = {}
    work: list[tuple[StorageRecord, int]] = [(s, inf) for s in targets.values()]
    while work:
        storage, upto = work.pop()
        sid = id(storage)
        if not storage.writes:
            raise DeferredDataError(
                "a deferred tensor has no recorded origin; it cannot be replayed"
            )
        need = len(storage.writes) if upto == inf else _writes_before(storage, upto)
        if (sid, need) in requested:
            continue
        requested.add((sid, need))
        if sid not in starts:
            start = 0
            cached = cache.get(storage) if cache is not None and sid not in disabled else None
            if cached is not None and 0 < cached[0] <= need:
                start = cached[0]
                seeds[sid] = (storage, cached[1])
            starts[sid] = start
            storages[sid] = storage
        start = starts[sid]
        if need < start:
            raise _CacheConflict(storage)
        final[sid] = max(final.get(sid, 0), need)
        for op in storage.writes[_last_overwrite(storage, start, need) : need]:
            if op.seq in included:
                continue
            included[op.seq] = op
            if isinstance(op, GradCall) and cache is not None:
                # Its forward runs again in grad mode (``grads``): none of what it makes may
                # start from a cached value, which would hold no graph.
                fresh = [s for s in op.span_storages if id(s) not in disabled]
                if fresh:
                    raise _CacheConflict(*fresh)
            for s in op.reads:
                work.append((s, op.seq))
    ops = sorted(included.values(), key=lambda o: o.seq)
    for op in ops:
        # An op that writes several storages (``_foreach_add_`` over a list, batch norm's
        # running statistics) runs whole: the storages it writes besides the one asked for
        # come out with its write applied too, and are cached as such.
        for s in op.mutates:
            if id(s) in final:
                final[id(s)] = max(final[id(s)], _writes_before(s, op.seq) + 1)
    allocate: dict[int, TensorRecord] = {}
    for sid, storage in storages.items():
        creator = storage.writes[0]
        if sid not in seeds and creator.seq not in included:
            out = next(r for r in creator.outputs if r is not None and r.storage is storage)
            allocate[sid] = out
    versions = {sid: (storages[sid], n) for sid, n in final.items()}
    return Plan(ops, list(targets.values()), seeds, versions, allocate)


def last_writes(p: Plan) -> dict[int, int]:
    """Per storage id, the index of the plan's last op that creates or writes it."""
    last_write: dict[int, int] = {}
    for i, op in enumerate(p.ops):
        for r in op.outputs:
            if r is not None:
                last_write[id(r.storage)] = i
        for s in op.mutates:
            last_write[id(s)] = i
    return last_write
