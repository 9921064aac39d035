"""How much memory is left, and whether an exception says it ran out: the one reader of each.

``materialize`` words its out-of-memory error with them, ``fits`` budgets with them and the
widget tells the user; all read ``/proc/meminfo`` and recognise out-of-memory errors here.
"""

from __future__ import annotations

import os

import torch

__all__ = ["available_memory", "free_memory", "is_out_of_memory"]


def available_memory() -> int | None:
    """The host's available memory in bytes (``MemAvailable`` of ``/proc/meminfo``), or None
    where it cannot be read (no ``/proc``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def free_memory(device: torch.device) -> int | None:
    """Memory this process can still get on ``device``: CUDA's free memory, or for the CPU the
    least of the host's available memory, the address-space limit (``ulimit -v``) and the
    cgroup's limit. None when nothing can be read."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
    except Exception:
        return None
    host = available_memory()
    candidates = [] if host is None else [host]
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            candidates.append(max(0, limit - used))
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                candidates.append(max(0, int(cap) - int(f.read())))
    except (OSError, ValueError, ImportError):
        pass
    return min(candidates) if candidates else None


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says a device or the host ran out of memory (``torch.OutOfMemoryError``,
    ``MemoryError``, or a ``RuntimeError`` from an allocator that says so)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )
