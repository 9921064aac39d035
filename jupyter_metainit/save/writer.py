"""Generate and write, overlapped, in bounded memory; publish the files only when all are written.

The calling thread produces one tensor's values at a time (replay runs on every core) while a
writer thread writes the previous one: at most two tensors' values are alive. Everything goes
into a temporary directory beside the destination and is renamed into place at the end, so a
failed or cancelled save (an exception from the progress callback, Ctrl-C) leaves nothing where
the checkpoint should be, and the model is untouched (deferred tensors stay deferred).
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from jupyter_metainit.core import progress_callback
from jupyter_metainit.save.safetensors_file import FileEntry, file_order, header_bytes
from jupyter_metainit.save.values import cpu_values

__all__ = ["Progress", "publish_directory", "staging_directory", "write_safetensors_files"]


class Progress:
    """``progress=`` as in ``materialize`` (the core's ``progress_callback``): ``True`` for a
    bar, or ``callable(done_bytes, total_bytes)`` (or ``callable(done, total, phase)``); raising
    from it cancels. ``total`` is the bytes of tensor data to write."""

    def __init__(self, progress: Any, total: int) -> None:
        self.total = total
        self._callback, self.bar = progress_callback(progress, desc="save")

    def report(self, done: int, phase: str = "") -> None:
        if self._callback is not None:
            self._callback(done, self.total, phase)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Writer(threading.Thread):
    """Writes queued byte buffers to their files, in order; counts what it wrote."""

    def __init__(self, slots: threading.Semaphore) -> None:
        super().__init__(name="jupyter_metainit.save writer", daemon=True)
        self.jobs: queue.Queue = queue.Queue()
        self.slots = slots
        self.written = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            file, payload = job
            try:
                if self.error is None and not self.stop.is_set():
                    _write_all(file, payload)
                    self.written += len(payload) if isinstance(payload, bytes) else payload.nbytes
            except BaseException as exc:  # handed to the producer thread
                self.error = exc
            finally:
                del payload
                if not isinstance(job[1], bytes):
                    self.slots.release()


def _write_all(file: Any, payload: Any) -> None:
    if isinstance(payload, bytes):
        file.write(payload)
        return
    if payload.numel() == 0:
        return
    # The tensor's memory as bytes, without a copy.
    file.write(memoryview(payload.reshape(-1).view(torch.uint8).numpy()).cast("B"))


def write_safetensors_files(
    directory: str, files: dict[str, list[FileEntry]], tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None, progress: Progress,
) -> None:  # fmt: skip
    """Write each file: header, then every tensor's bytes in file order, two tensors alive."""
    slots = threading.Semaphore(2)
    writer = _Writer(slots)
    writer.start()
    handles = []
    try:
        for file_name, entries in files.items():
            ordered = file_order(entries)
            handle = open(os.path.join(directory, file_name), "wb")  # noqa: SIM115 - closed below
            handles.append(handle)
            writer.jobs.put((handle, header_bytes(ordered, {"format": "pt"})))
            for entry in ordered:
                _wait_for_slot(slots, writer, progress)
                values = cpu_values(tensors[entry.name], dtype)
                _check_geometry(entry, values)
                writer.jobs.put((handle, values))
                del values
        writer.jobs.put(None)
        while writer.is_alive():
            writer.join(0.1)
            progress.report(writer.written, "writing")
        if writer.error is not None:
            raise writer.error
        progress.report(writer.written)
    finally:
        writer.stop.set()
        if writer.is_alive():
            writer.jobs.put(None)
            writer.join()
        for handle in handles:
            handle.close()


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


@contextmanager
def staging_directory(destination: str) -> Iterator[str]:
    """A temporary directory beside ``destination`` (same file system: renames are cheap),
    removed with everything in it unless :func:`publish_directory` moved it."""
    parent = os.path.dirname(os.path.abspath(destination)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(destination)}.saving-", dir=parent)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_directory(staging: str, destination: str, stale: Callable[[str], bool]) -> None:
    """Move the finished files into ``destination``: the whole directory at once if it does not
    exist; else file by file (``os.replace``), first removing the files ``stale`` names (shards
    of an earlier save that this one does not overwrite), as ``save_pretrained`` does."""
    if not os.path.exists(destination):
        os.rename(staging, destination)
        os.makedirs(staging)  # staging_directory removes it
        return
    if not os.path.isdir(destination):
        raise NotADirectoryError(f"{destination} exists and is not a directory")
    new = set(os.listdir(staging))
    for name in os.listdir(destination):
        if name not in new and stale(name):
            os.remove(os.path.join(destination, name))
    for name in sorted(new):
        os.replace(os.path.join(staging, name), os.path.join(destination, name))
