"""Values computed for reads while recording, kept so that the next read replays only what is new.

Model code reads values during construction: ``nn.init.trunc_normal_`` asks ``mask.any()`` after
every resampling round, ``.item()`` feeds Python arithmetic. Each read is an exact replay on the
CPU; without this cache every read would replay the tensor's history from the start. A storage's
history only ever grows (its ``writes`` list is append-only), so "its value after its first
``k`` writes" never goes stale: a later read continues from there.

The cache is bounded (``budget`` bytes, least recently used first out), holds no storage larger
than a quarter of it, forgets a storage when its recording is freed, and is emptied when the
outermost ``meta_init`` block exits and by ``clear_meta_init_cache``.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from jupyter_metainit.core.record.graph import StorageRecord
from jupyter_metainit.core.runtime.interrupts import critical

__all__ = ["ValueCache", "value_cache"]


class ValueCache:
    """``StorageRecord`` -> (writes applied, real CPU tensor over the whole storage)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[int, tuple[weakref.ref, int, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        # Re-entrant: a storage's weakref callback (``_forget``) can run on this thread while
        # the lock is held, whenever a garbage collection happens inside ``put``.
        self._lock = threading.RLock()

    @property
    def max_entry(self) -> int:
        return self.budget // 4

    def get(self, storage: StorageRecord) -> tuple[int, torch.Tensor] | None:
        with critical(), self._lock:
            entry = self._entries.get(id(storage))
            if entry is None or entry[0]() is not storage:
                return None
            self._entries.move_to_end(id(storage))
            return entry[1], entry[2]

    def put(self, storage: StorageRecord, writes: int, value: torch.Tensor) -> None:
        nbytes = storage.nbytes
        if nbytes > self.max_entry:
            return
        key = id(storage)
        with critical(), self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[2].untyped_storage().nbytes()
                if old[0]() is storage and old[1] > writes:
                    writes, value = old[1], old[2]  # keep the later version
            ref = weakref.ref(storage, lambda _r, key=key: self._forget(key, _r))
            self._entries[key] = (ref, writes, value)
            self._bytes += value.untyped_storage().nbytes()
            while self._bytes > self.budget and self._entries:
                _, (_, _, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted.untyped_storage().nbytes()

    def _forget(self, key: int, ref: weakref.ref) -> None:
        with critical(), self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]
                self._bytes -= entry[2].untyped_storage().nbytes()

    def clear(self) -> None:
        with critical(), self._lock:
            self._entries.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)


value_cache = ValueCache(budget=256 << 20)
