"""Giving the memory of freed tensors back to the OS, as eager code's memory goes back.

Why: glibc serves a freed allocation's memory to later ones but returns it to the OS only from
the top of a heap (or, above its mmap threshold, at once). That threshold starts at 128 KiB and
rises to the size of the largest block freed so far (up to 32 MiB), so after the first model is
freed a model's tensors come from the heaps; and the replay runs on the pool's threads
(``runtime.pool``), whose allocations go to heaps of their own that small live blocks (a thread's
cached ones, the next build's records) keep from shrinking. Building, materializing and
deleting a model again and again, as a notebook re-runs a cell, then kept about one model's
memory resident that eager construction gives back (measured in
``benchmarks/bench_memory_cycles.py``). glibc's ``malloc_trim`` returns every free page of every
heap; this module calls it when enough of the memory ``materialize`` made has been freed.

:func:`return_when_freed` watches the CPU storages a materialize made (a weak reference to
each, so nothing here keeps one alive); each one freed counts, and once ``RETURN_EVERY`` bytes
of them are free the heaps are trimmed (a few milliseconds for 16 MiB, about what unmapping it
costs eager code). :func:`return_freed_memory` trims what is counted and not yet returned (the
last storages of a model), which ``materialize`` does first. Nothing happens where the C
library has no ``malloc_trim`` (macOS, musl): their allocators return memory themselves.
"""

from __future__ import annotations

import _thread
import ctypes
import functools
import threading
import weakref
from collections.abc import Callable, Iterable

import torch

from jupyter_metainit.core.runtime.interrupts import protect

__all__ = ["RETURN_EVERY", "return_freed_memory", "return_when_freed", "unreturned_bytes"]

# glibc gives an allocation at least this large (its mmap threshold's ceiling) an mmap of its
# own, unmapped as soon as it is freed: nothing to watch.
_MAPPED_ALONE = 32 << 20

# Trim once this much watched memory has been freed since the last trim: what a model's delete
# may leave resident before it is returned, and few enough trims to cost nothing noticeable.
RETURN_EVERY = 16 << 20

_lock = threading.RLock()  # reentrant: a garbage collection inside it may free a storage
_freed = 0  # bytes of watched storages freed since the last trim
# id of a storage object -> (weak reference to it, its bytes)
_watched: dict[int, tuple[weakref.ref, int]] = {}
_trim: Callable[[int], int] | None = None
_trim_looked_up = False


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    global _trim, _trim_looked_up
    if not _trim_looked_up:
        try:
            function = ctypes.CDLL(None).malloc_trim
            function.argtypes = [ctypes.c_size_t]
            function.restype = ctypes.c_int
            _trim = function
        except (OSError, AttributeError, TypeError):  # no such symbol; Windows: no CDLL(None)
            _trim = None
        _trim_looked_up = True
    return _trim


def unreturned_bytes() -> int:
    """Bytes of watched storages freed since the heaps were last trimmed."""
    return _freed


def return_freed_memory(at_least: int = 1) -> bool:
    """Give the heaps' free pages back to the OS if at least ``at_least`` bytes of the storages
    :func:`return_when_freed` watches were freed since the last time; returns whether it did.

    Use it where a long-lived process has just let go of models made by ``materialize`` (it
    runs by itself once ``RETURN_EVERY`` bytes of them are free, and at each ``materialize``).
    """
    global _freed
    with _lock:
        if _freed < at_least:
            return False
        _freed = 0
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # 0: keep no padding at the top of the main heap
    return True


def _storage_freed(key: int, ref: weakref.ref) -> None:
    global _freed
    try:
        with _lock:
            entry = _watched.get(key)
            if entry is None or entry[0] is not ref:
                return
            del _watched[key]
        # This storage's memory is released right after this call, the ones counted before it
        # already are: trim for those, and count this one for the next time.
        return_freed_memory(RETURN_EVERY)
        with _lock:
            _freed += entry[1]
    except KeyboardInterrupt:
        # A weak reference's callback cannot raise: Python would print the Ctrl-C and drop it.
        # Delivered again, it lands in the code that freed the storage, once this returns.
        _thread.interrupt_main()
    except Exception:  # a failed trim must never break the free that called it
        pass


def return_when_freed(tensors: Iterable[torch.Tensor]) -> None:
    """Count the CPU memory of ``tensors`` (what a materialize just made) when it is freed, so
    that it goes back to the OS (see the module docstring). Tensors without a storage of their
    own (sparse, wrapper subclasses) and memory glibc maps alone are skipped."""
    if _malloc_trim() is None:
        return
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided:
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        nbytes = storage.nbytes()
        if not 0 < nbytes < _MAPPED_ALONE:
            continue
        key = id(storage)
        with _lock:
            entry = _watched.get(key)
            if entry is not None and entry[0]() is storage:
                continue
            ref = weakref.ref(storage, functools.partial(_storage_freed, key))
            _watched[key] = (ref, nbytes)


# While a materialization routes Ctrl-C (``interrupts``), it waits until these return.
protect(_storage_freed, return_freed_memory)
