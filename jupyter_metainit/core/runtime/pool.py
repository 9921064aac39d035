"""The process's one thread pool (:func:`core_pool`) and one core counter (:func:`available_cores`).

Use these for any work spread over the cores (chunks of one random fill, parts of a replay,
digests, file reads): a pool per call would cost every new thread a glibc malloc arena (64 MiB of
address space), and ``os.cpu_count()`` ignores ``taskset`` and cgroup CPU sets. A task already on
a pool thread must not wait for tasks it queues on the same pool (they could wait behind it
forever): :func:`on_core_pool` says when to run inline instead, and :func:`available_cores` is 1
there.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from jupyter_metainit.core.errors import ArgumentError

__all__ = ["CORES_VARIABLE", "available_cores", "core_pool", "on_core_pool"]

# The documented switch for the number of threads the package's work uses (docs/performance.md,
# "How many cores"): set, it replaces the count of this process's cores; a pool thread still
# counts 1. For a process that shares its machine, and for the tests that need a given number.
CORES_VARIABLE = "JUPYTER_METAINIT_CORES"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class _PoolThread(threading.local):
    inside = False


_pool_thread = _PoolThread()


def _mark_pool_thread() -> None:
    _pool_thread.inside = True


def on_core_pool() -> bool:
    """Whether this thread is one of :func:`core_pool`'s (work it submits there could wait
    behind itself)."""
    return _pool_thread.inside


def available_cores() -> int:
    """Threads a job may use: the cores this process may run on (``taskset`` and cgroup CPU
    sets respected), at most ``torch.get_num_threads()`` (one rank of several per machine sets
    it lower); 1 on a thread of :func:`core_pool` itself (the cores are taken, and a task
    waiting for tasks queued behind it in the same pool would wait forever)."""
    if on_core_pool():
        return 1
    chosen = _chosen_cores()
    if chosen is not None:
        return chosen
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, torch.get_num_threads()))


def core_pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of at least ``workers`` threads for work on all cores (chunks of one
    fill, or parts of a replay). Kept for the process: every new thread costs glibc a malloc
    arena (64 MiB of address space), which a pool per call would add up."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="jmi-fill", initializer=_mark_pool_thread
            )
        return _pool


def _chosen_cores() -> int | None:
    """The core count :data:`CORES_VARIABLE` sets, if it is set (read at each call: cheap)."""
    text = os.environ.get(CORES_VARIABLE, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ArgumentError(
            f"{CORES_VARIABLE}={text!r}: give the number of threads to use, a whole number >= 1 "
            "(or unset it to use this process's cores)"
        )
    return int(text)
