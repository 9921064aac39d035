"""The general path: one ``OpRecord`` for an op on deferred tensors, and its deferred outputs.

Every ATen op that :func:`~jupyter_metainit.core.record.dispatch.triage.handle_op` does not send
elsewhere (views, fills, recipes, value reads) ends here. :func:`record_op` runs these steps,
each a function below or in the module named after its job:

1. outputs' metadata (``metadata``: meta kernels, layout probes; ``value_reads`` when an op
   has no meta kernel);
2. the dtype replay must use (``dtypes``);
3. the arguments as recorded (``inputs``: real tensors kept as ``External``/``Constant``);
4. the outputs: **where aliasing is decided for recorded ops** (``_wrap_outputs``: an output
   that aliases an input is a new ``TensorRecord`` over the input's storage; every other one
   gets a new storage) and which storages the op writes (``_written_storages``);
5. the record itself, appended to the ``writes`` of each storage it creates or writes, with a
   random op's place in its generator's stream (``random_ops``) and a factory's recipe
   (``recipes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.dtypes import check_same_dtypes, resolve_dtypes
from jupyter_metainit.core.record.dispatch.fills import full_overwrite
from jupyter_metainit.core.record.dispatch.inputs import (
    META,
    call_site,
    external,
    is_float,
    meta_of,
    new_output,
    output_device,
)
from jupyter_metainit.core.record.dispatch.metadata import (
    PROBED,
    cpu_layout,
    layout_may_differ,
    meta_outputs,
    output_requires_grad,
    probe_layout,
    same_layout,
)
from jupyter_metainit.core.record.dispatch.random_ops import place_random
from jupyter_metainit.core.record.dispatch.recipes import keep_recipe, worth_a_recipe
from jupyter_metainit.core.record.dispatch.value_reads import (
    VALUES_FOR_ERRORS,
    NotStridedResult,
    computed_not_strided,
    deferred_input_bytes,
    not_strided,
    outputs_from_values,
)
from jupyter_metainit.core.record.graph import (
    OpRecord,
    RngUse,
    StorageRecord,
    TensorRecord,
    next_seq,
)
from jupyter_metainit.core.record.ops import OpInfo, Where, bind_arguments, op_info
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.value_reader import value_reader
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain

aten = torch.ops.aten

_NO_META_KERNEL = (
    NotImplementedError,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.DataDependentOutputException,
)


@dataclass
class _Call:
    """One op being recorded: what was called, and what recording has found out so far."""

    func: Any
    info: OpInfo
    bound: list
    flat: list
    args: tuple
    kwargs: dict
    where: Where
    device: torch.device
    called_func: Any  # autograd's rule is the called overload's (``randint_like.default``)
    called_with: tuple[tuple, dict]  # before dtype resolution rewrites them: the recipe's key
    meta_args: tuple = ()
    meta_kwargs: dict = field(default_factory=dict)


def record_op(func: Any, info: OpInfo, bound: list, flat: list, args: tuple, kwargs: dict) -> Any:
    """Record ``func(*args, **kwargs)`` and return its deferred outputs.

    The ``OpRecord`` holds the op with tensors replaced by ``TensorRecord``s (deferred inputs),
    ``External``s (real inputs) or ``Constant``s, and explicit where replay must not depend on
    what is in force later: the device each output reports, the dtype of factories whose dtype
    was left to the default, a generator slot for every random op (``rand`` is recorded as
    ``rand.generator``), and the default dtype for the few ops whose result dtype comes from it.
    Random ops also get their place in their generator's stream (``rng.streams.record_random``).
    """
    call = _Call(
        func,
        info,
        bound,
        flat,
        args,
        kwargs,
        call_site(),
        output_device(kwargs, flat),
        func,
        (args, kwargs),
    )
    if info.generator_overload is not None:
        call.func, call.kwargs = info.generator_overload, {**kwargs, "generator": None}
        call.info = op_info(call.func)
        call.bound = bind_arguments(call.func, args, call.kwargs)
    check_same_dtypes(call.func, call.info, call.bound)
    call.meta_args, call.meta_kwargs = map_args(meta_of, call.args, call.kwargs)
    if "device" in call.meta_kwargs and call.meta_kwargs["device"] is not None:
        call.meta_kwargs["device"] = META
    out, values, finished = _outputs_metadata(call)
    if finished:
        return out
    default_dtype: torch.dtype | None = None
    if values is None:  # the meta kernels answered: the dtype may come from the defaults
        dtypes = resolve_dtypes(
            call.func,
            call.info,
            call.bound,
            call.flat,
            call.args,
            call.kwargs,
            call.meta_args,
            call.meta_kwargs,
            out,
        )
        if dtypes.explicit is not None:
            args, kwargs = dtypes.explicit
            bound = bind_arguments(call.func, args, kwargs)
            return record_op(call.func, call.info, bound, iter_args(args, kwargs), args, kwargs)
        call.kwargs, call.meta_kwargs, out = dtypes.kwargs, dtypes.meta_kwargs, dtypes.out
        default_dtype = dtypes.default_dtype
    return _record_outputs(call, out, values, default_dtype)


def _outputs_metadata(call: _Call) -> tuple[Any, list | None, bool]:
    """The op's outputs as meta tensors, the values computed on the way (None when the meta
    kernels answered), and whether the first item is already the op's final result (a sparse or
    nested result, computed now)."""
    func, info, where = call.func, call.info, call.where
    meta_args, meta_kwargs = _dense_for_sparse_factor(func, call.meta_args), call.meta_kwargs
    try:
        out = cpu_layout(func, meta_outputs(func, call.bound, meta_args, meta_kwargs, info))
        if not_strided(out):
            made = computed_not_strided(func, call.args, call.kwargs, call.device, where)
            return made, None, True
        if func in PROBED:
            out = probe_layout(func, meta_args, meta_kwargs, out)
        elif layout_may_differ(info, meta_args, meta_kwargs, out):
            out = probe_layout(func, meta_args, meta_kwargs, out, info.has_generator)
    except _NO_META_KERNEL:
        return _outputs_from_values(call)
    except RuntimeError:
        # A meta kernel stricter than the real one (an in-place op that resizes): decide on
        # the real kernel when that is cheap; an error eager code gets too is raised as is.
        if deferred_input_bytes(call.flat) > VALUES_FOR_ERRORS:
            raise
        return _outputs_from_values(call)
    return out, None, False


# Products of a real sparse matrix (the argument at this index) and dense tensors, as a graph
# model's forward computes ``adj @ h``: the result is dense and contiguous, and its metadata is
# the dense meta kernel's (sparse meta kernels are missing: other ops on a sparse tensor and
# deferred ones get their outputs' metadata by computing their values).
_SPARSE_FACTOR = {
    aten.mm.default: 0,
    aten.mv.default: 0,
    aten.addmm.default: 1,
    aten._sparse_addmm.default: 1,
}


def _dense_for_sparse_factor(func: Any, meta_args: tuple) -> tuple:
    """``meta_args`` with the sparse factor of a ``_SPARSE_FACTOR`` product as a dense meta
    tensor of its shape and dtype."""
    i = _SPARSE_FACTOR.get(func)
    if i is None or len(meta_args) <= i or meta_args[i].layout is torch.strided:
        return meta_args
    others = [x for j, x in enumerate(meta_args) if j != i and isinstance(x, torch.Tensor)]
    if any(x.layout is not torch.strided for x in others):  # sparse @ sparse: a sparse result
        return meta_args
    x = meta_args[i]
    with plain():
        dense = torch.empty(x.shape, dtype=x.dtype, device=META)
    return (*meta_args[:i], dense, *meta_args[i + 1 :])


def _outputs_from_values(call: _Call) -> tuple[Any, list | None, bool]:
    try:
        out, values = outputs_from_values(call.func, call.info, call.args, call.kwargs, call.where)
    except NotStridedResult as e:
        return e.result, None, True
    return out, values, False


def _recorded_arguments(
    call: _Call,
) -> tuple[Any, dict, dict[int, StorageRecord], bool, list[int]]:
    """Arguments as recorded (tensors become records, devices the real one), the storages the
    op reads, whether an input requires grad (in grad mode), and the ids of the records of the
    deferred inputs that require grad."""
    grad = False
    reads: dict[int, StorageRecord] = {}
    grad_records: list[int] = []

    def record_arg(x: Any) -> Any:
        nonlocal grad
        if type(x) is DeferredTensor:
            if x._rg:
                grad = True
                grad_records.append(id(x._rec))
            reads[id(x._rec.storage)] = x._rec.storage
            return x._rec
        if isinstance(x, torch.Tensor):
            grad = grad or x.requires_grad
            return external(x, call.where)
        if isinstance(x, torch.device) and x.type == "meta":
            return call.device
        return x

    rec_args, rec_kwargs = map_args(record_arg, call.args, call.kwargs)
    if "device" in rec_kwargs:
        rec_kwargs["device"] = call.device
    return rec_args, rec_kwargs, reads, grad and torch.is_grad_enabled(), grad_records


def _record_outputs(call: _Call, out: Any, values: list | None, default_dtype: Any) -> Any:
    """Steps 3 to 5 of :func:`record_op`: the deferred outputs, and the record they come from."""
    from_values = values is not None  # the outputs' metadata came from the inputs' values
    rec_args, rec_kwargs, reads, grad, grad_records = _recorded_arguments(call)
    # Per output: does eager autograd make it require grad? (``ones_like(param)`` does not.)
    out_grads = output_requires_grad(call.called_func, *call.called_with, out) if grad else None
    overwrites = full_overwrite(call.func, call.bound)
    if overwrites is not None:
        reads.pop(id(overwrites), None)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    results, new_records, created = _wrap_outputs(call, out, grad, out_grads)
    mutates = _written_storages(call, grad, out_grads)
    if created or mutates:
        rng = None
        if call.info.is_random:
            rng, values, rec_args, rec_kwargs = _place_in_stream(
                call, outs, mutates, values, rec_args, rec_kwargs
            )
        op = OpRecord(
            next_seq(),
            call.func,
            tuple(rec_args),
            rec_kwargs,
            tuple(reads.values()),
            tuple(new_records),
            rng,
            call.where,
            default_dtype,
            tuple(mutates),
            () if overwrites is None else (overwrites,),
        )
        if grad:  # a node of eager's autograd graph (a gradient taken later replays it so)
            op.grad_args = frozenset(grad_records)
        if from_values:
            op.shape_from_values = True
        for s in (*created, *mutates):
            s.writes.append(op)
        if worth_a_recipe(
            call.func,
            call.info,
            call.device,
            out,
            new_records,
            mutates,
            values is not None or default_dtype is not None,
        ):
            keep_recipe(call.func, *call.called_with, out, op)
        if values is not None:
            # Computed anyway: later reads of these outputs start from here.
            for rec, v in zip(new_records, values, strict=False):
                if rec is not None and isinstance(v, torch.Tensor):
                    value_reader().keep(rec.storage, 1, v)
    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]


def _wrap_outputs(
    call: _Call, out: Any, grad: bool, out_grads: tuple[bool, ...] | None
) -> tuple[list[Any], list[TensorRecord | None], list[StorageRecord]]:
    """The deferred outputs, the records of the new storages among them, and those storages.

    Where aliasing is decided for recorded ops: an output the schema says aliases an input
    (``return_alias``) is the input itself when the op writes it, else a new ``TensorRecord``
    over the input's storage; every other output gets a storage of its own.
    """
    info, bound, func = call.info, call.bound, call.func
    outs = out if isinstance(out, (tuple, list)) else (out,)
    results: list[Any] = []
    new_records: list[TensorRecord | None] = []
    created: list[StorageRecord] = []
    for i, o in enumerate(outs):
        alias = info.return_alias[i] if i < len(info.return_alias) else None
        if alias is None and len(info.return_alias) == 1 and isinstance(out, list):
            alias = info.return_alias[0]
        writes = (
            info.return_writes[min(i, len(info.return_writes) - 1)] if info.return_writes else False
        )
        out_grad = grad and (out_grads is None or (i < len(out_grads) and out_grads[i]))
        if not isinstance(o, torch.Tensor):
            results.append(o)
            new_records.append(None)
            continue
        if alias is not None:
            src = bound[alias]
            if isinstance(src, (list, tuple)):
                src = src[i]
            if writes:
                results.append(src)
                new_records.append(None)
                continue
            if isinstance(src, DeferredTensor):
                rec = TensorRecord(src._rec.storage, o)
                rg = out_grad and is_float(o.dtype) and func is not aten.detach.default
                results.append(DeferredTensor(o, rec, src.device, rg, rg))
                new_records.append(None)
                continue
        made, rec, storage = new_output(o, call.device, out_grad and is_float(o.dtype))
        results.append(made)
        new_records.append(rec)
        created.append(storage)
    return results, new_records, created


def _written_storages(
    call: _Call, grad: bool, out_grads: tuple[bool, ...] | None
) -> list[StorageRecord]:
    """The storages of deferred tensors the op writes in place; a written tensor starts to
    require grad where eager autograd would make it (and its view's base with it)."""
    info, bound = call.info, call.bound
    mutates: list[StorageRecord] = []
    for i in info.written(bound):
        targets = bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]]
        for t in targets:
            if isinstance(t, DeferredTensor):
                if t._rec.storage not in mutates:
                    mutates.append(t._rec.storage)
                if i not in info.mutated:
                    continue  # written behind autograd's back: eager's stats never need grad
                if grad and not t._rg and (out_grads is None or any(out_grads)):
                    t._rg = t._derived = True
                    base = getattr(t, "_view_of", None)
                    if base is not None and not base._rg:
                        base._rg = base._derived = True
    return mutates


def _place_in_stream(
    call: _Call,
    outs: tuple,
    mutates: list[StorageRecord],
    values: list | None,
    rec_args: Any,
    rec_kwargs: dict,
) -> tuple[RngUse, list | None, Any, dict]:
    """A random op's place in its generator's stream; its values when placing it computed them
    (then later reads start from there); the recorded arguments with the generator slot
    emptied (replay passes the generator it keeps for the stream)."""
    info, bound = call.info, call.bound
    gen = bound[info.arg_index("generator")] if info.has_generator else None
    nbytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
    # An op writing a tensor draws where that tensor lives (`t.uniform_()`).
    on = mutates[0].device if mutates else call.device
    rng, computed = place_random(
        call.func,
        call.meta_args,
        call.meta_kwargs,
        info.has_generator,
        gen,
        nbytes,
        on,
        (call.args, call.kwargs, info),
    )
    computed_outs = computed if isinstance(computed, (tuple, list)) else [computed]
    if (
        computed is not None
        and values is None
        and not mutates
        and all(same_layout(v, o) for v, o in zip(computed_outs, outs, strict=False))
    ):
        values = list(computed_outs)  # computed anyway: later reads start from here
    if "generator" in rec_kwargs:
        rec_kwargs["generator"] = None
    elif info.has_generator:
        gi = info.arg_index("generator")
        if gi < len(rec_args):
            rec_args = tuple(None if j == gi else a for j, a in enumerate(rec_args))
    return rng, values, rec_args, rec_kwargs
