"""Which file is this memory? The file region a memory-mapped storage shows.

Checkpoint readers hand PyTorch memory-mapped bytes (see ``record/files``); inside ``meta_init``
the memory's address is looked up in the process's mappings (``/proc/self/maps``, read again
only when an address is not in the cached copy or its mapping is gone), which give the file and
the offset, and the file's identity (``FileRef``) is taken once per file version.

A cached mapping is checked to be still there, of the same file (``/proc/self/map_files``),
unless the storage last found in it is still held here: ``file_region`` keeps the storage it
was given (a view of the reader's mapping, which keeps that mapping in place) until the next
one in another mapping, or the end of the outermost ``meta_init`` block (:func:`release_held`).
While it is held, the mapping cannot go away nor its addresses be taken by another file, so the
other tensors of a checkpoint file skip that check (a dozen microseconds each).
"""

from __future__ import annotations

import bisect
import os
import threading
from typing import Any, NamedTuple

import torch

from jupyter_metainit.core.record.files import FileRef, FileRegion, header_digest
from jupyter_metainit.core.record.state import tls

__all__ = ["file_region", "release_held", "storage_region"]


class _Mapping(NamedTuple):
    start: int
    end: int
    offset: int
    inode: int
    path: str


# The lines of ``/proc/self/maps`` that name a file, in address order, and their start
# addresses: a line is parsed when an address falls in it (a process has hundreds of mappings,
# and the file is read again for each new checkpoint file mapped).
_lines: list[str] = []
_starts: list[int] = []
_parsed: dict[int, _Mapping | None] = {}
_refs: dict[tuple[str, int, int, int], FileRef] = {}
_lock = threading.Lock()


def _read_maps() -> None:
    global _lines, _starts, _parsed
    try:
        with open("/proc/self/maps") as f:
            text = f.read()
    except OSError:  # no /proc: no file-backed recording, tensors are copied instead
        text = ""
    lines = [line for line in text.splitlines() if " /" in line]  # not anonymous memory
    starts = [int(line[: line.index("-")], 16) for line in lines]
    if starts != sorted(starts):  # the kernel lists them in address order
        order = sorted(range(len(lines)), key=starts.__getitem__)
        lines, starts = [lines[i] for i in order], [starts[i] for i in order]
    _lines, _starts, _parsed = lines, starts, {}


def _parse(line: str) -> _Mapping | None:
    """The mapping a line describes, or None if it is not of a file that is still there."""
    parts = line.split(maxsplit=5)
    if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
        return None
    lo, _, hi = parts[0].partition("-")
    return _Mapping(int(lo, 16), int(hi, 16), int(parts[2], 16), int(parts[4]), parts[5])


def _lookup(address: int) -> _Mapping | None:
    i = bisect.bisect_right(_starts, address) - 1
    if i < 0:
        return None
    if i not in _parsed:
        _parsed[i] = _parse(_lines[i])
    mapping = _parsed[i]
    if mapping is not None and mapping.start <= address < mapping.end:
        return mapping
    return None


# (storage, the mapping it lies in): a storage over the mapping, held so that the mapping stays
_held: tuple[Any, _Mapping] | None = None


def release_held() -> None:
    """Let the held storage go (the outermost ``meta_init`` block ends): its mapping may go too,
    so the next look checks it again."""
    global _held
    with _lock:
        _held = None


def _still_mapped(mapping: _Mapping) -> bool:
    """Is this cached mapping still there, of the same file? (A file closed and another one
    opened can be mapped at the very same addresses.) Yes without asking while a storage in it
    is held (see the module's docstring)."""
    held = _held
    if held is not None and held[1] == mapping:
        return True
    try:
        st = os.stat(f"/proc/self/map_files/{mapping.start:x}-{mapping.end:x}")
    except OSError:
        return False  # gone, or map_files not readable here: look again
    return st.st_ino == mapping.inode


def _file_ref(path: str) -> FileRef | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    ref = _refs.get(key)
    if ref is None:
        header = header_digest(path)
        ref = FileRef(path, st.st_size, st.st_mtime_ns, st.st_ino, header, st.st_ctime_ns)
        _refs[key] = ref
    return ref


def file_region(address: int, nbytes: int, owner: Any = None) -> FileRegion | None:
    """The file region mapped at ``address`` (``nbytes`` long), if the memory is a file.
    ``owner``: the storage over that memory, held while it is the last one found (see the
    module's docstring)."""
    global _held
    if nbytes <= 0 or address == 0:
        return None
    with _lock:
        mapping = _lookup(address)
        if mapping is None or address + nbytes > mapping.end or not _still_mapped(mapping):
            _read_maps()  # mappings changed since the last look
            mapping = _lookup(address)
        if mapping is None or address + nbytes > mapping.end:
            return None
        if owner is not None and tls.depth > 0:  # released when the outermost block ends
            _held = (owner, mapping)
        ref = _file_ref(mapping.path)
    if ref is None or ref.inode != mapping.inode:
        return None
    offset = mapping.offset + address - mapping.start
    if offset + nbytes > ref.size:
        return None
    return FileRegion(ref, offset, nbytes)


def storage_region(data: Any) -> FileRegion | None:
    """The file region holding ``data`` (an ``UntypedStorage`` or a CPU tensor's whole
    storage), if it is memory-mapped from a file."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or data.layout != torch.strided:
            return None
        data = data.untyped_storage()
    if not isinstance(data, torch.UntypedStorage) or data.device.type != "cpu":
        return None
    return file_region(data.data_ptr(), data.nbytes(), data)
