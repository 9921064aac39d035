"""Whole-call recording: a torch-level call recorded as one op.

Some composite functions take another branch for tensor subclasses, which changes the last bits
of their result (``SUBCLASS_SENSITIVE``); they are recorded as one call (:func:`record_call`)
and replayed as one call on real tensors, so replay takes the branch eager code takes.

A gradient taken while recording (``torch.autograd.grad``, ``backward``: GradInit and MetaInit
rescale weights by gradients in ``__init__``) is one call too (:func:`record_grad`): the
recording already holds every op of the forward it differentiates, each marked with the inputs
that required grad (``OpRecord.grad_args``), so replay runs that forward in grad mode from
leaves that require grad, and calls ``torch.autograd.grad`` on the real tensors (``GradCall``).
"""

from __future__ import annotations

import bisect
import inspect
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.errors import UnsupportedOperatorError
from jupyter_metainit.core.record.dispatch.inputs import (
    call_site,
    external,
    is_float,
    output_device,
    requires_grad,
    storage_nbytes,
    to_meta_or_same,
)
from jupyter_metainit.core.record.dispatch.value_reads import (
    own_grad_leaf,
    realized_as_constants,
    realized_inputs,
    run_on_real_memory,
)
from jupyter_metainit.core.record.graph import (
    GradCall,
    OpRecord,
    StorageRecord,
    TensorRecord,
    next_seq,
)
from jupyter_metainit.core.record.tensor import DeferredTensor, grad_leaves
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
        out = func(
            *map_args(to_meta_or_same, args, kwargs)[0],
            **map_args(to_meta_or_same, args, kwargs)[1],
        )
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
    if grad:  # a node of eager's autograd graph (see ``record_grad``)
        op.grad_args = frozenset(
            id(x._rec) for x in flat if isinstance(x, DeferredTensor) and x._rg
        )
    for rec in records:
        if rec is not None:
            rec.storage.writes.append(op)
    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]


_GRAD = inspect.signature(torch.autograd.grad)
_INF = 1 << 62


def record_grad(args: tuple, kwargs: dict) -> tuple[DeferredTensor | None, ...]:
    """``torch.autograd.grad`` on deferred tensors, recorded as one ``GradCall``: deferred
    gradients that materialize to eager's, bit for bit. Eager's errors (an output that does not
    require grad, an input the outputs do not depend on) are raised here, as eagerly."""
    call = _GRAD.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    outputs, inputs = _tensors(a["outputs"]), _tensors(a["inputs"])
    grad_outputs = None if a["grad_outputs"] is None else _tensors(a["grad_outputs"])
    if a["is_grads_batched"]:
        raise UnsupportedOperatorError(
            f"torch.autograd.grad(is_grads_batched=True) on deferred tensors (at {call_site()}) "
            "cannot be recorded: call it once per grad_outputs row, or after materializing"
        )
    _check_tensors(outputs, inputs, grad_outputs)
    leaves = {id(t._rec.storage) for t in inputs}
    span, reached = _span([t._rec for t in outputs], lambda s: id(s) in leaves)
    sparse = next((op for op in span if _sparse_gradient(op)), None)
    if sparse is not None:
        raise UnsupportedOperatorError(
            f"the gradient taken at {call_site()} goes through {sparse.func} with sparse=True "
            f"(at {sparse.where}; nn.Embedding(sparse=True)), whose gradient is a sparse tensor, "
            "which cannot be deferred: build the module with sparse=False, or take the "
            "gradient after materializing"
        )
    allow_unused = a["materialize_grads"] if a["allow_unused"] is None else a["allow_unused"]
    kept = [id(t._rec.storage) in reached or a["materialize_grads"] for t in inputs]
    if not all(kept) and not allow_unused:
        raise RuntimeError(
            "One of the differentiated Tensors appears to not have been used in the graph. "
            "Set allow_unused=True if this is the desired behavior."
        )
    records = [
        _gradient_of(t, a["create_graph"]) if k else None for t, k in zip(inputs, kept, strict=True)
    ]
    rec_kwargs = {
        "grad_outputs": None if grad_outputs is None else [_rec(g) for g in grad_outputs],
        "retain_graph": a["retain_graph"],
        "create_graph": a["create_graph"],
        "allow_unused": allow_unused,
        "materialize_grads": a["materialize_grads"],
    }
    tensors = [*outputs, *inputs, *(g for g in grad_outputs or () if g is not None)]
    reads = tuple({id(t._rec.storage): t._rec.storage for t in tensors}.values())
    written = {id(s): s for op in span for r in op.outputs if r is not None for s in (r.storage,)}
    written.update({id(s): s for op in span for s in op.mutates})
    op = GradCall(
        next_seq(),
        torch.autograd.grad,
        ([t._rec for t in outputs], [t._rec for t in inputs]),
        rec_kwargs,
        reads,
        tuple(g._rec if g is not None else None for g in records),
        None,
        call_site(),
        span=frozenset(o.seq for o in span),
        leaves=frozenset(id(t._rec.storage) for t in inputs),
        span_storages=tuple(written.values()),
    )
    if a["create_graph"]:  # the gradients are a node of a later gradient's graph
        op.grad_args = frozenset(id(t._rec) for t in tensors if t._rg)
    for g in records:
        if g is not None:
            g._rec.storage.writes.append(op)
    return tuple(records)


_BACKWARD = inspect.signature(torch.autograd.backward)
_TENSOR_BACKWARD = inspect.signature(torch.Tensor.backward)


def record_autograd(func: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.grad`` (:func:`record_grad`), ``torch.autograd.backward`` or
    ``Tensor.backward()`` on deferred tensors: the gradients of the leaves that require grad (or
    of ``inputs=``), recorded as one ``GradCall`` and accumulated into their ``.grad`` as eager's
    ``AccumulateGrad`` does (set when there is none; else added, in place)."""
    if func is torch.autograd.grad:
        return record_grad(args, kwargs)
    signature = _TENSOR_BACKWARD if func is torch.Tensor.backward else _BACKWARD
    call = signature.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    if func is torch.Tensor.backward:
        tensors, grads = _tensors(a["self"]), a["gradient"]
    else:
        tensors, grads = _tensors(a["tensors"]), a["grad_tensors"] or a["grad_variables"]
    inputs = _tensors(a["inputs"]) if a["inputs"] is not None else _leaves_of(tensors)
    create_graph = a["create_graph"]
    gradients = record_grad(
        (tensors, inputs),
        {
            "grad_outputs": None if grads is None else _tensors(grads),
            "allow_unused": True,
            "retain_graph": a["retain_graph"],
            "create_graph": create_graph,
        },
    )
    with torch.set_grad_enabled(create_graph):
        for leaf, g in zip(inputs, gradients, strict=True):
            if g is None:
                continue
            if leaf.grad is None:
                leaf.grad = g
            elif create_graph:
                leaf.grad = leaf.grad + g
            else:
                leaf.grad.add_(g)
    return None


def _leaves_of(tensors: list[Any]) -> list[DeferredTensor]:
    """The deferred leaves requiring grad (parameters) that ``backward`` of ``tensors`` reaches."""
    found: dict[int, DeferredTensor] = {}

    def is_leaf(storage: StorageRecord) -> bool:
        ref = grad_leaves.get(storage)
        leaf = ref() if ref is not None else None
        if not (isinstance(leaf, DeferredTensor) and leaf._rg and not leaf._derived):
            return False
        if leaf._rec.storage is not storage:  # moved elsewhere since (``set_``)
            return False
        found[id(storage)] = leaf
        return True

    records = [t._rec for t in tensors if isinstance(t, DeferredTensor)]
    _span(records, is_leaf)
    return list(found.values())


def _tensors(x: Any) -> list[Any]:
    return [x] if isinstance(x, torch.Tensor) or x is None else list(x)


def _rec(t: Any) -> Any:
    return t._rec if isinstance(t, DeferredTensor) else t


def _check_tensors(outputs: list, inputs: list, grad_outputs: list | None) -> None:
    """Eager's checks of ``torch.autograd.grad``'s arguments, and ours: every tensor deferred,
    every input a whole tensor (not a view of a larger storage)."""
    given = [*outputs, *inputs, *(g for g in grad_outputs or () if g is not None)]
    if not all(isinstance(t, DeferredTensor) for t in given):
        raise UnsupportedOperatorError(
            f"torch.autograd.grad mixes deferred and real tensors (at {call_site()}): make them "
            "all inside meta_init, or take the gradient after materializing"
        )
    for i, t in enumerate(outputs):
        if not t._rg:
            raise RuntimeError(
                f"element {i} of tensors does not require grad and does not have a grad_fn"
            )
        if grad_outputs is None and t.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
    for t in inputs:
        if not t._rg:
            raise RuntimeError("One of the differentiated Tensors does not require grad")
        made = t._rec.storage.writes[0].outputs
        base = next((r for r in made if r is not None and r.storage is t._rec.storage), None)
        if base is None or _geometry(base) != _geometry(t._rec):
            raise UnsupportedOperatorError(
                f"torch.autograd.grad with respect to a view of a larger tensor (at "
                f"{call_site()}) cannot be replayed: take the gradient with respect to the "
                "tensor it views and slice it, or take it after materializing"
            )


def _sparse_gradient(op: OpRecord) -> bool:
    """Whether ``op`` makes sparse gradients (``embedding(..., sparse=True)``)."""
    schema = getattr(op.func, "_schema", None)
    if schema is None:
        return False
    for i, arg in enumerate(schema.arguments):
        if arg.name == "sparse":
            value = op.args[i] if i < len(op.args) else op.kwargs.get("sparse", False)
            return value is True
    return False


def _geometry(r: TensorRecord) -> tuple:
    return r.size, r.stride, r.offset, r.dtype, r.conj, r.neg


def _gradient_of(t: DeferredTensor, create_graph: bool) -> DeferredTensor:
    """The deferred gradient of ``t``: eager's has ``t``'s shape, dtype, strides and device."""
    with plain():
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    rec = TensorRecord(StorageRecord(storage_nbytes(meta), meta.dtype, t.device), meta)
    return DeferredTensor(meta, rec, t.device, create_graph, create_graph)


def _span(
    outputs: list[TensorRecord], is_leaf: Callable[[StorageRecord], bool]
) -> tuple[list[OpRecord], set[int]]:
    """The ops eager autograd differentiates from ``outputs`` back to the leaf storages (in
    recording order), and the ids of the leaves reached. An op is in it when eager autograd made
    a node of it (``grad_args``) and the outputs depend on it through inputs that required grad:
    a ``detach()``ed input, or one that did not require grad, leads nowhere, as eagerly."""
    span: dict[int, OpRecord] = {}
    reached: set[int] = set()
    seen: set[tuple[int, int]] = set()
    work = [(r.storage, _INF) for r in outputs]
    while work:
        storage, upto = work.pop()
        if is_leaf(storage):  # and on: an input computed in grad mode passes gradients on too
            reached.add(id(storage))
        writes = storage.writes
        n = len(writes) if upto == _INF else bisect.bisect_left(writes, upto, key=_seq)
        if (id(storage), n) in seen:
            continue
        seen.add((id(storage), n))
        first = next((i for i in range(n - 1, 0, -1) if storage in writes[i].overwrites), 0)
        for op in writes[first:n]:
            if op.grad_args is None or op.seq in span:
                continue
            span[op.seq] = op
            for x in iter_args(op.args, op.kwargs):
                if isinstance(x, TensorRecord) and id(x) in op.grad_args:
                    work.append((x.storage, op.seq))
    return sorted(span.values(), key=_seq), reached


def _seq(op: OpRecord) -> int:
    return op.seq
