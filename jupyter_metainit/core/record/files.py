"""Reading a tensor from a file as a recorded operation: "these bytes of this file".

Checkpoint readers hand PyTorch memory-mapped bytes: ``safetensors`` passes an ``UntypedStorage``
over its mapping of the file to ``torch.asarray``, ``torch.load(mmap=True)`` rebuilds tensors with
``set_`` on storages of ``UntypedStorage.from_file``. Inside ``meta_init`` those calls are
intercepted (``torch_functions.data_factory``, ``dispatch``): the memory's address is looked
up in the process's mappings (``/proc/self/maps``, see ``dispatch/file_memory``), which give the
file and the offset, and the tensor becomes deferred, its recording one :func:`read_file_bytes` op.
Replaying it maps those bytes privately (whole tensors of at least ``MAP_FROM`` bytes) or reads them
with ``pread``, after checking that the file is still the one that was recorded (size, modification
and change times, inode, header). The change time (ctime) catches rewrites that restore the
modification time (``cp -p``, ``rsync -t``, ``os.utime``): no user call can set it back. What is
read is also checked: a sum of the bytes' 64-bit words (computed by the reading threads) must equal
that of any earlier read of the same bytes of the same file version, which catches writes the
timestamps miss (through a shared mapping, within the clock's granularity) before the bytes are
used. A mapping of whole-tensor bytes is digested only when there is something to compare: it holds
no copy, its pages are the file's (as eager loading's mapping is), so a first or repeated opening
maps and checks the file's identity only. Freeing such a tensor (``dematerialize``) compares it with
a new read of the file, whose digest every later read of those bytes must match: bytes changed
between a free and the next materialize are refused. The header is read once per file in one
``materialize`` (:func:`one_header_check`); each read compares the metadata.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.runtime.pool import available_cores, core_pool

__all__ = [
    "FileRef",
    "FileRegion",
    "comparing_with_file",
    "header_digest",
    "one_header_check",
    "read_file_bytes",
]

_HEADER_BYTES = 64 << 10  # identity: a digest of the file's first bytes (safetensors' header)


@dataclass(frozen=True)
class FileRef:
    """A file as it was when a tensor was recorded from it."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    header: bytes
    ctime_ns: int = 0  # metadata or contents changed (os.utime cannot set it back)

    def check(self, header: bool = True) -> None:
        """Raise a clear error if the file is gone, unreadable or not the same any more
        (``header=False``: by its metadata only, which any write changes)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise MaterializationError(
                f"the checkpoint file {self.path} no longer exists; its tensors cannot be "
                "read. Put it back where it was, or open the model again from where it is now "
                "(e.g. re-run from_pretrained under meta_init). Nothing was changed."
            ) from None
        except PermissionError:
            raise MaterializationError(
                f"the checkpoint file {self.path} cannot be read (permission denied): give "
                "this process read access to it. Nothing was changed."
            ) from None
        identity = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        if identity != (self.size, self.mtime_ns, self.ctime_ns, self.inode):
            raise self.changed("size, modification or change time, or contents differ")
        if header and not _header_checked(self):
            if header_digest(self.path) != self.header:
                raise self.changed("size, modification or change time, or contents differ")
            _note_header_checked(self)

    def changed(self, how: str) -> MaterializationError:
        return MaterializationError(
            f"the checkpoint file {self.path} changed since the model was opened from it "
            f"({how}); open it again (e.g. re-run from_pretrained under meta_init). Nothing "
            "was changed."
        )


@dataclass(frozen=True)
class FileRegion:
    """``nbytes`` bytes at ``offset`` in ``file``."""

    file: FileRef
    offset: int
    nbytes: int


# Files whose header was compared in the current batch of reads (``one_header_check``): the
# other reads of the batch check their metadata only. None: outside a batch, every check reads.
_headers_checked: set[FileRef] | None = None
_lock = threading.Lock()
_batches = 0


def _header_checked(ref: FileRef) -> bool:
    checked = _headers_checked
    return checked is not None and ref in checked


def _note_header_checked(ref: FileRef) -> None:
    checked = _headers_checked
    if checked is not None:
        checked.add(ref)


@contextlib.contextmanager
def one_header_check() -> Iterator[None]:
    """Within the block (one ``materialize``), a file's header is read and compared once, by
    the first read of it; the other reads of that file compare its metadata (size, times,
    inode: what any write changes) before and after, and their bytes' digests where there is
    an earlier one. Reading the header again for each of a checkpoint's tensors cost more than
    mapping them. Nested blocks share the outermost one's record."""
    global _headers_checked, _batches
    with _lock:
        _batches += 1
        if _headers_checked is None:
            _headers_checked = set()
    try:
        yield
    finally:
        with _lock:
            _batches -= 1
            if _batches == 0:
                _headers_checked = None


def header_digest(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return hashlib.blake2b(f.read(_HEADER_BYTES), digest_size=16).digest()
    except PermissionError:
        raise MaterializationError(
            f"the checkpoint file {path} cannot be read (permission denied)"
        ) from None


# ---------------------------------------------------------------------------------------------
# replay


_CHUNK = 64 << 20


# Switch for benchmarks/bench_checkpoint.py, which measures what the content check costs.
CHECK_CONTENT = True
# (file version, offset, nbytes) -> digest of each chunk, from the first digested read of those
# bytes (None: mapped once, not digested yet)
_read_digests: dict[tuple[FileRef, int, int], tuple[int, ...] | None] = {}


_PIECE = 1 << 20  # digested right after it is read, while it is in the CPU's cache


def _read_into(fd: int, view: memoryview, offset: int, path: str) -> int:
    """Fill ``view`` from ``offset``; returns a digest of what was read (0 if not checked).

    With the check, it reads piece by piece and digests each piece right after reading it,
    while it is in the CPU's cache; pieces are fixed, so the digest does not depend on how the
    system split the reads.
    """
    step = _PIECE if CHECK_CONTENT else len(view)
    total = 0
    for start in range(0, len(view), step):
        piece = view[start : start + step]
        done = 0
        while done < len(piece):
            rest = piece[done:]
            if hasattr(os, "preadv"):
                n = os.preadv(fd, [rest], offset + start + done)
            else:  # no preadv (Windows, macOS before 11): read, then copy
                data = os.pread(fd, len(rest), offset + start + done)
                n = len(data)
                rest[:n] = data
            if n <= 0:
                raise MaterializationError(f"the checkpoint file {path} ended early (truncated?)")
            done += n
        if CHECK_CONTENT:
            total = _content_sum(piece, total, start // _PIECE)
    return total


def _content_sum(piece: memoryview, total: int, index: int) -> int:
    """``total`` with piece number ``index`` added: a cheap digest of the bytes, the wrapping
    sum of their 64-bit words times an odd number from the piece's position (so that moved
    pieces count too), and a CRC-32 of a last piece's odd tail. Any changed word changes it."""
    words = len(piece) // 8 * 8
    weight = 2 * index + 1
    if words:
        values = np.frombuffer(piece[:words], dtype=np.uint64)
        total += int(np.add.reduce(values, dtype=np.uint64)) * weight
    if words != len(piece):
        total += zlib.crc32(piece[words:]) * weight
    return total & _MASK


_MASK = (1 << 64) - 1


def read_file_bytes(region: FileRegion) -> torch.Tensor:
    """The region's bytes as a new CPU ``uint8`` tensor (the replay of a file read).

    Regions of at least ``MAP_FROM`` bytes are mapped privately (copy-on-write), as safetensors'
    own loading and eager ``from_pretrained`` do: no copy, and pages shared with the page cache;
    writing to the tensor changes only this process's copy of the page. Smaller ones are read.
    Large reads run in chunks on several threads (most of their time is the kernel faulting in
    the new memory). The file is checked before (identity) and after (identity again, and the
    bytes against any earlier read of them, digested from the mapping or as they are read; a
    first mapping of the bytes is not digested, see the module's docstring).
    """
    region.file.check()
    path = region.file.path
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise MaterializationError(
            f"cannot open the checkpoint file {path}: {e.strerror}"
        ) from None
    try:
        if region.nbytes >= MAP_FROM and hasattr(mmap, "MAP_PRIVATE"):
            digested = CHECK_CONTENT and _digest_mapping(region)
            out = _mapped(fd, region, read_ahead=digested)
            crcs = _in_chunks(region.nbytes, lambda i, n: _digest(out, i, n)) if digested else None
        else:
            out = torch.empty(region.nbytes, dtype=torch.uint8)
            view = memoryview(out.numpy())
            crcs = _in_chunks(
                region.nbytes,
                lambda i, n: _read_into(fd, view[i : i + n], region.offset + i, path),
            )
    finally:
        os.close(fd)
    if CHECK_CONTENT:
        _check_digests(region, crcs)
    return out


def _digest_mapping(region: FileRegion) -> bool:
    """Is a mapping of these bytes digested? Only to compare it with an earlier digest of them,
    or while a tensor being freed is compared with its file (:func:`comparing_with_file`): that
    digest is the one the bytes must match when the tensor comes back. Other mappings hold no
    copy, their pages are the file's (as eager loading's mapping is): nothing to differ from."""
    return (
        _comparing > 0 or _read_digests.get((region.file, region.offset, region.nbytes)) is not None
    )


_comparing = 0  # > 0 while freeing compares tensors with their files (under the core's lock)


@contextlib.contextmanager
def comparing_with_file() -> Iterator[None]:
    """Reads inside digest what they map: ``dematerialize`` compares a tensor read from a file
    with a new read of it, and that read's digest is what a later materialize must find."""
    global _comparing
    _comparing += 1
    try:
        yield
    finally:
        _comparing -= 1


MAP_FROM = 1 << 20  # smaller regions are read: one mapping each would add up (vm.max_map_count)


def _mapped(fd: int, region: FileRegion, read_ahead: bool) -> torch.Tensor:
    """A private, copy-on-write mapping of the region as a ``uint8`` tensor that keeps it
    (``read_ahead``: ask the kernel to read the file ahead, for a digest about to read it all;
    otherwise pages are read when first used, as eager loading's mapping is)."""
    start = region.offset - region.offset % mmap.ALLOCATIONGRANULARITY
    skip = region.offset - start
    memory = mmap.mmap(
        fd,
        skip + region.nbytes,
        flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=start,
    )
    if read_ahead and hasattr(memory, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        memory.madvise(mmap.MADV_WILLNEED)  # read ahead while the digest runs
    return torch.frombuffer(memory, dtype=torch.uint8, offset=skip, count=region.nbytes)


def _digest(data: torch.Tensor, start: int, nbytes: int) -> int:
    view = memoryview(data.numpy())[start : start + nbytes]
    total = 0
    for offset in range(0, nbytes, _PIECE):
        total = _content_sum(view[offset : offset + _PIECE], total, offset // _PIECE)
    return total


def _in_chunks(nbytes: int, job: Any) -> tuple[int, ...]:
    """``job(start, length)`` over ``_CHUNK``-sized chunks, on the core pool when there are
    several; the results in order."""
    starts = range(0, nbytes, _CHUNK)
    workers = min(len(starts), available_cores())
    if workers <= 1:  # one core, or on a pool thread already: inline
        return tuple(job(i, min(_CHUNK, nbytes - i)) for i in starts)
    pool = core_pool(workers)
    jobs = [pool.submit(job, i, min(_CHUNK, nbytes - i)) for i in starts]
    return tuple(j.result() for j in jobs)


def _check_digests(region: FileRegion, crcs: tuple[int, ...] | None) -> None:
    """The file's identity again, and ``crcs`` against an earlier read's (None: a first
    mapping, not digested; the next read's digest is the one to match)."""
    region.file.check(header=False)  # not changed while it was read
    key = (region.file, region.offset, region.nbytes)
    with _lock:
        earlier = _read_digests.get(key)
        if earlier is None:
            _read_digests[key] = earlier = crcs
        if len(_read_digests) > 1 << 17:  # bounded: forget, keep checking new reads
            _read_digests.clear()
    if crcs is not None and earlier != crcs:
        raise region.file.changed(
            "these bytes differ from an earlier read of them, though its times are the same"
        )


read_file_bytes.host_op = True  # type: ignore[attr-defined]  # runs on the CPU (see replay/run)
