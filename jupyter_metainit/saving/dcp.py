"""``format="dcp"``: a ``torch.distributed.checkpoint`` whose tensors are computed as written.

``dcp.save`` asks its planner for each tensor's data (``resolve_data``) just before writing it;
the planner here computes a deferred tensor's values there (a sharded one's local shard, on each
rank) instead of holding them all. The writer writes one file per rank, as torch's
``FileSystemWriter`` does by default (or files of at most ``max_shard_size`` bytes of tensors),
each tensor written and dropped as it comes: torch's own one-file mode keeps every tensor of
the file alive until the file is closed. The files are what torch's writer writes (each tensor
written by ``torch.save`` at its offset, the same metadata), so ``dcp.load`` reads them into any
sharding (FSDP2, tensor parallel, or an eagerly built model): a torchtitan seed checkpoint made
without ever holding the model.
"""

from __future__ import annotations

import errno
import math
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from jupyter_metainit.core import is_deferred, telling
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.saving.exact_values import cpu_values
from jupyter_metainit.saving.layout import (
    check_savable,
    file_size_errors,
    refuse_files_over_the_limit,
    state_dict_of,
)
from jupyter_metainit.saving.staging import (
    disk_full_error,
    is_dcp_file,
    no_space_error,
    publish_directory,
    staging_directory,
)
from jupyter_metainit.saving.writer import Progress

__all__ = ["StreamingWriter", "ValuesOnDemandPlanner", "save_dcp"]


class ValuesOnDemandPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose ``resolve_data`` hands over a tensor's values when the writer
    asks for them (exact mode, on the CPU; deferred tensors stay deferred) and already computes
    the next tensor's on a helper thread while the writer writes: generation and writing
    overlap, two tensors alive at most. Progress (and a cancel raised from it) runs on the
    writing thread, the caller's, also about every 0.2 s while one large tensor is generated;
    a cancel stops that generation within a step (``telling``)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(dedup_save_to_lowest_rank=False)
        self.progress = progress
        self.done = 0
        self.order: list[WriteItem] = []
        self.prefetch = ThreadPoolExecutor(1, thread_name_prefix="jupyter_metainit.save")
        self.next: tuple[Any, Future] | None = None
        self.generated = 0  # bytes of the tensor being generated so far
        self.stopping = False  # the writing thread was cancelled: the prefetch stops

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        self.order = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        self.progress.report(self.done, "generating")
        if self.next is not None and self.next[0] == write_item.index:
            values = self._waited(self.next[1])
        else:  # not the order planned: compute it here
            values = self._values(write_item, here=True)
        self.next = None
        position = next(
            (k for k, item in enumerate(self.order) if item.index == write_item.index), None
        )
        if position is not None and position + 1 < len(self.order):
            following = self.order[position + 1]
            self.next = (following.index, self.prefetch.submit(self._values, following))
        self.done += values.nbytes
        return values

    def _waited(self, future: Future) -> torch.Tensor:
        """The prefetched values, telling progress while they are made (a cancel raised from
        it stops the prefetch at its next step)."""
        while True:
            try:
                return future.result(timeout=0.2)
            except TimeoutError:
                pass
            try:
                self.progress.report(self.done + self.generated, "generating")
            except BaseException:
                self.stopping = True
                raise

    def _values(self, write_item: WriteItem, here: bool = False) -> torch.Tensor:
        t = self.lookup_object(write_item.index)
        local = t.to_local() if hasattr(t, "to_local") else t
        size = local.numel() * local.element_size()
        self.generated = 0

        def tell(nbytes: int) -> None:
            self.generated = nbytes = min(nbytes, size)  # (its fills' bytes: a cast halves them)
            if here:  # on the writing thread: told from here
                self.progress.report(self.done + nbytes, "generating")
            elif self.stopping:
                raise _Stopped

        with telling(tell):
            return cpu_values(t)

    def close(self) -> None:
        self.stopping = True  # a prefetch still running stops at its next step
        if self.next is not None:
            self.next[1].cancel()
        self.next = None
        self.prefetch.shutdown(wait=True)


class _Stopped(Exception):
    """Ends a prefetch whose save was cancelled (the writing thread raises the reason)."""


# What ``torch.save`` adds around a tensor's bytes (its zip records: about 1.6 KB), at most.
_FRAMING = 4096


class StreamingWriter(FileSystemWriter):
    """``FileSystemWriter`` that writes this rank's items into one file, or a new file where
    the next tensor would take one past ``max_file_bytes``, each tensor asked of the planner,
    written and dropped in turn (two alive with :class:`ValuesOnDemandPlanner`'s prefetch).
    The files, offsets and metadata are those torch's writer gives: ``dcp.load`` reads them."""

    def __init__(self, path: str, max_file_bytes: int | None) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.max_file_bytes = max_file_bytes

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        groups = file_groups([_item_bytes(i) for i in tensor_items], self.max_file_bytes)
        results: list[WriteResult] = []
        for k, group in enumerate(groups):
            name = f"{plan.storage_data.prefix}{k}.distcp"
            items = (byte_items if k == 0 else []) + [tensor_items[j] for j in group]
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
                for item in items:
                    results.append(_write_item(stream, name, item, planner.resolve_data(item)))
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done


def file_groups(sizes: list[int], max_file_bytes: int | None) -> list[list[int]]:
    """Items (by their bytes, in order) grouped into files: one, or a new one where the next
    item would take the file past ``max_file_bytes`` (an item larger than that alone)."""
    groups: list[list[int]] = [[]]
    used = 0
    for j, size in enumerate(sizes):
        if max_file_bytes is not None and groups[-1] and used + size > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(j)
        used += size
    return groups


def _item_bytes(item: WriteItem) -> int:
    """A tensor item's bytes on this rank (its chunk of a sharded tensor)."""
    data = item.tensor_data
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize if data is not None else 0


def _write_item(stream: Any, name: str, item: WriteItem, data: Any) -> WriteResult:
    """Write one item where ``stream`` is, as torch's writer writes it (``torch.save`` of a
    tensor, the bytes of a byte item)."""
    offset = stream.tell()
    if item.type == WriteItemType.BYTE_IO:
        stream.write(data.getbuffer())
    else:
        values = data.detach().cpu()
        if values.untyped_storage().nbytes() != values.numel() * values.element_size():
            values = values.clone()  # a view: torch.save would write its whole storage
        del data
        try:
            torch.save(values, stream)
        except RuntimeError as exc:  # torch's "unexpected pos": the write's own error is inside
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise
    length = stream.tell() - offset
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
    )


def _with_dtype(state: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """Deferred floating tensors cast by a recorded (lazy) cast; real ones are refused: casting
    them all before writing would hold a second copy of them."""
    if dtype is None:
        return state
    out = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            if not is_deferred(t):
                raise ArgumentError(
                    f"save(format='dcp', dtype=...) casts deferred tensors only; {name} is real "
                    "(cast the real parts first, or leave dtype out)"
                )
            t = t.detach().to(dtype)
        out[name] = t
    return out


def _local_sizes(state: dict[str, Any]) -> dict[str, int]:
    """Each tensor's bytes on this rank (a sharded one's local shard)."""
    sizes = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            sizes[name] = local.numel() * local.element_size()
    return sizes


def _planned_files(
    sizes: dict[str, int], rank: int, max_file_bytes: int | None
) -> tuple[dict[str, int], tuple[str, int]]:
    """This rank's files (name -> bytes, at most) and its largest tensor (name, bytes)."""
    names = list(sizes)
    files = {
        f"__{rank}_{k}.distcp": sum(sizes[names[j]] + _FRAMING for j in group)
        for k, group in enumerate(file_groups(list(sizes.values()), max_file_bytes))
    }
    largest = max(sizes.items(), key=lambda item: item[1], default=("", 0))
    return files, largest


def save_dcp(
    obj: Any,
    destination: str,
    *,
    dtype: torch.dtype | None,
    progress: Any,
    max_file_bytes: int | None = None,
) -> str:
    """Write ``obj``'s state dict with ``dcp.save`` into ``destination``, staged inside it under
    a name every rank agrees on and put in place by the coordinator at the end (an earlier DCP
    checkpoint's files there are replaced; the directory's other files stay). One file per
    rank, or files of at most ``max_file_bytes`` bytes of tensors."""
    state, _ = state_dict_of(obj)
    check_savable(state, sharded_ok=True)
    state = _with_dtype(state, dtype)
    grouped = dist.is_available() and dist.is_initialized()
    coordinator = not grouped or dist.get_rank() == 0
    sizes = _local_sizes(state)
    files, largest = _planned_files(sizes, dist.get_rank() if grouped else 0, max_file_bytes)
    refuse_files_over_the_limit(files, largest)
    total = sum(sizes.values())
    bar = Progress(progress, total)
    planner = ValuesOnDemandPlanner(bar)
    try:
        with staging_directory(destination, shared_name="dcp", owner=coordinator) as staging:
            if grouped:
                dist.barrier()  # the coordinator made the staging directory
            writer = StreamingWriter(staging, max_file_bytes)
            # dcp warns that it saves in one process, which is what was asked for here.
            with file_size_errors(staging, files, largest), _unwrapped(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=not grouped)
            bar.report(planner.done)
            if coordinator:
                publish_directory(staging, destination, stale=is_dcp_file)
            if grouped:
                dist.barrier()
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise no_space_error(destination, total) from None
    except (CheckpointException, RuntimeError) as exc:  # a failure that does not say why
        raise disk_full_error(destination, total) or exc from None
    finally:
        planner.close()
        bar.close()
    return destination


@contextmanager
def _unwrapped() -> Iterator[None]:
    """The exception a rank raised (a cancel from the progress callback, a write's OSError),
    not dcp's ``CheckpointException`` around it."""
    try:
        yield
    except CheckpointException as exc:
        raise _original(exc) from None


def _original(exc: CheckpointException) -> BaseException:
    """The exception a rank raised (a cancel from the progress callback), not dcp's wrapper."""
    failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    if len(failures) == 1 and isinstance(failures[0], BaseException):
        return failures[0]
    return exc
