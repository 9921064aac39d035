"""One tensor's values as ``materialize`` would give them (exact mode), without changing it.

A deferred tensor's values come from the core's ``values_to_write``: only the recorded ops it
depends on run, on the CPU, on every core (the parallel exact fills); nothing in the model is
swapped and nothing is kept afterwards. A deferred view of memory an earlier ``materialize`` made
real gets that memory's values now, as materializing it would (the core's one rule for it). A
real tensor is saved as it is now (also with ``rng="fast"`` values); a sharded one (DTensor)
gives its local shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from jupyter_metainit.core import DeferredTensor, copy_in_steps, local_tensor, values_to_write

__all__ = ["Recycler", "cpu_values", "cpu_values_of_batch"]


def cpu_values(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous CPU tensor with ``t``'s values (cast to ``dtype`` if it is floating)."""
    local = local_tensor(t)
    if isinstance(local, DeferredTensor):
        values = values_to_write(local)
    else:
        values = local.detach().to("cpu")
    if dtype is not None and values.is_floating_point() and values.dtype != dtype:
        values = values.to(dtype)
    return values.contiguous()


def cpu_values_of_batch(
    tensors: Sequence[torch.Tensor],
    dtype: torch.dtype | None = None,
    memory: Callable[[int], torch.UntypedStorage] | None = None,
    on_part: Callable[[int, int, int, torch.Tensor], None] | None = None,
) -> list[torch.Tensor]:
    """:func:`cpu_values` of each tensor; the deferred ones computed together, in one replay
    whose fills of one random stream run cut across all cores (``values_to_write`` of a list),
    into storages from ``memory(nbytes)`` (a :class:`Recycler`) where given. ``on_part(j, a, b,
    flat)`` (from the replay's threads): elements ``[a, b)`` of tensor ``j``'s values (``flat``)
    are final before the whole batch is (never for a tensor that ``dtype`` casts)."""
    locals_ = [local_tensor(t) for t in tensors]
    which = [j for j, x in enumerate(locals_) if isinstance(x, DeferredTensor)]

    def deferred_part(k: int, a: int, b: int, flat: torch.Tensor) -> None:
        if dtype is None or not flat.is_floating_point() or flat.dtype == dtype:
            on_part(which[k], a, b, flat)

    parts = None if on_part is None else deferred_part
    computed = values_to_write([locals_[j] for j in which], memory, parts) if which else []
    out = [t if isinstance(x, DeferredTensor) else cpu_values(t, dtype)
           for t, x in zip(tensors, locals_, strict=True)]  # fmt: skip
    for j, values in zip(which, computed, strict=True):
        if dtype is not None and values.is_floating_point() and values.dtype != dtype:
            cast = torch.empty(values.shape, dtype=dtype)  # ``.to(dtype)``, a Cancel between steps
            copy_in_steps(cast, values)
            values = cast
        out[j] = values.contiguous()
    return out


class Recycler:
    """CPU buffers handed from written batches to the next ones: new memory costs a page fault
    per page on first touch (about a sixth of a ``normal_`` fill's time), and a model repeats
    its tensors' sizes layer after layer.

    ``recycler(nbytes)`` (the replay's ``memory``) gives a kept storage of that size or a new
    one, and remembers it (a strong reference: its address cannot be another tensor's while
    known). Only storages it handed out come back through :meth:`give_back`, once written, so a
    model's real tensor is never reused. :meth:`start_batch` drops what the next batch will not
    take before it is computed (at most two batches' memory is alive), :meth:`settle` forgets
    what a batch allocated but does not return (intermediates, freed by the replay)."""

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

    def start_batch(self, sizes: Sequence[int]) -> None:
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

    def settle(self, values: Sequence[torch.Tensor]) -> None:
        """Forget the storages handed out for this batch that are not among its ``values``."""
        out = {t.untyped_storage().data_ptr() for t in values}
        with self._lock:
            for ptr in self._this_batch - out:
                self._handed.pop(ptr, None)
            self._this_batch = set()

    def give_back(self, written: Sequence[torch.Tensor]) -> None:
        """Keep the storages of ``written`` (written out, referenced nowhere else) that were
        handed out here; each once."""
        with self._lock:
            for t in written:
                storage = self._handed.pop(t.untyped_storage().data_ptr(), None)
                if storage is not None:
                    self._kept.setdefault(storage.nbytes(), []).append(storage)
