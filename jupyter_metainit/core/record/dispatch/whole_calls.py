"""Whole-call recording: a torch-level call recorded as one op.

Some composite functions take another branch for tensor subclasses, which changes the last bits
of their result (``SUBCLASS_SENSITIVE``); they are recorded as one call (:func:`record_call`)
and replayed as one call on real tensors, so replay takes the branch eager code takes.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.inputs import (
    call_site,
    external,
    is_float,
    output_device,
    requires_grad,
    storage_nbytes,
    to_meta_or_same,
)
from jupyter_metainit.core.record.dispatch.reads import (
    own_grad_leaf,
    realized_as_constants,
    realized_inputs,
    run_on_real_memory,
)
from jupyter_metainit.core.record.graph import OpRecord, StorageRecord, TensorRecord, next_seq
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain

# Composite functions whose C++ implementation takes another branch for tensor subclasses
# (``_may_require_fw_or_bw_grad``: singular values computed with the singular vectors), which
# changes the last bits of the result. They are recorded as one call and replayed as one call
# on real tensors, so replay takes the branch eager code takes.
SUBCLASS_SENSITIVE = {
    torch.linalg.svdvals, torch.linalg.eigvalsh, torch.linalg.eigvals, torch.linalg.matrix_norm,
    torch.linalg.norm, torch.linalg.cond, torch.linalg.matrix_rank, torch.linalg.pinv, torch.norm,
    torch.Tensor.norm, torch.nuclear_norm, torch.svd, torch.Tensor.svd,
}  # fmt: skip


def record_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record a whole torch-level call as one op (see ``SUBCLASS_SENSITIVE``)."""
    where = call_site()
    flat = iter_args(args, kwargs)
    real = realized_inputs(flat)
    if real is not None:  # views of memory made real: as ``triage._on_real_memory``
        if all(
            id(x) in real and not own_grad_leaf(x) for x in flat if isinstance(x, DeferredTensor)
        ):
            return run_on_real_memory(func, args, kwargs, real)
        args, kwargs = realized_as_constants(args, kwargs, real, set())
        flat = iter_args(args, kwargs)
    device = output_device(kwargs, flat)
    with plain():
        out = func(*map_args(to_meta_or_same, args, kwargs)[0],
                   **map_args(to_meta_or_same, args, kwargs)[1])  # fmt: skip
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    grad = torch.is_grad_enabled() and any(
        requires_grad(x) for x in flat if isinstance(x, torch.Tensor)
    )
    records: list[TensorRecord | None] = []
    results: list[Any] = []
    for o in outs:
        if not isinstance(o, torch.Tensor):
            records.append(None)
            results.append(o)
            continue
        rec = TensorRecord(StorageRecord(storage_nbytes(o), o.dtype, device), o)
        rg = grad and is_float(o.dtype)
        records.append(rec)
        results.append(DeferredTensor(o, rec, device, rg, rg))

    def record_arg(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            return x._rec
        if isinstance(x, torch.Tensor):
            return external(x, where)
        return x

    rec_args, rec_kwargs = map_args(record_arg, args, kwargs)
    reads = tuple(
        {id(x._rec.storage): x._rec.storage for x in flat if isinstance(x, DeferredTensor)}.values()
    )
    op = OpRecord(next_seq(), func, tuple(rec_args), rec_kwargs, reads, tuple(records), None, where)
    for rec in records:
        if rec is not None:
            rec.storage.writes.append(op)
    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]
