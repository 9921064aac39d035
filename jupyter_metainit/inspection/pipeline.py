"""Read a batch of tensors while the previous one is measured on every core; two batches alive.

The calling thread reads (for deferred tensors: computes, on every core, through the core's
replay) a batch of consecutive tensors, up to the largest tensor's bytes or :data:`BATCH_BYTES`,
while a helper thread measures the previous batch: it cuts the values into cache-sized chunks
and spreads them over a pool of worker threads, one per core. Memory: at most two batches, plus
a few MiB of float64 buffers per worker. ``progress(done_bytes, total_bytes, phase)`` is called
on the calling thread; raising from it (or Ctrl-C) cancels: the work in flight stops at the next
chunk and the exception propagates, nothing kept.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as StillRunning
from typing import Any, TypeVar

import torch

from jupyter_metainit.core import Recycler, progress_callback
from jupyter_metainit.inspection.moments import CHUNK_ELEMENTS

__all__ = ["BATCH_BYTES", "Chunks", "Progress", "batches", "run_batches"]

T = TypeVar("T")

# A batch is computed in one replay: its random fills run as one stream cut across the cores
# (the core does that from about 8 M elements on). Two batches are alive at most.
BATCH_BYTES = 64 << 20


def batches(items: Sequence[T], nbytes: Callable[[T], int]) -> list[list[T]]:
    """Consecutive items grouped into batches of at most ``max(largest, BATCH_BYTES)`` bytes."""
    budget = max([BATCH_BYTES] + [nbytes(x) for x in items])
    out: list[list[T]] = []
    size = budget
    for item in items:
        if size + nbytes(item) > budget:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes(item)
    return out


class Progress:
    """``progress=`` as ``save`` takes it: ``True`` for a bar, or ``callable(done_bytes,
    total_bytes)`` (or ``callable(done, total, phase)``); raising from it cancels."""

    def __init__(self, progress: Any, total: int, desc: str) -> None:
        self.total = total
        self.done = 0  # bytes of the batches measured
        self.partial = 0  # bytes of chunks measured in the batch in flight
        self._lock = threading.Lock()
        self._callback, self._bar = progress_callback(progress, desc=desc)

    def add_partial(self, nbytes: int) -> None:
        with self._lock:
            self.partial += nbytes

    def batch_done(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self.partial = 0

    def report(self, phase: str = "") -> None:
        if self._callback is not None:
            self._callback(min(self.done + self.partial, self.total), self.total, phase)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_pool: ThreadPoolExecutor | None = None
_runner: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def cores() -> int:
    """The cores this process may run on, at most ``torch.get_num_threads()``."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    return max(1, min(count, torch.get_num_threads()))


def _workers() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The measuring pool (one thread per core) and the batch thread, kept for the process.

    Each worker runs torch on one thread (its chunks are the parallelism: a torch op from each
    of N threads would otherwise start N OpenMP teams of N, which oversubscribe the cores and
    spin between chunks). A thread takes torch's process-wide count on its first torch call
    that asks for it, so each worker asks (``get_num_threads``) before it sets its own to 1;
    ``set_num_threads`` also sets that process-wide count, so it is set back once every worker
    has its own."""
    global _pool, _runner
    with _pool_lock:
        n = cores()
        if _pool is None or _pool._max_workers < n:
            before = torch.get_num_threads()
            barrier = threading.Barrier(n + 1)

            def one_thread() -> None:
                torch.get_num_threads()  # the thread's count taken from the process's now
                torch.set_num_threads(1)  # then its own: 1
                barrier.wait()

            _pool = ThreadPoolExecutor(n, thread_name_prefix="jmi-inspect")
            started = [_pool.submit(one_thread) for _ in range(n)]
            barrier.wait()
            for f in started:
                f.result()
            torch.set_num_threads(before)
        if _runner is None:
            _runner = ThreadPoolExecutor(1, thread_name_prefix="jmi-inspect-batch")
        return _pool, _runner


class Chunks:
    """Runs a function over the chunks of a batch's tensors on the worker pool; stops early
    (returning None for the chunks not run) once ``stop`` is set."""

    def __init__(self, stop: threading.Event, progress: Progress) -> None:
        self.stop = stop
        self.progress = progress
        self.pool = _workers()[0]

    def map(
        self, fn: Callable[..., T], flats: Sequence[Sequence[torch.Tensor]], count: bool = True
    ) -> list[list[T]] | None:
        """``fn(j, *chunk)`` for every chunk of every item ``j`` (``flats[j]``: 1-D tensors of
        equal length, cut together), grouped per item, in order; None once cancelled."""
        jobs = []
        for j, group in enumerate(flats):
            n = group[0].numel() if group else 0
            for a in range(0, max(n, 1), CHUNK_ELEMENTS):
                jobs.append((j, [t[a : a + CHUNK_ELEMENTS] for t in group]))

        def run(job: tuple[int, list[torch.Tensor]]) -> Any:
            if self.stop.is_set():
                return None
            result = fn(job[0], *job[1])
            if count:
                self.progress.add_partial(sum(t.nbytes for t in job[1]))
            return result

        out: list[list[T]] = [[] for _ in flats]
        for (j, _), result in zip(jobs, self.pool.map(run, jobs), strict=True):
            out[j].append(result)
        return None if self.stop.is_set() else out


def run_batches(
    groups: list[list[T]],
    read: Callable[[list[T], Recycler], list[Any]],
    measure: Callable[[list[T], list[Any], Chunks], Any],
    nbytes: Callable[[T], int],
    progress: Progress,
) -> list[Any]:
    """``measure(batch, read(batch, memory), chunks)`` for each batch, in order: each read on
    this thread while the previous batch is measured on the batch thread. Returns the measures.
    ``read`` returns a list of tensors (or of tuples of them: a pair's two values)."""
    _, runner = _workers()
    stop = threading.Event()
    chunks = Chunks(stop, progress)
    recycler = Recycler()
    pending: deque[tuple[int, Future, list[Any]]] = deque()
    results: list[Any] = []

    def collect() -> None:
        size, future, values = pending[0]
        while True:
            progress.report("measuring")
            try:
                results.append(future.result(timeout=0.1))
                break
            except StillRunning:
                continue
        pending.popleft()
        recycler.give_back(_tensors(values))
        progress.batch_done(size)

    try:
        for batch in groups:
            while len(pending) >= 2:
                collect()
            progress.report("reading")
            recycler.start_batch(nbytes(x) for x in batch)
            values = read(batch, recycler)
            recycler.settle(_tensors(values))
            pending.append(
                (
                    sum(nbytes(x) for x in batch),
                    runner.submit(measure, batch, values, chunks),
                    values,
                )
            )
        while pending:
            collect()
        progress.report()
    except BaseException:
        stop.set()
        for _, future, _ in pending:
            _wait_quietly(future)
        raise
    return results


def _tensors(values: list[Any]) -> list[torch.Tensor]:
    out = []
    for v in values:
        out.extend(v if isinstance(v, tuple) else [v])
    return [t for t in out if isinstance(t, torch.Tensor)]


def _wait_quietly(future: Future) -> None:
    """Let a cancelled batch's measuring end (its chunks return at once) before raising."""
    with contextlib.suppress(BaseException):  # the first failure is the one that propagates
        future.result()
