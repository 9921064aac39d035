"""Write the files with ``O_DIRECT`` (Linux): the disk reads the values from their memory.

Writing through the page cache costs about as much CPU as generating the values (allocating
and zeroing pages, copying into them, writing them back later), on the same cores. An
``O_DIRECT`` write costs almost none: the device copies from the buffer. It needs the file
offset, the length and the buffer's address aligned to the block (``ALIGN``), and safetensors
puts tensors at 8-byte offsets, in an order (by dtype, then name) that is not the order they
are computed in. So each value is computed into memory whose address is congruent to its file
offset modulo ``ALIGN`` (the replay's ``memory``): its whole blocks are written straight from
it, and the few bytes at its ends that share a block with a neighbour (or the header) are
copied into that block's buffer, written once all of it is known. The file's last block is
written whole and the file then cut to its size. Values that land elsewhere (a real tensor, a
cast) go through an aligned copy.

Durability: the data is on the device when the save returns (not fsynced: neither is the
``pwrite`` path, nor the benchmark's write floor).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import sys
import threading
from collections.abc import Sequence

import numpy
import torch

from jupyter_metainit.core import copy_in_steps
from jupyter_metainit.saving.safetensors_file import FileEntry

__all__ = ["ALIGN", "DirectFile", "DirectWriter", "Regions", "arena_bytes", "can_write_direct"]

ALIGN = 4096  # the largest logical block size in common use: valid for 512-byte devices too
_SLAB = 256 * ALIGN


def can_write_direct() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "O_DIRECT")


def _aligned(nbytes: int) -> mmap.mmap:
    """Private anonymous memory: page-aligned, so ``ALIGN``-aligned. Private, not Python's
    default shared mapping: shared anonymous pages live in shmem, whose first touch costs
    more. (Huge pages were slower still to touch first on the VMs measured: not asked for.)"""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | _ANONYMOUS)


_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0)  # CPython adds it for fileno -1 anyway


class DirectFile:
    """One output file opened with ``O_DIRECT``; :meth:`add` turns bytes placed at an offset
    into aligned writes (``(fd, offset, buffer)`` jobs)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        self._buffered: int | None = None  # the page-cache descriptor, once O_DIRECT refused
        self._blocks: dict[int, list] = {}  # block -> [buffer, bytes still missing]
        self._slab: tuple[mmap.mmap, int] | None = None  # block buffers are cut from it

    @classmethod
    def open(cls, path: str, size: int) -> DirectFile | None:
        """None where the file system refuses ``O_DIRECT`` (tmpfs, some network ones), or
        refuses writes of ``ALIGN`` bytes with it (a device with larger logical blocks): one
        block of zeros is written at the start first, before any other write is queued (the
        header's block overwrites it later)."""
        try:
            one = cls(path, size)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise
        try:
            os.pwrite(one.fd, memoryview(_aligned(ALIGN)), 0)
        except OSError as exc:
            one.close()
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise
        return one

    def write(self, offset: int, data: memoryview) -> None:
        """Write all of ``data`` (aligned) at ``offset``. Where ``O_DIRECT`` refuses a write
        in the middle of the file (EINVAL: the file system cut it short at the largest file it
        allows, leaving an unaligned length, or will not take it unbuffered), this and the
        file's later writes go through the page cache: the bytes are the same, and a size
        limit then fails as such (EFBIG)."""
        done = 0
        while done < len(data):
            fd = self.fd if self._buffered is None else self._buffered
            try:
                done += os.pwrite(fd, data[done:], offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._buffered is not None:
                    raise
                self._buffered = os.open(self.path, os.O_WRONLY)

    def add(self, offset: int, data: memoryview, jobs: list) -> None:
        """Queue the writes of ``data`` (bytes, format ``B``) placed at ``offset``: its whole
        blocks from its own memory where aligned (else from an aligned copy), its ends into
        their blocks' buffers, each block's write queued once it is complete (a job is
        ``(self, offset, buffer)``: :meth:`write` runs it)."""
        end = offset + len(data)
        first = min(-(-offset // ALIGN) * ALIGN, end)
        last = max(end // ALIGN * ALIGN, first)
        if last > first:
            inner = data[first - offset : last - offset]
            if _address_of(inner) % ALIGN:
                copy = _aligned(len(inner))
                _copy_into(copy, inner)
                inner = memoryview(copy)
            jobs.append((self, first, inner))
        for a, b in ((offset, first), (last, end)):
            while a < b:
                block = a // ALIGN
                stop = min(b, (block + 1) * ALIGN)
                self._put(block, a - block * ALIGN, data[a - offset : stop - offset], jobs)
                a = stop

    def _put(self, block: int, at: int, data: memoryview, jobs: list) -> None:
        pending = self._blocks.get(block)
        if pending is None:
            start = block * ALIGN
            missing = min(self.size, start + ALIGN) - start
            pending = self._blocks[block] = [self._block_buffer(), missing]
        pending[0][at : at + len(data)] = data
        pending[1] -= len(data)
        if pending[1] == 0:
            del self._blocks[block]
            jobs.append((self, block * ALIGN, pending[0]))

    def _block_buffer(self) -> memoryview:
        """An aligned block's buffer, cut from a slab of 256 (one mapping per block could run
        out of mappings on a model of many small tensors)."""
        if self._slab is None or self._slab[1] == _SLAB:
            self._slab = (_aligned(_SLAB), 0)
        slab, used = self._slab
        self._slab = (slab, used + ALIGN)
        return memoryview(slab)[used : used + ALIGN]

    def finish(self) -> None:
        """Cut the file to its size (its last block was written whole)."""
        if self._blocks:
            raise RuntimeError(f"internal error: {self.path} has bytes never written")
        os.ftruncate(self.fd, self.size)

    def close(self) -> None:
        os.close(self.fd)
        if self._buffered is not None:
            os.close(self._buffered)


def _copy_into(buffer: mmap.mmap, data: memoryview) -> None:
    """``buffer[:] = data``; a large one by torch, in steps: without holding the GIL for a
    second, and a Cancel may stop it between two (``copy_in_steps``)."""
    if data.readonly or len(data) <= ALIGN:
        buffer[:] = data
        return
    into = torch.frombuffer(buffer, dtype=torch.uint8)
    copy_in_steps(into, torch.frombuffer(data, dtype=torch.uint8), counted=False)


def _address_of(view: memoryview) -> int:
    return int(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data) if len(view) else 0


def arena_bytes(entries: Sequence[FileEntry]) -> int:
    """The arena bytes a batch of ``entries`` needs: each starts up to ``ALIGN`` - 1 bytes on."""
    return sum(entry.nbytes for entry in entries) + ALIGN * len(entries)


class Regions:
    """The replay's ``memory`` for the direct path: the storage for a batch's tensor starts at
    an address congruent to its file offset modulo ``ALIGN``, carved out of one of two arenas of
    anonymous memory used by turns (batch ``k`` in arena ``k % 2``: the one of batch ``k - 2``,
    written by then), so after the first two batches no page is touched for the first time.
    Each arena is made ``capacity`` bytes (the largest batch's :func:`arena_bytes`) at once: an
    arena made anew for a larger batch costs its unmapping and a new first touch of every page.
    A request is given the place of the next tensor of that size in the batch (the model's
    order: the order the replay allocates them, usually); others get new memory."""

    def __init__(self, capacity: int = 0) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._arenas: list[mmap.mmap | None] = [None, None]
        self._turn = 0
        self._want: dict[int, list[tuple[mmap.mmap, int]]] = {}  # nbytes -> places, next last

    def start_batch(self, placed: Sequence[tuple[int, FileEntry]]) -> None:
        """Expect a batch of ``(file offset, entry)``: lay its places out in the next arena
        (made larger where it is too small)."""
        need = arena_bytes([entry for _, entry in placed])
        arena = self._arenas[self._turn]
        if arena is None or len(arena) < need:
            self._arenas[self._turn] = None  # a tensor still being written keeps it alive
            arena = self._arenas[self._turn] = _aligned(max(need, self._capacity))
        self._turn = 1 - self._turn
        want: dict[int, list[tuple[mmap.mmap, int]]] = {}
        at = 0
        for offset, entry in placed:
            at += (offset - at) % ALIGN
            want.setdefault(entry.nbytes, []).append((arena, at))
            at += entry.nbytes
        with self._lock:
            self._want = {n: places[::-1] for n, places in want.items() if n}

    def __call__(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            places = self._want.get(nbytes)
            place = places.pop() if places else None
        if place is None:
            return torch.UntypedStorage(nbytes)
        arena, at = place
        return torch.frombuffer(arena, dtype=torch.uint8, count=nbytes, offset=at).untyped_storage()


class DirectWriter(threading.Thread):
    """Runs the queued ``(DirectFile, offset, buffer)`` writes (a buffer keeps its memory
    alive); a ``(None, nbytes, None)`` job ends a batch: its tensor bytes count as written, its
    slot (and so its arena in :class:`Regions`) is free."""

    def __init__(self, slots: threading.Semaphore) -> None:
        super().__init__(name="jupyter_metainit.save direct writer", daemon=True)
        self.jobs: queue.Queue = queue.Queue()
        self.slots = slots
        self.written = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            target, offset, payload = job
            del job
            if target is None:  # end of a batch, all written now
                self.written += offset
                self.slots.release()
                continue
            try:
                if self.error is None and not self.stop.is_set():
                    target.write(offset, payload)
            except BaseException as exc:  # handed to the producer thread
                self.error = exc
            del payload
