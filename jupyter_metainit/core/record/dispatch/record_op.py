"""TODO"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.dtypes import explicit_default_dtype, uses_default_dtype
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
    COLUMN_MAJOR_OUTPUTS,
    PROBED,
    cpu_layout,
    layout_may_differ,
    meta_outputs,
    output_requires_grad,
    probe_layout,
    same_layout,
)
from jupyter_metainit.core.record.dispatch.random_ops import place_random
from jupyter_metainit.core.record.dispatch.reads import (
    VALUES_FOR_ERRORS,
    NotStridedResult,
    computed_not_strided,
    deferred_input_bytes,
    not_strided,
    outputs_from_values,
)
from jupyter_metainit.core.record.dispatch.recipes import keep_recipe
from jupyter_metainit.core.record.graph import OpRecord, StorageRecord, TensorRecord, next_seq
from jupyter_metainit.core.record.ops import OpInfo, bind_arguments, op_info
from jupyter_metainit.core.record.state import (
    _global_default_dtype,
    default_dtype_as,
    dtype_override,
    tls,
)
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.value_reader import value_reader
from jupyter_metainit.core.runtime.plain import iter_args, map_args

aten = torch.ops.aten

_NO_META_KERNEL = (
    NotImplementedError,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.DataDependentOutputException,
)


def record_op(func: Any, info: OpInfo, bound: list, flat: list, args: tuple, kwargs: dict) -> Any:
    """Record ``func(*args, **kwargs)`` and return its deferred outputs.

    The ``OpRecord`` holds the op with tensors replaced by ``TensorRecord``s (deferred inputs),
    ``External``s (real inputs) or ``Constant``s, and explicit where replay must not depend on
    what is in force later: the device each output reports, the dtype of factories whose dtype
    was left to the default, a generator slot for every random op (``rand`` is recorded as
    ``rand.generator``), and the default dtype for the few ops whose result dtype comes from it.
    Random ops also get their place in their generator's stream (``_rng.record_random``).
    """
    where = call_site()
    device = output_device(kwargs, flat)
    called_with = args, kwargs  # before dtype resolution rewrites them: the recipe's key
    called_func = func  # autograd's rule is the called overload's (``randint_like.default``)
    if info.generator_overload is not None:
        func, kwargs = info.generator_overload, {**kwargs, "generator": None}
        info = op_info(func)
        bound = bind_arguments(func, args, kwargs)

    meta_args, meta_kwargs = map_args(meta_of, args, kwargs)
    if "device" in meta_kwargs and meta_kwargs["device"] is not None:
        meta_kwargs["device"] = META
    values: Any = None
    default_dtype: torch.dtype | None = None
    try:
        out = cpu_layout(func, meta_outputs(func, bound, meta_args, meta_kwargs, info))
        if not_strided(out):
            return computed_not_strided(func, args, kwargs, device, where)
        if func in PROBED:
            out = probe_layout(func, meta_args, meta_kwargs, out)
        elif layout_may_differ(info, meta_args, meta_kwargs, out):
            out = probe_layout(func, meta_args, meta_kwargs, out, info.has_generator)
    except _NO_META_KERNEL:
        try:
            out, values = outputs_from_values(func, info, args, kwargs, where)
        except NotStridedResult as e:
            return e.result
    except RuntimeError:
        # A meta kernel stricter than the real one (an in-place op that resizes): decide on
        # the real kernel when that is cheap; an error eager code gets too is raised as is.
        if deferred_input_bytes(flat) > VALUES_FOR_ERRORS:
            raise
        try:
            out, values = outputs_from_values(func, info, args, kwargs, where)
        except NotStridedResult as e:
            return e.result
    else:
        if info.dtype_index is not None and not info.takes_tensors:
            # A factory: replay gets the dtype explicitly, never the default in force then.
            if bound[info.dtype_index] is None:
                global_default, override = _global_default_dtype(), dtype_override()
                if (
                    override is not None
                    and override != global_default
                    and isinstance(out, torch.Tensor)
                    and out.dtype == global_default
                ):
                    meta_kwargs = {**meta_kwargs, "dtype": override}
                    out = meta_outputs(func, bound, meta_args, meta_kwargs)
                kwargs = {**kwargs, "dtype": out.dtype}
                meta_kwargs = {**meta_kwargs, "dtype": out.dtype}
        elif uses_default_dtype(flat, out):
            global_default, override = _global_default_dtype(), dtype_override()
            default_dtype = override if override is not None else global_default
            explicit = explicit_default_dtype(func, info, args, kwargs, default_dtype, out)
            if explicit is not None:
                args, kwargs = explicit
                bound = bind_arguments(func, args, kwargs)
                return record_op(func, info, bound, iter_args(args, kwargs), args, kwargs)
            if default_dtype != global_default:
                with default_dtype_as(default_dtype):
                    out = meta_outputs(func, bound, meta_args, meta_kwargs)

    # Arguments as recorded: tensors become records, devices become the real one.
    grad = False
    reads: dict[int, StorageRecord] = {}

    def record_arg(x: Any) -> Any:
        nonlocal grad
        if type(x) is DeferredTensor:
            grad = grad or x._rg
            reads[id(x._rec.storage)] = x._rec.storage
            return x._rec
        if isinstance(x, torch.Tensor):
            grad = grad or x.requires_grad
            return external(x, where)
        if isinstance(x, torch.device) and x.type == "meta":
            return device
        return x

    rec_args, rec_kwargs = map_args(record_arg, args, kwargs)
    grad = grad and torch.is_grad_enabled()
    # Per output: does eager autograd make it require grad? (``ones_like(param)`` does not.)
    out_grads = output_requires_grad(called_func, *called_with, out) if grad else None
    if "device" in rec_kwargs:
        rec_kwargs["device"] = device
    overwrites = full_overwrite(func, bound)
    if overwrites is not None:
        reads.pop(id(overwrites), None)

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
        made, rec, storage = new_output(o, device, out_grad and is_float(o.dtype))
        results.append(made)
        new_records.append(rec)
        created.append(storage)
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

    if created or mutates:
        rng = None
        if info.is_random:
            gen = bound[info.arg_index("generator")] if info.has_generator else None
            nbytes = sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
            # An op writing a tensor draws where that tensor lives (`t.uniform_()`).
            on = mutates[0].device if mutates else device
            rng, computed = place_random(func, meta_args, meta_kwargs, info.has_generator,
                                          gen, nbytes, on, (args, kwargs, info))  # fmt: skip
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
        op = OpRecord(
            next_seq(), func, tuple(rec_args), rec_kwargs, tuple(reads.values()),
            tuple(new_records), rng, where, default_dtype, tuple(mutates),
            () if overwrites is None else (overwrites,),
        )  # fmt: skip
        for s in (*created, *mutates):
            s.writes.append(op)
        if (
            info.dtype_index is not None
            and not info.takes_tensors
            and not info.is_random
            and not mutates
            and values is None
            and default_dtype is None
            and len(new_records) == 1
            and not isinstance(out, (tuple, list))
            and out.storage_offset() == 0
            and tls.pending_device is not None
            and device == tls.pending_device
            and func not in PROBED
            and func not in COLUMN_MAJOR_OUTPUTS
        ):
            keep_recipe(func, *called_with, out, op)
        if values is not None:
            # Computed anyway: later reads of these outputs start from here.
            for rec, v in zip(new_records, values, strict=False):
                if rec is not None and isinstance(v, torch.Tensor):
                    value_reader().keep(rec.storage, 1, v)

    if isinstance(out, (tuple, list)):
        return type(out)(results)
    return results[0]
