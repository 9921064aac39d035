"""``progress=``: how far a materialization is, in the bytes it makes.

The total is what the requested tensors hold when real, in the requested dtype: known before
anything runs, it never changes, and ``done`` never goes back. The replay reports each storage
it finishes and the phases that take long without finishing one (regenerating a random stream,
reading checkpoint files). ``materialize_sharded`` reports through the same callback.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.record.graph import StorageRecord
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay import Progress

__all__ = ["MemoryProgress", "progress_callback", "storage_sizes"]


ProgressCallback = Callable[..., None]


def progress_callback(
    progress: Any, desc: str = "materialize"
) -> tuple[ProgressCallback | None, Any]:
    """``progress=`` as a ``callable(done_bytes, total_bytes, phase)`` (and a bar to close,
    labelled ``desc``)."""
    if progress is None or progress is False:
        return None, None
    if callable(progress):
        return _with_phase(progress), None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

        def update(done: int, total: int, phase: str = "") -> None:
            if bar.total != total:
                bar.total = total
            if phase:
                bar.set_postfix_str(phase, refresh=False)
            bar.update(done - bar.n)

        return update, bar
    raise TypeError("progress must be None, a bool, or a callable(done_bytes, total_bytes)")


def _with_phase(callback: Callable[..., None]) -> ProgressCallback:
    """Pass ``phase`` only to callables that take it (``callable(done, total)`` works)."""
    try:
        params = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):
        return lambda done, total, phase="": callback(done, total)
    takes = any(p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD or p.name == "phase"
                for p in params) or len(list(params)) >= 3  # fmt: skip
    if takes:
        return callback
    return lambda done, total, phase="": callback(done, total)


class MemoryProgress(Progress):
    """Progress in the bytes the requested tensors hold when done (in the requested dtype):
    the total is known before anything runs and never changes; ``done`` never decreases."""

    def __init__(self, callback: ProgressCallback, tensors: list[DeferredTensor],
                 dtype: torch.dtype | None) -> None:  # fmt: skip
        self.callback = callback
        self.sizes = storage_sizes(tensors, dtype)
        self.total = sum(self.sizes.values())
        self.done = 0
        self.current = ""
        callback(0, self.total, "starting")

    def storage_done(self, storage: StorageRecord) -> None:
        self.done += self.sizes.pop(id(storage), 0)
        self.callback(self.done, self.total, self.current)

    def phase(self, text: str) -> None:
        self.current = text
        self.callback(self.done, self.total, text)

    def loaded(self, tensors: list[DeferredTensor]) -> None:
        for t in tensors:
            self.done += self.sizes.pop(id(t._rec.storage), 0)
        self.callback(self.done, self.total, self.current)


def storage_sizes(tensors: list[DeferredTensor], dtype: torch.dtype | None) -> dict[int, int]:
    """Bytes each storage of ``tensors`` holds when real, floating ones cast to ``dtype``."""
    sizes: dict[int, int] = {}
    for t in tensors:
        size = t._rec.storage.nbytes
        if dtype is not None and t.is_floating_point():
            size = size // t.element_size() * dtype.itemsize
        sizes[id(t._rec.storage)] = size
    return sizes
