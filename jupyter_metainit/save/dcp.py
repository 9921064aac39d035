"""``format="dcp"``: a ``torch.distributed.checkpoint`` whose tensors are computed as written.

``dcp.save`` asks its planner for each tensor's data (``resolve_data``) just before writing it;
the planner here computes a deferred tensor's values there (a sharded one's local shard, on each
rank) instead of holding them all. The writer writes one file per tensor: its one-file-per-rank
mode keeps every tensor of the file alive until the file is closed. ``dcp.load`` reads either
layout into any sharding (FSDP2, tensor parallel, or an eagerly built model): a torchtitan seed
checkpoint made without ever holding the model.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from jupyter_metainit.core import is_deferred, telling
from jupyter_metainit.save.layout import check_savable, state_dict_of
from jupyter_metainit.save.staging import (
    disk_full_error,
    is_dcp_file,
    publish_directory,
    staging_directory,
)
from jupyter_metainit.save.values import cpu_values
from jupyter_metainit.save.writer import Progress

__all__ = ["ValuesOnDemandPlanner", "save_dcp"]


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
        size = _local_bytes({"t": t})
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


def _with_dtype(state: dict[str, Any], dtype: torch.dtype | None) -> dict[str, Any]:
    """Deferred floating tensors cast by a recorded (lazy) cast; real ones are refused: casting
    them all before writing would hold a second copy of them."""
    if dtype is None:
        return state
    out = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            if not is_deferred(t):
                raise ValueError(
                    f"save(format='dcp', dtype=...) casts deferred tensors only; {name} is real "
                    "(cast the real parts first, or leave dtype out)"
                )
            t = t.detach().to(dtype)
        out[name] = t
    return out


def _local_bytes(state: dict[str, Any]) -> int:
    total = 0
    for t in state.values():
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def save_dcp(obj: Any, destination: str, *, dtype: torch.dtype | None, progress: Any) -> str:
    """Write ``obj``'s state dict with ``dcp.save`` into ``destination``, staged inside it under
    a name every rank agrees on and put in place by the coordinator at the end (an earlier DCP
    checkpoint's files there are replaced; the directory's other files stay)."""
    state, _ = state_dict_of(obj)
    check_savable(state, sharded_ok=True)
    state = _with_dtype(state, dtype)
    grouped = dist.is_available() and dist.is_initialized()
    coordinator = not grouped or dist.get_rank() == 0
    bar = Progress(progress, _local_bytes(state))
    planner = ValuesOnDemandPlanner(bar)
    try:
        with staging_directory(destination, shared_name="dcp", owner=coordinator) as staging:
            if grouped:
                dist.barrier()  # the coordinator made the staging directory
            writer = FileSystemWriter(staging, single_file_per_rank=False, thread_count=1)
            with warnings.catch_warnings():
                # dcp warns that it saves in one process, which is what was asked for here.
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=not grouped)
            bar.report(planner.done)
            if coordinator:
                publish_directory(staging, destination, stale=is_dcp_file)
            if grouped:
                dist.barrier()
    except CheckpointException as exc:
        raise disk_full_error(destination, _local_bytes(state)) or _original(exc) from None
    except RuntimeError as exc:  # torch's writer on a full disk: "enforce fail ... unexpected pos"
        raise disk_full_error(destination, _local_bytes(state)) or exc from None
    finally:
        planner.close()
        bar.close()
    return destination


def _original(exc: CheckpointException) -> BaseException:
    """The exception a rank raised (a cancel from the progress callback), not dcp's wrapper."""
    failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
    if len(failures) == 1 and isinstance(failures[0], BaseException):
        return failures[0]
    return exc
