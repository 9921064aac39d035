"""Generate and write, overlapped, in bounded memory; publish the files only when all are written.

The calling thread produces the values of a batch of consecutive tensors at a time (replay runs
on every core) while they are written. Three ways to write, the first the file system allows
(``WRITE_VARIABLE`` may start further down):
``O_DIRECT`` from the values' own memory (``saving.direct``: the device copies, almost no CPU; a
writer thread, two batches alive), the files mapped and the values generated into their pages
(``saving.mapped``: one batch's pages mapped at a time), or ``pwrite`` into the page cache from
recycled buffers (a writer thread, two batches alive). Memory: up to two batches, each up to the
largest tensor's bytes (or 64 MiB where all are smaller). The files are written into a
staging directory (``saving.staging``) and put in place at the end, so a failed or cancelled save
(an exception from the progress callback, Ctrl-C) leaves nothing where the checkpoint should be,
and the model is untouched (deferred tensors stay deferred). Nothing is fsynced.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core import progress_callback, telling
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.saving.direct import (
    DirectFile,
    DirectWriter,
    Regions,
    arena_bytes,
    can_write_direct,
)
from jupyter_metainit.saving.exact_values import Recycler, cpu_values_of_batch
from jupyter_metainit.saving.mapped import MappedFile, can_map, place_batch
from jupyter_metainit.saving.safetensors_file import FileEntry, file_order, header_bytes

__all__ = ["WRITE_VARIABLE", "Progress", "write_safetensors_files"]

# The documented switch for the first way to write (docs/saving.md): "direct" (the default),
# "mapped" or "pwrite"; each still falls back to the next where the file system refuses it. For
# a file system that takes O_DIRECT but is slow with it, and for the tests of each way.
WRITE_VARIABLE = "JUPYTER_METAINIT_SAVE_WRITE"
_WAYS = ("direct", "mapped", "pwrite")


def _first_way() -> str:
    """The way :data:`WRITE_VARIABLE` chooses ("direct" unset; read at each save: cheap)."""
    text = os.environ.get(WRITE_VARIABLE, "").strip()
    if not text:
        return "direct"
    if text not in _WAYS:
        raise ArgumentError(
            f"{WRITE_VARIABLE}={text!r}: give 'direct' (O_DIRECT, the default), 'mapped' (the "
            "files mapped, through the page cache) or 'pwrite' (or unset it)"
        )
    return text


class Progress:
    """``progress=`` as in ``materialize`` (the core's ``progress_callback``): ``True`` for a
    bar, or ``callable(done_bytes, total_bytes)`` (or ``callable(done, total, phase)``); raising
    from it cancels. ``total`` is the bytes of tensor data to write."""

    def __init__(self, progress: Any, total: int) -> None:
        self.total = total
        self.shown = 0  # never decreases (a batch's generation is told before its writes)
        self.begun = 0  # bytes of the batches whose generation has begun
        self._callback, self.bar = progress_callback(progress, desc="save")

    def report(self, done: int, phase: str = "") -> None:
        if self._callback is not None:
            self.shown = max(self.shown, min(done, self.total))
            self._callback(self.shown, self.total, phase)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Writer(threading.Thread):
    """Writes queued byte buffers to their files, in order; counts what it wrote. The last
    tensor of a batch gives its slot back (a header holds none)."""

    def __init__(self, slots: threading.Semaphore, recycler: Recycler) -> None:
        super().__init__(name="jupyter_metainit.save writer", daemon=True)
        self.jobs: queue.Queue = queue.Queue()
        self.slots = slots
        self.recycler = recycler
        self.batch: list[torch.Tensor] = []  # this batch's tensors written so far
        self.written = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fd, offset, payload, ends_batch = job
            del job
            try:
                if payload is not None and self.error is None and not self.stop.is_set():
                    self.written += _write_at(fd, offset, payload)
            except BaseException as exc:  # handed to the producer thread
                self.error = exc
            finally:
                if isinstance(payload, torch.Tensor):
                    self.batch.append(payload)
                del payload
                if ends_batch:  # its buffers go to the batch after next
                    self.recycler.give_back(self.batch)
                    self.batch.clear()
                    self.slots.release()


def _write_at(fd: int, offset: int, payload: Any) -> int:
    """Write ``payload`` (bytes, or a contiguous CPU tensor's memory, not copied) at ``offset``;
    returns the tensor bytes written (0 for a header)."""
    if isinstance(payload, bytes):
        data, counted = memoryview(payload), 0
    elif payload.numel() == 0:
        return 0
    else:
        data = memoryview(payload.reshape(-1).view(torch.uint8).numpy()).cast("B")
        counted = len(data)
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return counted


def write_safetensors_files(
    directory: str,
    files: dict[str, list[FileEntry]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    progress: Progress,
    aliases: dict[str, str] | None = None,
) -> None:
    """Write each file's header, then every tensor's bytes at its place in its file. Tensors
    are computed in the order of ``tensors`` (the model's order, close to the order they were
    made in), a batch of consecutive ones at a time: their fills are then one run of the random
    stream, cut across the cores with one jump-ahead per core, and the next batch continues
    where it ended, instead of jumping around the stream as the file order (by dtype, then
    name) would make them. The first way the file system allows (module docstring):
    ``O_DIRECT`` (``_write_direct``), the mapped files (``saving.mapped``), ``pwrite``
    (``_write_with_writer``). ``aliases`` (a dropped duplicate name -> the name written) go
    into the metadata of the file holding that name, as safetensors' ``save_model`` has them."""
    layout = {os.path.join(directory, name): file_order(entries) for name, entries in files.items()}
    headers = {
        path: header_bytes(ordered, _metadata(ordered, aliases or {}))
        for path, ordered in layout.items()
    }
    sizes = {
        path: len(headers[path]) + sum(entry.nbytes for entry in ordered)
        for path, ordered in layout.items()
    }
    # (file path, offset, entry) of each tensor to write, in the order of ``tensors``
    where: dict[str, tuple[str, int, FileEntry]] = {}
    for path, ordered in layout.items():
        offset = len(headers[path])
        for entry in ordered:
            where[entry.name] = (path, offset, entry)
            offset += entry.nbytes
    placed = [where[name] for name in tensors if name in where]
    first = _first_way()
    direct = first == "direct" and can_write_direct()
    if direct and _write_direct(headers, sizes, placed, tensors, dtype, progress):
        return
    mapped = _map_files(headers, sizes) if first != "pwrite" and can_map() else None
    if mapped is None:
        _write_with_writer(headers, placed, tensors, dtype, progress)
        return
    done = 0

    def report(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        progress.report(done, "generating")

    for batch in _batches([(mapped[path], offset, entry) for path, offset, entry in placed]):
        progress.report(done, "generating")
        ts = [tensors[entry.name] for _, _, entry in batch]
        values_of = functools.partial(cpu_values_of_batch, ts, dtype)  # (its memory)
        with _telling_generation(progress, batch, tensors):
            place_batch(batch, values_of, _check_geometry, report)
    progress.report(done)


def _write_direct(
    headers: dict[str, bytes],
    sizes: dict[str, int],
    placed: list[tuple[str, int, FileEntry]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    progress: Progress,
) -> bool:
    """The ``O_DIRECT`` path (``saving.direct``): a writer thread writes while the values are
    generated, at most two batches alive. False (nothing written) where the file system
    refuses ``O_DIRECT``."""
    opened: dict[str, DirectFile] = {}
    slots = threading.Semaphore(2)
    writer = DirectWriter(slots)
    try:
        for path, size in sizes.items():
            one = DirectFile.open(path, size)
            if one is None:
                return False
            opened[path] = one
        batches = _batches([(opened[path], offset, entry) for path, offset, entry in placed])
        regions = Regions(max((arena_bytes([e for *_, e in b]) for b in batches), default=0))
        writer.start()
        for path, header in headers.items():
            jobs: list = []
            opened[path].add(0, memoryview(header), jobs)
            for job in jobs:
                writer.jobs.put(job)
        for batch in batches:
            _wait_for_slot(slots, writer, progress)
            regions.start_batch([(offset, entry) for _, offset, entry in batch])
            _direct_batch(batch, tensors, dtype, regions, writer, progress)
        _drain(writer, progress)
        for one in opened.values():
            one.finish()
        progress.report(writer.written)
        return True
    finally:
        _stop(writer)
        for one in opened.values():
            one.close()


def _direct_batch(
    batch: list[tuple[DirectFile, int, FileEntry]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    regions: Regions,
    writer: DirectWriter,
    progress: Progress,
) -> None:
    """Compute one batch into ``regions`` and queue its writes as :func:`_stream_batch` hands
    them over (the last batch leaves little to write after it); then the batch's end."""
    lock = threading.Lock()  # the files' partly filled blocks, shared by the parts' threads

    def put(j: int, start: int, value: torch.Tensor) -> None:
        if not value.numel():
            return
        direct, offset, _ = batch[j]
        data = memoryview(value.reshape(-1).view(torch.uint8).numpy()).cast("B")
        jobs: list = []
        with lock:
            direct.add(offset + start, data, jobs)
        for job in jobs:
            writer.jobs.put(job)

    _stream_batch(batch, tensors, dtype, regions, put, lambda: writer.written, progress)
    writer.jobs.put((None, sum(entry.nbytes for *_, entry in batch), None))  # ends the batch


def _stream_batch(
    batch: list[tuple[Any, int, FileEntry]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    memory: Callable[[int], torch.UntypedStorage],
    put: Callable[[int, int, torch.Tensor], None],
    written: Callable[[], int],
    progress: Progress,
) -> list[torch.Tensor]:
    """Compute one batch into ``memory``, handing each value over to be written as
    ``put(j, start, values)`` (the bytes of tensor ``j`` from byte ``start`` on): each part of
    a fill as soon as it is final (from the replay's threads: the disk writes while the rest is
    generated), each other tensor whole once the batch is done and every value's geometry
    checked, reporting ``written()`` bytes after each (a progress callback may cancel there).
    Returns the values."""
    streamed: set[int] = set()

    def on_part(j: int, a: int, b: int, flat: torch.Tensor) -> None:
        streamed.add(j)
        put(j, a * flat.element_size(), flat[a:b])

    with _telling_generation(progress, batch, tensors, written):  # (casts, copies: in steps)
        values = cpu_values_of_batch([tensors[e.name] for *_, e in batch], dtype, memory, on_part)
        for (*_, entry), value in zip(batch, values, strict=True):
            _check_geometry(entry, value)
        for j, value in enumerate(values):
            if j not in streamed:
                put(j, 0, value)
            progress.report(written(), "generating")
    return values


def _telling_generation(
    progress: Progress,
    batch: list[tuple[Any, int, FileEntry]],
    tensors: dict[str, torch.Tensor],
    written: Callable[[], int] | None = None,
) -> Any:
    """While ``batch`` is generated (one large tensor takes seconds), progress told about every
    0.2 s (``telling``): the bytes its fills, then its casts to ``dtype``, have made, as a
    share of the batch's bytes, after the batches begun before it, or ``written()`` once that
    is more. A Cancel raised from it stops the fills (or casts) within a step."""
    size = sum(entry.nbytes for *_, entry in batch)
    made = 0  # the bytes its fills make, and its casts
    for *_, entry in batch:
        t = tensors[entry.name]
        made += t.numel() * t.element_size() + (entry.nbytes if entry.dtype != t.dtype else 0)
    start, progress.begun = progress.begun, progress.begun + size

    def tell(n: int) -> None:
        estimate = start + min(n * size // made, size) if made else start
        progress.report(max(estimate, written() if written is not None else 0), "generating")

    return telling(tell)


def _drain(writer: Any, progress: Progress) -> None:
    """Let the writer thread finish what is queued, reporting progress; raise its failure."""
    writer.jobs.put(None)
    while writer.is_alive():
        writer.join(0.1)
        progress.report(writer.written, "writing")
    if writer.error is not None:
        raise writer.error


def _stop(writer: Any) -> None:
    """End the writer thread without the rest of its queue (after a failure, or once drained)."""
    writer.stop.set()
    if writer.is_alive():
        writer.jobs.put(None)
        writer.join()


def _map_files(headers: dict[str, bytes], sizes: dict[str, int]) -> dict[str, MappedFile] | None:
    """Each file at its final size, header written, mapped; None where one cannot be."""
    mapped: dict[str, MappedFile] = {}
    for path, size in sizes.items():
        one = MappedFile.create(path, headers[path], size)
        if one is None:
            return None
        mapped[path] = one
    return mapped


def _write_with_writer(
    headers: dict[str, bytes],
    placed: list[tuple[str, int, FileEntry]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    progress: Progress,
) -> None:
    """The ``pwrite`` path: a writer thread writes a batch while the next is generated, at
    most two batches alive (``_batches``)."""
    slots = threading.Semaphore(2)
    recycler = Recycler()
    writer = _Writer(slots, recycler)
    writer.start()
    fds: dict[str, int] = {}
    try:
        for path, header in headers.items():
            fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            writer.jobs.put((fds[path], 0, header, False))
        for batch in _batches([(fds[path], offset, entry) for path, offset, entry in placed]):
            _wait_for_slot(slots, writer, progress)
            recycler.start_batch([entry.nbytes for _, _, entry in batch])
            _write_batch(batch, tensors, dtype, writer, recycler, progress)
        _drain(writer, progress)
        progress.report(writer.written)
    finally:
        _stop(writer)
        for fd in fds.values():
            os.close(fd)


def _write_batch(
    batch: list[tuple[int, int, FileEntry]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    writer: _Writer,
    recycler: Recycler,
    progress: Progress,
) -> None:
    """Compute one batch and queue its writes as :func:`_stream_batch` hands them over; the
    last job gives the batch's slot back."""

    def put(j: int, start: int, value: torch.Tensor) -> None:
        fd, offset, _ = batch[j]
        writer.jobs.put((fd, offset + start, value, False))

    values = _stream_batch(batch, tensors, dtype, recycler, put, lambda: writer.written, progress)
    recycler.settle(values)
    writer.jobs.put((-1, 0, None, True))


# A batch of consecutive tensors is generated at once (its fills cut across all cores, one
# jump-ahead per core): up to the largest tensor's bytes, or this much where all are smaller.
# Two batches are alive at most (one generated, one written): peak memory stays within
# 2 x the largest tensor + 2 x this.
BATCH_BYTES = 64 << 20


def _batches(placed: list[Any]) -> list[list[Any]]:
    """Consecutive tensors grouped into batches of at most ``max(largest, BATCH_BYTES)``."""
    budget = max([BATCH_BYTES] + [entry.nbytes for _, _, entry in placed])
    batches: list[list[tuple[int, int, FileEntry]]] = []
    size = 0
    for item in placed:
        if not batches or size + item[2].nbytes > budget:  # a first tensor may have no bytes
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item[2].nbytes
    return batches


def _metadata(ordered: list[FileEntry], aliases: dict[str, str]) -> dict[str, str]:
    names = {entry.name for entry in ordered}
    return {"format": "pt", **{k: v for k, v in aliases.items() if v in names}}


def _wait_for_slot(slots: threading.Semaphore, writer: _Writer, progress: Progress) -> None:
    """Block until fewer than two tensors are alive, reporting progress (which may cancel)."""
    while True:
        if writer.error is not None:
            raise writer.error
        progress.report(writer.written, "generating")
        if slots.acquire(timeout=0.1):
            return


def _check_geometry(entry: FileEntry, values: torch.Tensor) -> None:
    if values.dtype != entry.dtype or tuple(values.shape) != entry.shape:
        raise RuntimeError(
            f"{entry.name}: its values came out {values.dtype} {tuple(values.shape)}, but the "
            f"header says {entry.dtype} {entry.shape}; was the model changed while saving?"
        )
