"""``progress=``: how far a materialization is, in the bytes it makes.

The total is what the requested tensors hold when real, in the requested dtype: known before
anything runs, it never changes, and ``done`` never goes back. The replay reports each storage
it finishes, the phases that take long without finishing one (regenerating a random stream,
reading checkpoint files), and, about every 0.2 s, how far a long op is inside one tensor (a
fill of gigabytes, made in steps), so the bar moves and Cancel (raising from the callback)
stops it within a step. ``materialize_sharded`` reports through the same callback.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.record.graph import StorageRecord
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay import Progress
from jupyter_metainit.core.runtime.arguments import check_progress
from jupyter_metainit.core.runtime.interrupts import Steps, counting

__all__ = ["MemoryProgress", "inside_steps", "progress_callback", "storage_sizes"]


ProgressCallback = Callable[..., None]


def progress_callback(
    progress: Any, desc: str = "materialize"
) -> tuple[ProgressCallback | None, Any]:
    """``progress=`` as a ``callable(done_bytes, total_bytes, phase)`` (and a bar to close,
    labelled ``desc``)."""
    if callable(check_progress(progress)):
        return _with_phase(progress), None
    if progress is not True:  # None or False
        return None, None
    from tqdm.auto import tqdm

    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

    def update(done: int, total: int, phase: str = "") -> None:
        if bar.total != total:
            bar.total = total
        if phase:
            bar.set_postfix_str(phase, refresh=False)
        bar.update(done - bar.n)

    return update, bar


def _with_phase(callback: Callable[..., None]) -> ProgressCallback:
    """Pass ``phase`` only to callables that take it (``callable(done, total)`` works)."""
    try:
        params = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):
        return lambda done, total, phase="": callback(done, total)
    takes = (
        any(
            p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD or p.name == "phase"
            for p in params
        )
        or len(list(params)) >= 3
    )
    if takes:
        return callback
    return lambda done, total, phase="": callback(done, total)


class MemoryProgress(Progress):
    """Progress in the bytes the requested tensors hold when done (in the requested dtype):
    the total is known before anything runs and never changes; ``done`` never decreases.

    Inside a long op (a fill of gigabytes, in steps) the bytes it has made so far count too
    (``inside``, told on the calling thread about every ``TELL_S``), so a large tensor moves the
    bar as it fills and every call is a chance to cancel. Replay threads tell finished storages
    too: the counts and the calls are serialized."""

    def __init__(
        self, callback: ProgressCallback, tensors: list[DeferredTensor], dtype: torch.dtype | None
    ) -> None:
        self.callback = callback
        self.sizes = storage_sizes(tensors, dtype)
        self.total = sum(self.sizes.values())
        self.done = 0  # bytes of storages finished
        self.shown = 0  # what was told last: never decreases
        self.current = ""
        self._lock = threading.Lock()
        callback(0, self.total, "starting")

    def _tell(self, done: int) -> None:
        with self._lock:
            self.shown = max(self.shown, min(done, self.total))
            self.callback(self.shown, self.total, self.current)

    def storage_done(self, storage: StorageRecord) -> None:
        with self._lock:
            self.done += self.sizes.pop(id(storage), 0)
        self._tell(self.done)

    def inside(self, nbytes: int) -> None:
        self._tell(self.done + nbytes)

    def share(self, storages: list[StorageRecord]) -> int:
        return sum(self.sizes.get(id(s), 0) for s in storages)

    def phase(self, text: str) -> None:
        self.current = text
        self._tell(self.done)

    def loaded(self, tensors: list[DeferredTensor]) -> None:
        with self._lock:
            for t in tensors:
                self.done += self.sizes.pop(id(t._rec.storage), 0)
        self._tell(self.done)


def inside_steps(tracker: MemoryProgress | None) -> counting:
    """Long copies within the block (a checkpoint's tensors read from their files, in steps)
    told to ``tracker`` as the bytes copied so far (taken back at the end: ``loaded`` counts
    them whole), where a callback raising stops them; without a tracker, only Ctrl-C does."""
    if tracker is None:
        return counting(Steps())
    return counting(Steps(tracker.inside), take_back=True)


def storage_sizes(tensors: list[DeferredTensor], dtype: torch.dtype | None) -> dict[int, int]:
    """Bytes each storage of ``tensors`` holds when real, floating ones cast to ``dtype``."""
    sizes: dict[int, int] = {}
    for t in tensors:
        size = t._rec.storage.nbytes
        if dtype is not None and t.is_floating_point():
            size = size // t.element_size() * dtype.itemsize
        sizes[id(t._rec.storage)] = size
    return sizes
