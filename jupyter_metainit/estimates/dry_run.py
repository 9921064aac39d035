"""Run a model's forward pass on deferred inputs: shapes, activations and FLOPs, no memory.

Use :func:`dry_run` to learn what a forward pass would produce and cost before allocating
anything, and to infer the shapes of lazy modules (``nn.LazyLinear`` ...) on a deferred model.
The parts of the run live in ``estimates/forward/``; this module turns the inputs into
stand-ins, runs the forward once under them and leaves the figures on the modules.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.flop_counter import FlopCounterMode

from jupyter_metainit.core import dtype_name, meta_init, parse_dtype, tensor_state
from jupyter_metainit.estimates._arguments import check_flag, check_shapes, require_module
from jupyter_metainit.estimates.forward.activations import ActivationTracker, ModuleStack
from jupyter_metainit.estimates.forward.answers import Answers
from jupyter_metainit.estimates.forward.attention import (
    AttentionKernels,
    AttentionPolicy,
    devices_of,
    tally_record,
    transformers_attention,
)
from jupyter_metainit.estimates.forward.flops import flop_counter, flops_by_module
from jupyter_metainit.estimates.forward.model_guard import ModelGuard
from jupyter_metainit.estimates.forward.nested import map_tensors, tensors_in
from jupyter_metainit.estimates.forward.reuse import BlockReuse, ReuseMismatch
from jupyter_metainit.estimates.forward.shape_inputs import (
    ShapeInput,
    default_input_dtype,
    stand_in_tensor,
    typed,
)
from jupyter_metainit.estimates.memory import DRY_RUN_ATTR, MemoryTable, memory_table

__all__ = ["default_input_dtype", "dry_run", "run_forward"]


def _uses_meta(module: nn.Module) -> bool:
    """True for models built on the ``meta`` device (uninitialized lazy tensors do not count)."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta and not is_lazy(t) for t in tensors)


def _stand_in_inputs(
    example_inputs: tuple, kwargs: dict, use_meta: bool
) -> tuple[list[Any], dict[str, Any]]:
    """The run's inputs: shapes (``ShapeInput``) become tensors of their dtype and value;
    tensors become copies (deferred inside ``meta_init``, meta tensors on the meta path),
    never the caller's: an in-place op of the forward (``ReLU(inplace=True)``) must not write
    (or record a write on) them."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if use_meta:
            return torch.empty_like(t, device="meta")
        return t.detach().clone() if tensor_state(t) == "deferred" else torch.empty_like(t)

    def stand_in(value: Any) -> Any:
        if isinstance(value, ShapeInput):
            return stand_in_tensor(value, "meta" if use_meta else None)
        return map_tensors(value, convert)

    return [stand_in(a) for a in example_inputs], {k: stand_in(v) for k, v in kwargs.items()}


def _input_shape(obj: Any) -> Any:
    """An input given as a shape as the run's record names it: the shape, else its label."""
    return obj.shape if isinstance(obj, ShapeInput) else _input_label(obj)


def _input_label(obj: Any) -> Any:
    """How the run's record names an input: a tensor's shape and dtype, else its type."""
    if isinstance(obj, ShapeInput):
        return f"{obj.shape} {dtype_name(obj.dtype)}"
    if isinstance(obj, torch.Tensor):
        return f"{tuple(obj.shape)} {dtype_name(obj.dtype)}"
    return type(obj).__name__


def _leave_records(
    module: nn.Module,
    modules: ModuleStack,
    tracker: ActivationTracker,
    flop_by_name: dict[str, int] | None,
    run: dict[str, Any],
) -> None:
    """Each module keeps its own figures (plain numbers and shapes, no tensors), so tables of
    submodules show them too; modules this forward did not reach lose stale figures."""
    for name, mod in module.named_modules():
        if name in modules.shapes:
            record = {
                "output_shape": modules.shapes[name],
                "activation_bytes": modules.out_bytes.get(name, 0),
                "flops": None if flop_by_name is None else flop_by_name.get(name, 0),
                "peak_activation_bytes": tracker.module_peak.get(name, 0),
            }
            if mod is module:
                record["run"] = run
            object.__setattr__(mod, DRY_RUN_ATTR, record)
        else:
            mod.__dict__.pop(DRY_RUN_ATTR, None)


def dry_run(
    module: nn.Module,
    *example_inputs: Any,
    input_dtype: torch.dtype | str | None = None,
    flops: bool = True,
    **kwargs: Any,
) -> MemoryTable:
    """Run ``module(*example_inputs, **kwargs)`` on deferred tensors and record what it costs.

    Use it to learn output shapes, activation sizes, FLOPs and peak forward memory of a model
    (deferred, partially materialized or real) without allocating activations, and to infer
    the shapes of lazy modules on a deferred model. Lazy modules built inside ``meta_init``
    keep their inferred shapes and their initialization is recorded, so materializing them
    afterwards equals an eager forward with the same seed; any other model, lazy modules
    included, is left exactly as it was.

    The forward runs under ``torch.no_grad()`` with forward hooks (output shapes and bytes per
    module) and ``torch.utils.flop_counter.FlopCounterMode`` (FLOPs per module, subtree
    inclusive). Live activation bytes are followed op by op (every tensor the forward makes,
    masks and position ids included); a module's peak is the largest live activation total
    seen while it runs (including what its callers keep alive, e.g. the KV cache and residual
    stream). The model runs in the mode it is in (``model.eval()`` first for inference).
    ``scaled_dot_product_attention`` runs as the device the model's tensors report would run
    it: on the CPU its flash kernel, or its math kernel (which holds the ``[batch, heads,
    queries, keys]`` scores) where the flash kernel refuses the call (dropout); on the meta
    device, whose real device is unknown, the math kernel. The record's ``"attention"``
    (``table.attrs["dry_run"]``) says how many calls were costed each way, and why math.
    Results are stored on ``module`` keyed by qualified name and appear in later
    :func:`memory_table` calls too. The model's own forward hooks run as in eager, and see the
    run's tensors: deferred tensors (meta tensors for a model on the meta device) standing in for
    its weights and activations, never real values.

    Args:
        module: the model: deferred, partly materialized or real.
        *example_inputs: the forward's positional inputs: real tensors (converted with
            ``torch.empty_like`` inside ``meta_init``, dtype kept), deferred tensors, or
            shapes (``(1, 4096)`` or ``torch.Size``), which become deferred tensors of
            ``input_dtype``.
        input_dtype: the dtype of inputs given as shapes (a ``torch.dtype`` or its name,
            ``"float16"``); default: what the name of the forward's parameter at that
            position says, as transformers names them: ``torch.long`` for ids, labels and
            attention masks (``input_ids``, ``token_type_ids``, ``labels``,
            ``attention_mask``: masks hold ones), the model's floating dtype (its first
            floating parameter's) for ``pixel_values``, ``input_features``,
            ``inputs_embeds`` and other ``*_values`` / ``*_features`` / ``*_embeds``; a name
            that says neither (``x``, ``input``): ``torch.long`` when the model starts with
            an ``nn.Embedding``, else the model's floating dtype.
        flops: ``False`` skips the FLOP counter (about a third of the run's time on a large
            model): the ``flops`` column is then empty; every other figure is the same.
        **kwargs: keyword arguments of ``forward`` (tensors in them are converted as the
            inputs are).

    Returns:
        ``memory_table(module)`` with the columns ``output_shape``, ``activation_bytes``,
        ``flops`` and ``peak_forward_bytes`` (the subtree's weights + its peak of live
        activations).

    Raises:
        ArgumentTypeError: ``module`` is not an ``nn.Module``.
        ArgumentError: an unknown ``input_dtype``.
        Exception: what the model's forward raises for these inputs (a shape mismatch), as
            in eager; the model is left as it was.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import dry_run, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
        >>> table = dry_run(model, (8, 1024))  # a batch of 8, as a shape: nothing allocated
        >>> table[["output_shape", "activation_bytes", "flops"]]
               output_shape  activation_bytes      flops
        module
                  (8, 1024)             32768  134217728
        0         (8, 4096)            131072   67108864
        1         (8, 4096)            131072          0
        2         (8, 1024)             32768   67108864
    """
    require_module(module, "dry_run")
    check_flag(flops, "flops")
    check_shapes(example_inputs, "dry_run(example_inputs)")
    run_forward(module, *example_inputs, input_dtype=input_dtype, flops=flops, **kwargs)
    return memory_table(module)


def run_forward(
    module: nn.Module,
    *example_inputs: Any,
    input_dtype: torch.dtype | str | None = None,
    flops: bool = True,
    reuse_repeats: bool = False,
    attention: AttentionPolicy | None = None,
    **kwargs: Any,
) -> Answers:
    """:func:`dry_run` without its table: the figures are left on the modules only (for
    callers that read them directly and would otherwise pay for a table they do not use).
    Returns what the forward read of values, for a later meta run of it (``answers.py``).

    ``reuse_repeats=True`` measures the first of identical repeated blocks op by op and
    reuses its figures for the others, which still run (``forward/reuse.py`` says when blocks
    count as identical); the figures are the same as without it, in a fraction of the time
    on a deep model. Where a reused block turns out to run unlike its twin, the run starts
    over with every block tracked.

    ``attention``: the devices (and compute dtype) whose attention kernels the run costs
    (``forward/attention.py``); default: the device the model's tensors report."""
    policy = attention or AttentionPolicy(devices=devices_of(module))
    if reuse_repeats:
        try:
            return _run_once(module, example_inputs, input_dtype, flops, kwargs, policy, reuse=True)
        except ReuseMismatch:
            pass
    return _run_once(module, example_inputs, input_dtype, flops, kwargs, policy, reuse=False)


def _run_once(
    module: nn.Module,
    example_inputs: tuple,
    input_dtype: torch.dtype | str | None,
    flops: bool,
    kwargs: dict,
    policy: AttentionPolicy,
    reuse: bool,
) -> Answers:
    use_meta = _uses_meta(module)
    example_inputs, _ = typed(module, example_inputs, None, parse_dtype(input_dtype, "input_dtype"))
    ctx: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext() if use_meta else meta_init()
    )
    modules = ModuleStack(module)
    tracker = ActivationTracker(modules.stack)
    tracker.answers = answers = Answers()
    start = time.perf_counter()
    counter: contextlib.AbstractContextManager[Any] = (
        flop_counter() if flops else contextlib.nullcontext()
    )
    reuse_blocks = BlockReuse(module, tracker) if reuse else None
    guard = ModelGuard(module, (example_inputs, kwargs))
    try:
        with ctx, transformers_attention(module) as forced:
            guard.swap_in_stand_ins(on_meta=use_meta)
            args, kw = _stand_in_inputs(example_inputs, kwargs, use_meta)
            for t in tensors_in((args, kw)):
                tracker.track(t)
            reusing = reuse_blocks or contextlib.nullcontext()
            kernels = AttentionKernels(policy, forced)
            with torch.no_grad(), modules.hooks(), counter, tracker, reusing, kernels, answers:
                tracker.note_peak()
                output = module(*args, **kw)
            if reuse_blocks is not None and reuse_blocks.mismatch:
                raise ReuseMismatch("a reused block's mismatch was caught by the model's code")
            out_shapes = [tuple(t.shape) for t in tensors_in(output)]
            del output, args, kw
    finally:
        guard.restore()
    seconds = time.perf_counter() - start
    tracker.tensors.clear()
    tracker.index.clear()

    known = set(modules.names.values())
    run = {
        "inputs": [_input_shape(a) for a in example_inputs],
        "kwargs": {k: _input_label(v) for k, v in kwargs.items()},
        "output_shapes": out_shapes,
        "flops": int(counter.get_total_flops()) if isinstance(counter, FlopCounterMode) else None,
        "peak_activation_bytes": tracker.peak,
        "seconds": seconds,
        "attention": tally_record(kernels.tally),
    }
    by_module = (
        flops_by_module(counter, module, set(modules.shapes), known)
        if isinstance(counter, FlopCounterMode)
        else None
    )
    _leave_records(module, modules, tracker, by_module, run)
    return answers
