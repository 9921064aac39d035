"""CPU memory handed from one batch of values to the next (``values_to_write``'s ``memory``).

Writing (``save``) and measuring (``stats``, ``compare``) a model go through its tensors a batch
at a time, each batch computed by one replay. New memory costs a page fault per page on first
touch (about a sixth of a bfloat16 ``normal_`` fill's time), and a model repeats its tensors'
sizes layer after layer: a :class:`Recycler` gives the replay the storages of batches already
written or measured.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

__all__ = ["Recycler"]


class Recycler:
    """Storages handed from finished batches to the next ones; one per save or measurement.

    ``recycler(nbytes)`` (the replay's ``memory``: ``values_to_write(batch, recycler)``) gives a
    kept storage of that size or a new one, and remembers it (a strong reference: its address
    cannot be another tensor's while known). Only storages it handed out come back through
    :meth:`give_back`, once the caller is done with them, so a model's real tensor (or a file's
    mapping) is never reused. :meth:`start_batch` drops what the next batch will not take before
    it is computed (at most two batches' memory is alive), :meth:`settle` forgets what a
    batch's replay took but does not return (intermediates, freed by the replay).

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
        self._handed: dict[int, torch.UntypedStorage] = {}  # data_ptr -> storage handed out
        self._this_batch: set[int] = set()  # data_ptrs handed out for the batch being made
        self._kept: dict[int, list[torch.UntypedStorage]] = {}  # nbytes -> free storages

    def __call__(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            free = self._kept.get(nbytes)
            storage = free.pop() if free else None
        if storage is None:
            storage = torch.UntypedStorage(nbytes)
        with self._lock:
            self._handed[storage.data_ptr()] = storage
            self._this_batch.add(storage.data_ptr())
        return storage

    def start_batch(self, sizes: Iterable[int]) -> None:
        """Drop the kept storages a batch of tensors of ``sizes`` bytes will not take."""
        wanted: dict[int, int] = {}
        for n in sizes:
            wanted[n] = wanted.get(n, 0) + 1
        with self._lock:
            for n in list(self._kept):
                del self._kept[n][wanted.get(n, 0) :]
                if not self._kept[n]:
                    del self._kept[n]
            self._this_batch = set()

    def settle(self, values: Iterable[torch.Tensor]) -> None:
        """Forget the storages handed out for this batch that are not among its ``values``."""
        out = {t.untyped_storage().data_ptr() for t in values}
        with self._lock:
            for ptr in self._this_batch - out:
                self._handed.pop(ptr, None)
            self._this_batch = set()

    def give_back(self, done: Iterable[torch.Tensor]) -> None:
        """Keep the storages of ``done`` (written or measured, referenced nowhere else) that
        were handed out here; each once."""
        with self._lock:
            for t in done:
                storage = self._handed.pop(t.untyped_storage().data_ptr(), None)
                if storage is not None:
                    self._kept.setdefault(storage.nbytes(), []).append(storage)
