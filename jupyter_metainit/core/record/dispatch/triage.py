"""Dispatch triage: what happens to every ATen op that touches a deferred tensor.

Two interception points feed :func:`handle_op`, as in ``torch._subclasses.fake_tensor``:

* ``DeferredTensor.__torch_dispatch__`` sees every ATen op that has a deferred input, inside or
  outside ``meta_init`` (so ``model.half()`` or ``model.apply(init)`` later are recorded too);
* inside ``meta_init``, a dispatch mode (``record.context``) also sees factory ops
  (``torch.ones``) and ops on real tensors.

:func:`_handle_op` decides, per op, which path takes it — and so **what may run for real while
recording** (its docstring states the rules): views (``views``), fills (``fills``), factory
recipes (``recipes``), ops that need values now (``value_reads``), in-place view ops
(``views``), and everything else (``record_op``).
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.errors import UnsupportedOperatorError
from jupyter_metainit.core.record.dispatch.fills import record_fill
from jupyter_metainit.core.record.dispatch.inputs import call_site, output_device, wrap_constant
from jupyter_metainit.core.record.dispatch.metadata import METADATA_QUERIES, OVERWRITES_SELF
from jupyter_metainit.core.record.dispatch.recipes import recipe_funcs, record_from_recipe
from jupyter_metainit.core.record.dispatch.record_op import record_op
from jupyter_metainit.core.record.dispatch.value_reads import (
    own_grad_leaf,
    realized_as_constants,
    realized_inputs,
    run_on_real_memory,
    run_on_values,
    run_on_values_and_record_writes,
)
from jupyter_metainit.core.record.dispatch.views import inplace_view, record_view
from jupyter_metainit.core.record.ops import OpInfo, bind_arguments, op_info
from jupyter_metainit.core.record.state import tls
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.rng.streams import before_real_draw
from jupyter_metainit.core.runtime.plain import iter_args, plain

aten = torch.ops.aten


def handle_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record one ATen call (see :func:`_handle_op`)."""
    try:
        return _handle_op(func, args, kwargs)
    except NotImplementedError as e:
        if "NestedTensorMeta" not in str(e) and "SparseMeta" not in str(e):
            raise
        # Nested (jagged) and sparse tensors built on PyTorch's meta device inside meta_init.
        raise UnsupportedOperatorError(
            f"{func} on a nested or sparse tensor cannot be deferred (called at {call_site()}); "
            "build nested and sparse tensors outside meta_init, or use dense tensors"
        ) from None


def _handle_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record one ATen call that involves a deferred tensor (or any call inside ``meta_init``).

    Use it only as the dispatch handler of ``DeferredTensor`` and of the ``meta_init`` mode.
    What it does, and the rules replay (``core.replay``'s ``plan``) relies on:

    * **No deferred input** (only seen inside ``meta_init``): views of real tensors, ops that
      write a real tensor and ops that return no tensor run for real; everything else (factory
      calls, new tensors computed from real ones) is recorded, real inputs kept as ``External``
      (their version is checked at replay).
    * **Metadata only** (``is_pinned``, ``is_set_to``, ``is_same_size``): answered from the
      records and meta tensors (``metadata.METADATA_QUERIES``), never by computing values.
    * **Values needed**: an op that returns no tensor (``.item()``, ``equal``) or writes a real
      tensor from deferred ones gets the deferred inputs' exact values by replay, and runs.
    * **Memory made real**: a deferred input over a storage an earlier ``materialize`` made
      real, with nothing recorded on it since, stands for that memory (``_on_real_memory``).
    * **Views** are not recorded: the output is a new ``TensorRecord`` (geometry, dtype) over
      the input's ``StorageRecord``, so everything done through any view lands on the storage.
    * **In-place view ops** (``t_``, ``squeeze_``, ``as_strided_``, ``set_``) change the
      tensor's own geometry: the same Python object gets the new metadata; no data is written.
    * **Everything else** becomes one ``OpRecord`` appended to the ``writes`` of each storage
      it creates (its non-aliasing outputs) or writes in place (``mutated`` arguments), in
      recording order (``seq``), with the storages it ``reads`` as of that moment.

    See :func:`record_op` for what an ``OpRecord`` holds.
    """
    if not isinstance(func, torch._ops.OpOverload):
        raise UnsupportedOperatorError(f"{func} is not an ATen operator; it cannot be deferred")
    if func.is_view and args and type(args[0]) is DeferredTensor:
        return record_view(func, args, kwargs)
    query = METADATA_QUERIES.get(func)
    if query is not None:  # ``is_pinned()``: metadata only, never values
        return query(*args, **kwargs)
    flat = iter_args(args, kwargs)
    real = realized_inputs(flat)
    if real is not None:  # views of memory made real: see ``_on_real_memory``
        done, args, kwargs = _on_real_memory(func, args, kwargs, flat, real)
        if done is not _RECORD:
            return done
        flat = iter_args(args, kwargs)
    if func in OVERWRITES_SELF and type(args[0]) is DeferredTensor:
        made = record_fill(func, args, kwargs)
        if made is not None:
            return made
    if func in recipe_funcs and tls.pending_device is not None:
        made = record_from_recipe(func, args, kwargs)
        if made is not None:
            return made
    has_deferred = DeferredTensor in [type(x) for x in flat] or any(
        isinstance(x, DeferredTensor) for x in flat
    )
    if not has_deferred:
        if func is aten.lift_fresh.default:
            return wrap_constant(args[0], output_device(kwargs, flat))
        if _on_meta(kwargs, flat):
            # PyTorch's own meta device, asked for explicitly (`with torch.device("meta")`, as
            # transformers builds a model before loading it): plain meta tensors, as eagerly;
            # random ops on them draw nothing.
            with plain():
                return func(*args, **kwargs)
        if _not_strided_input(flat):
            return _on_real_sparse(func, args, kwargs)
    info = op_info(func)
    bound = bind_arguments(func, args, kwargs)
    # Every tensor the op writes: ``Tensor(a!)``, each element of ``Tensor(a!)[]`` (the
    # ``_foreach_*_`` ops, fused optimizers, ``out=`` lists) and undeclared writes.
    written = [
        t
        for i in info.written(bound)
        for t in (bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]])
        if isinstance(t, torch.Tensor)
    ]
    mutated_real = any(not isinstance(t, DeferredTensor) for t in written)
    mutated_deferred = any(isinstance(t, DeferredTensor) for t in written)
    if not has_deferred:
        if mutated_real or func.is_view or not info.returns_tensors:
            if info.is_random:
                # Real random work: the generator must be where eager code has it.
                before_real_draw(_generator_argument(info, bound))
            with plain():
                return func(*args, **kwargs)
    elif mutated_real or (not info.returns_tensors and not mutated_deferred):
        # Values needed now. (An op that returns nothing but writes deferred tensors, as
        # ``_foreach_mul_`` and the fused optimizers do, is recorded like any in-place op.)
        if info.is_random:
            before_real_draw(_generator_argument(info, bound))
        if mutated_deferred:
            return run_on_values_and_record_writes(func, args, kwargs, written)
        return run_on_values(func, args, kwargs)
    if _makes_quantized(func, kwargs):
        raise UnsupportedOperatorError(
            f"{func} makes a quantized tensor, which cannot be deferred (called at "
            f"{call_site()}; e.g. torch.ao.quantization.quantize_dynamic on a deferred model). "
            "Materialize first (jupyter_metainit.materialize(model)), then quantize; or build "
            "the quantized tensor outside meta_init"
        )
    if info.is_inplace_view:
        return inplace_view(func, info, bound, args, kwargs)
    return record_op(func, info, bound, flat, args, kwargs)


_RECORD = object()  # ``_on_real_memory``'s answer when the op goes on to be recorded


def _on_real_memory(
    func: Any, args: tuple, kwargs: dict, flat: list, real: dict[int, torch.Tensor]
) -> tuple[Any, tuple, dict]:
    """An op with deferred inputs over memory an earlier ``materialize`` made real (``real``:
    the real view each stands for, by ``id``), as eager code runs it on that memory.

    If its other tensor inputs are all real, it runs now (a random one from the real
    generator, where eager code has it) and its result is returned, with ``args`` and
    ``kwargs``; inside ``meta_init`` the views become the real tensors they stand for, and
    the block's rules for real inputs apply (a write or a read of values runs now, a new
    tensor is recorded). Else (other deferred inputs, or a device change being recorded) it
    is ``_RECORD`` with the arguments to record the op with (``reads.realized_as_constants``).
    """
    info = op_info(func)
    if info.is_inplace_view:  # ``t_()``, ``set_()``: the deferred tensor's own geometry
        return _RECORD, args, kwargs
    bound = bind_arguments(func, args, kwargs)
    others = any(
        isinstance(x, DeferredTensor) and (id(x) not in real or own_grad_leaf(x)) for x in flat
    )
    if not others and tls.depth > 0:  # the real tensors they stand for, under meta_init's rules
        args, kwargs = realized_as_constants(args, kwargs, real, set(real))
        return _RECORD, args, kwargs
    if not others and tls.pending_device is None:
        if info.is_random:
            before_real_draw(_generator_argument(info, bound))
        return run_on_real_memory(func, args, kwargs, real), args, kwargs
    written = {
        id(t)
        for i in info.written(bound)
        for t in (bound[i] if isinstance(bound[i], (list, tuple)) else [bound[i]])
        if isinstance(t, DeferredTensor)
    }
    args, kwargs = realized_as_constants(args, kwargs, real, written)
    return _RECORD, args, kwargs


_QUANTIZED_DTYPES = frozenset(
    {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)


def _makes_quantized(func: Any, kwargs: dict) -> bool:
    """Whether ``func`` returns a quantized tensor (``quantize_per_tensor``,
    ``_empty_affine_quantized``, a factory with a quantized dtype): replay has no way to make
    one (its values are integers plus scales, and they copy into no plain tensor)."""
    by_name = _quantizing.get(func)
    if by_name is None:
        name = func._schema.name.split("::")[-1]
        if "fake_quantize" in name:  # returns a float tensor: recorded like any op
            by_name = _quantizing[func] = _NEVER
        elif name.startswith("quantize_per") or "affine_quantized" in name:
            by_name = _quantizing[func] = _ALWAYS
        else:
            by_name = _quantizing[func] = _BY_DTYPE
    if by_name is _BY_DTYPE:
        return kwargs.get("dtype") in _QUANTIZED_DTYPES
    return by_name is _ALWAYS


# What an op's name says about its result, per overload (read once): quantized always, never
# (``fake_quantize``), or when its ``dtype`` argument is a quantized dtype.
_ALWAYS, _NEVER, _BY_DTYPE = "always", "never", "by dtype"
_quantizing: dict[Any, str] = {}


def _generator_argument(info: OpInfo, bound: list) -> torch.Generator | None:
    gen = bound[info.arg_index("generator")] if info.has_generator else None
    return gen if isinstance(gen, torch.Generator) else None


def _not_strided_input(flat: list) -> bool:
    """Whether a (real) input is sparse or nested: those stay real inside ``meta_init``."""
    return any(
        isinstance(x, torch.Tensor) and (x.layout is not torch.strided or x.is_nested) for x in flat
    )


def _on_real_sparse(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op on real sparse or nested tensors and no deferred one (``adj.coalesce()``, the
    ``clone`` a dry run makes of a sparse buffer): such tensors made inside ``meta_init`` are
    computed at once and stay real CPU tensors, so ops on them alone run now, as eagerly."""
    target = tls.pending_device  # ``adj.to(device=...)``: the call was rewritten to meta
    if target is not None and target.type != "cpu":
        raise UnsupportedOperatorError(
            f"{func} would move a sparse or nested tensor to {target} inside meta_init (called "
            f"at {call_site()}); such tensors stay real CPU tensors there: move it after "
            "materializing, or outside the block"
        )
    if target is not None and "device" in kwargs:
        kwargs = {**kwargs, "device": target}
    with plain():
        return func(*args, **kwargs)


def _on_meta(kwargs: dict, flat: list) -> bool:
    """An op on meta tensors, or a factory told ``device="meta"`` (not by our own rewrite)."""
    if tls.pending_device is not None:
        return False  # the call named a real device; `meta` is our rewrite of it
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if tensors:
        return all(t.is_meta for t in tensors)
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"
