"""``format="dcp"``: a ``torch.distributed.checkpoint`` whose tensors are computed as written.

``dcp.save`` asks its planner for each tensor's data (``resolve_data``) just before writing it;
the planner here computes a deferred tensor's values there (a sharded one's local shard, on each
rank) instead of holding them all. The writer writes one file per tensor: its one-file-per-rank
mode keeps every tensor of the file alive until the file is closed. ``dcp.load`` reads either
layout into any sharding (FSDP2, tensor parallel, or an eagerly built model): a torchtitan seed
checkpoint made without ever holding the model.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from jupyter_metainit.core import is_deferred
from jupyter_metainit.save.layout import state_dict_of
from jupyter_metainit.save.values import cpu_values
from jupyter_metainit.save.writer import Progress

__all__ = ["ValuesOnDemandPlanner", "save_dcp"]


class ValuesOnDemandPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose ``resolve_data`` computes a tensor's values when the writer
    asks for them (exact mode, on the CPU; deferred tensors stay deferred) and reports progress.
    A failure in the progress callback (a cancel) is kept to be raised as it was."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(dedup_save_to_lowest_rank=False)
        self.progress = progress
        self.done = 0
        self.failure: BaseException | None = None

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        try:
            self.progress.report(self.done, "generating")
            values = cpu_values(self.lookup_object(write_item.index))
        except BaseException as exc:
            self.failure = exc
            raise
        self.done += values.nbytes
        return values


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
    """Write ``obj``'s state dict with ``dcp.save`` into ``destination``, staged beside it under
    a name every rank agrees on and renamed into place by the coordinator at the end."""
    state, _ = state_dict_of(obj)
    state = _with_dtype(state, dtype)
    grouped = dist.is_available() and dist.is_initialized()
    coordinator = not grouped or dist.get_rank() == 0
    parent = os.path.dirname(os.path.abspath(destination))
    staging = os.path.join(parent, f".{os.path.basename(destination)}.saving")
    if coordinator:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    if grouped:
        dist.barrier()
    bar = Progress(progress, _local_bytes(state))
    planner = ValuesOnDemandPlanner(bar)
    try:
        writer = FileSystemWriter(staging, single_file_per_rank=False, thread_count=2)
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=not grouped)
        bar.report(planner.done)
        if coordinator:
            if os.path.exists(destination):
                shutil.rmtree(destination)
            os.rename(staging, destination)
        if grouped:
            dist.barrier()
    except CheckpointException as exc:
        if planner.failure is not None:
            raise planner.failure from exc
        raise
    finally:
        bar.close()
        if coordinator:
            shutil.rmtree(staging, ignore_errors=True)
    return destination
