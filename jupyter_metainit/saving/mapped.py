"""Generate the values straight into the files' pages (Linux): no copy, no writer thread.

Each file is given its final size with ``fallocate`` (the blocks are reserved now: a full disk
is an ``OSError`` here, never a ``SIGBUS`` on a page written later) and mapped ``MAP_SHARED``.
A batch's tensors are computed into storages that are their places in the mapped files (the
replay's ``memory``), so the values are in the page cache as soon as they are generated and
the kernel writes them back as it does ``pwrite``'s pages (neither fsyncs). Writing through
``pwrite`` instead costs a copy in the kernel on top of the page-cache work, on the same cores
as generation; here the only extra cost is the page faults of first touch.

Mapped pages count in the process's RSS (as file pages, ``RssFile``) while mapped: once a
batch is final its pages are unmapped (``MADV_DONTNEED``; on a shared file mapping that drops
the page-table entries only, dirty pages stay in the page cache and are written back), so at
most one batch's pages are resident: the largest tensor, or 64 MiB.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable

import torch

from jupyter_metainit.core import copy_in_steps
from jupyter_metainit.saving.safetensors_file import FileEntry

__all__ = ["MappedFile", "can_map", "place_batch"]

Placed = tuple["MappedFile", int, FileEntry]  # file, offset of the tensor's bytes, entry


def can_map() -> bool:
    """Whether this platform gets the mapped path (Linux: ``fallocate`` and ``madvise``)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")


def _fallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes of blocks for ``fd`` (and make it that long); False where the
    file system cannot (then the caller writes with ``pwrite``); raises ``OSError`` else."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "fallocate"):
        return False
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, f"cannot reserve {size} bytes for the file: {os.strerror(err)}")


class MappedFile:
    """One output file, of its final size, mapped shared and writable. The mapping lives as
    long as a tensor made on it does (``torch.frombuffer`` holds a reference): it is never
    closed under a tensor that could still be read."""

    def __init__(self, mapping: mmap.mmap, size: int) -> None:
        self.mapping = mapping
        self.size = size
        self.base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()

    @classmethod
    def create(cls, path: str, header: bytes, size: int) -> MappedFile | None:
        """``path`` made ``size`` bytes long with ``header`` at its start, mapped; None where
        its file system cannot reserve the blocks (the caller falls back to ``pwrite``)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _fallocate(fd, size):
                return None
            done = 0
            while done < len(header):
                done += os.pwrite(fd, memoryview(header)[done:], done)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        return cls(mapping, size)

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """The file's bytes ``[offset, offset + nbytes)`` as a storage (no copy)."""
        return torch.frombuffer(
            self.mapping, dtype=torch.uint8, count=nbytes, offset=offset
        ).untyped_storage()

    def contains(self, ptr: int) -> bool:
        return self.base <= ptr < self.base + self.size

    def release(self, start: int, end: int) -> None:
        """Unmap the pages of ``[start, end)`` from this process (rounded out to pages: the
        page cache keeps every byte, a later touch maps it again)."""
        first = start - start % mmap.PAGESIZE
        if end > first:
            self.mapping.madvise(mmap.MADV_DONTNEED, first, min(end, self.size) - first)


class _Slots:
    """The replay's ``memory`` for one batch: a storage of ``nbytes`` is the place in its file
    of the next tensor of the batch of that size (model order, as the replay allocates them,
    usually); other requests (intermediates, more of a size) get new memory."""

    def __init__(self, batch: list[Placed]) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[Placed]] = {}
        for item in reversed(batch):
            if item[2].nbytes:
                self._free.setdefault(item[2].nbytes, []).append(item)

    def __call__(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            free = self._free.get(nbytes)
            item = free.pop() if free else None
        if item is None:
            return torch.UntypedStorage(nbytes)
        mapped, offset, _ = item
        return mapped.storage(offset, nbytes)


def place_batch(
    batch: list[Placed],
    values_of: Callable[..., list[torch.Tensor]],
    check: Callable[[FileEntry, torch.Tensor], None],
    report: Callable[[int], None],
) -> None:
    """Compute one batch into its places in the mapped files (``values_of(tensors_memory)``
    is ``cpu_values_of_batch`` with its tensors and dtype bound), copy the values that did not
    land in their own place (a real tensor, a cast, an unexpected allocation order), then
    unmap the batch's pages; ``report(nbytes)`` after each tensor (it may cancel)."""
    values = values_of(_Slots(batch))
    for (_, _, entry), value in zip(batch, values, strict=True):
        check(entry, value)
    files = {id(mapped): mapped for mapped, _, _ in batch}
    misplaced = [
        j
        for j, ((mapped, offset, _), value) in enumerate(zip(batch, values, strict=True))
        if value.numel() and value.data_ptr() != mapped.base + offset
    ]
    for j in misplaced:  # another tensor's place may be where this one's values are
        if any(f.contains(values[j].data_ptr()) for f in files.values()):
            values[j] = values[j].clone()
    for j, ((mapped, offset, entry), value) in enumerate(zip(batch, values, strict=True)):
        if j in misplaced:
            place = torch.frombuffer(
                mapped.mapping, dtype=torch.uint8, count=entry.nbytes, offset=offset
            )
            copy_in_steps(place, value.reshape(-1).view(torch.uint8), counted=False)
            del place
        report(entry.nbytes)
    del values
    for mapped in files.values():
        spans = [(offset, offset + entry.nbytes) for f, offset, entry in batch if f is mapped]
        mapped.release(min(a for a, _ in spans), max(b for _, b in spans))
