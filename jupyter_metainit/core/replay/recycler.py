"""The memory ``save`` and ``stats`` compute batches of values into, handed on batch to batch.

When and why: ``values_to_write(batch, memory)`` asks ``memory(nbytes)`` for each storage of a
batch. New memory costs more than the values put in it: the kernel maps and zeroes each page on
first touch, about 1.2 ns an element of bfloat16 against 1.4 ns for the native ``normal_`` that
fills it, and torch gives large blocks back to the system when they are freed, so every new
tensor paid it again. A :class:`Recycler` carves each batch's storages out of one slab (a block
of at least the batch's bytes, touched once) and takes a slab again once every storage cut from
it has come back: two slabs serve a whole model whatever its tensors' sizes, where storages kept
by size served only batches of the same sizes (a model's embedding and head, its first layers,
each took new memory).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

__all__ = ["Recycler"]

# Each storage starts on a 64-byte boundary, as torch's CPU allocator aligns them.
_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _with_headroom(need: int) -> int:
    """A new slab's size: an eighth more than the batch needs (at least 1 MiB), so that the
    next batches, a few tensors larger or smaller, take it again instead of new memory."""
    step = max(1 << 20, need // 8)
    return (need + step - 1) // step * step + step


class _Slab:
    """One block of memory and the storages cut from it that are still out."""

    def __init__(self, nbytes: int) -> None:
        self.block = torch.empty(nbytes, dtype=torch.uint8)
        self.view = memoryview(self.block.numpy())
        self.used = 0  # bytes handed out since the slab was last empty
        self.out: set[int] = set()  # data_ptrs of its storages not given back

    @property
    def capacity(self) -> int:
        return self.block.numel()

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        start = self.used
        if start + nbytes > self.capacity:
            return None
        self.used = _aligned(start + nbytes)
        # A storage over part of the block, no copy; it keeps the block alive while it lives.
        storage = torch.frombuffer(self.view[start : start + nbytes], dtype=torch.uint8)
        storage = storage.untyped_storage()
        self.out.add(storage.data_ptr())
        return storage

    def put_back(self, ptr: int) -> None:
        self.out.discard(ptr)
        if not self.out:
            self.used = 0


class Recycler:
    """Memory handed from finished batches to the next ones; one per save or measurement.

    ``recycler(nbytes)`` (the replay's ``memory``: ``values_to_write(batch, recycler)``) gives a
    storage of that size cut from the batch's slab (or, past the slab's end, a new one) and
    remembers it. Only storages it handed out come back through :meth:`give_back`, once the
    caller is done with them, so a model's real tensor (or a file's mapping) is never reused.
    :meth:`start_batch` picks the slab for the next batch: an empty one large enough, else a new
    one, dropping the empty ones it does not take (at most the slabs of the batches alive are
    kept). :meth:`settle` forgets what a batch's replay took but does not return
    (intermediates, freed by the replay).

    Example::

        recycler = Recycler()
        for batch in batches:
            recycler.start_batch(t.nbytes for t in batch)
            values = values_to_write(batch, recycler)
            recycler.settle(values)
            use(values)
            recycler.give_back(values)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._current: _Slab | None = None
        self._handed: dict[int, _Slab | None] = {}  # data_ptr -> its slab (None: its own memory)
        self._this_batch: set[int] = set()  # data_ptrs handed out for the batch being made

    def __call__(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            slab = self._current
            storage = slab.take(nbytes) if slab is not None and nbytes else None
            if storage is None:
                slab = None
                storage = torch.UntypedStorage(nbytes)
            self._handed[storage.data_ptr()] = slab
            self._this_batch.add(storage.data_ptr())
        return storage

    def start_batch(self, sizes: Iterable[int]) -> None:
        """Pick the slab a batch of tensors of ``sizes`` bytes is cut from."""
        need = sum(_aligned(n) for n in sizes)
        with self._lock:
            empty = [s for s in self._slabs if not s.out]
            fitting = [s for s in empty if s.capacity >= need]
            chosen = min(fitting, key=lambda s: s.capacity) if fitting else None
            self._slabs = [s for s in self._slabs if s.out or s is chosen]
            if chosen is None and need:
                chosen = _Slab(_with_headroom(need))
                self._slabs.append(chosen)
            self._current = chosen
            self._this_batch = set()

    def settle(self, values: Iterable[torch.Tensor]) -> None:
        """Forget the storages handed out for this batch that are not among its ``values``."""
        out = {t.untyped_storage().data_ptr() for t in values}
        with self._lock:
            for ptr in self._this_batch - out:
                self._forget(ptr)
            self._this_batch = set()

    def give_back(self, done: Iterable[torch.Tensor]) -> None:
        """Take back the memory of ``done`` (written or measured, referenced nowhere else) that
        was handed out here; each once."""
        with self._lock:
            for t in done:
                self._forget(t.untyped_storage().data_ptr())

    def _forget(self, ptr: int) -> None:
        if ptr not in self._handed:
            return
        slab = self._handed.pop(ptr)
        if slab is not None:
            slab.put_back(ptr)
