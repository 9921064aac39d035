"""What each part needs besides its weights, measured by running the workload on nothing.

One dry run of the model at the planned batch and sequence length gives, per part, the live
activation bytes while it runs (:func:`~jupyter_metainit.estimates.dry_run` follows them op by
op) and, for inference with a cache, the model's own cache object, whose tensors are measured
layer by layer. For training, each distinct part then runs forward once more on meta tensors
with autograd on, and what autograd saves for the backward pass is counted (a repeated block
is measured once for its whole group). A part of a module's own tensors (``own_only``) runs no
forward of its own: it keeps its place in module order (before the module's children) and has
no activations of its own.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.estimates.dry_run import run_forward
from jupyter_metainit.estimates.memory import DRY_RUN_ATTR
from jupyter_metainit.plan.parts import Part, describe

__all__ = ["Activity", "activation_dtype", "check_takes_token_ids", "measure"]

# How deep a cache object is searched for its tensors (Cache -> layers -> keys).
_CACHE_DEPTH = 6


@dataclass
class Activity:
    """Per part (by name): the activation peak while it runs minus the caches of parts that ran
    before it (``transient``), the cache it keeps (``cache``), what autograd saves for its
    backward (``saved``); ``order``: parts in the order the forward ran them."""

    transient: dict[str, int] = field(default_factory=dict)
    cache: dict[str, int] = field(default_factory=dict)
    saved: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    dtype: torch.dtype = torch.float32  # the activations' dtype in the measured run
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def _accepts(module: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def check_takes_token_ids(model: nn.Module) -> None:
    """``seq_len=`` makes token ids for a language model; refuse, saying what to pass instead,
    a model whose forward takes no ``input_ids`` and that does not start with an embedding
    (a vision or audio model: its dry run would fail on ids, or measure the wrong thing)."""
    if _accepts(model, "input_ids"):
        return
    for m in model.modules():
        if next(iter(m._modules.values()), None) is None and m._parameters:
            if isinstance(m, nn.Embedding):
                return
            break
    try:
        takes = ", ".join(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        takes = "..."
    raise ArgumentError(
        f"place(..., seq_len=) runs the model on token ids of shape (batch, seq_len), but "
        f"{type(model).__name__}.forward({takes}) takes no input_ids and the model does not "
        "start with an embedding: pass its inputs as shapes instead, e.g. "
        "inputs=[(8, 3, 224, 224)] or inputs={'pixel_values': (8, 3, 224, 224)}"
    )


def _workload_kwargs(model: nn.Module, training: bool, ids: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = not training
    if training and _accepts(model, "labels") and isinstance(ids, tuple):
        # One real element seen as the shape: the dry run runs on an empty copy of it.
        kwargs["labels"] = torch.zeros((), dtype=torch.long).expand(ids)
    return kwargs


def _tensors_in(obj: Any, depth: int = 0, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Tensors reachable from a cache object (attributes, lists, tuples, dicts), each once."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > _CACHE_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, depth + 1, seen)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        for item in vars(obj).values():
            yield from _tensors_in(item, depth + 1, seen)


def _nbytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cache_of(output: Any) -> Any:
    """The cache object a model returned (transformers' ``cache`` / ``past_key_values``)."""
    if isinstance(output, Mapping):
        present = list(output.keys())  # the fields set (reading others warns in transformers)
        for key in ("cache", "past_key_values", "cache_params"):
            if key in present and output[key] is not None:
                return output[key]
    return None


def _cache_per_part(cache: Any, parts: list[Part]) -> dict[str, int]:
    """Cache bytes per part: layer i of the cache belongs to the i-th block of the group with
    as many blocks as the cache has layers; a cache without layers is spread evenly."""
    if cache is None:
        return {}
    layers = getattr(cache, "layers", cache if isinstance(cache, (list, tuple)) else None)
    groups: dict[str, list[Part]] = {}
    for part in parts:
        if part.group:
            groups.setdefault(part.group, []).append(part)
    if isinstance(layers, (list, tuple)):
        for members in groups.values():
            if len(members) == len(layers):
                return {
                    p.name: _nbytes(_tensors_in(layer))
                    for p, layer in zip(members, layers, strict=True)
                }
    total = _nbytes(_tensors_in(cache))
    holders = max(groups.values(), key=len) if groups else [p for p in parts if not p.own_only]
    return {p.name: total // len(holders) for p in holders}


@contextlib.contextmanager
def _mode(model: nn.Module, training: bool) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _spec(obj: Any) -> Any:
    """Shapes and dtypes of the tensors in a part's inputs (no values, nothing kept alive)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_spec(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _spec(v) for k, v in obj.items()}
    return obj


def _on_meta(spec: Any, grad: bool) -> Any:
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "tensor":
        t = torch.empty(spec[1], dtype=spec[2], device="meta")
        return t.requires_grad_(grad and spec[2].is_floating_point)
    if isinstance(spec, (list, tuple)):
        return type(spec)(_on_meta(s, grad) for s in spec)
    if isinstance(spec, dict):
        return {k: _on_meta(v, False) for k, v in spec.items()}
    return spec


class _FusedAttention(TorchFunctionMode):
    """Attention as the fused kernels run it (what CUDA's flash/efficient kernels and the CPU's
    flash kernel save for backward: inputs, output, log-sum-exp), not the meta device's
    decomposition into matmul and softmax, which would also keep the attention matrix."""

    _FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self._FLASH is None:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa")  # fmt: skip
        bound = dict(zip(names, args, strict=False)) | kwargs
        # Grouped-query attention: the kernels read the shared key/value heads as they are.
        out, _ = self._FLASH(
            bound["query"],
            bound["key"],
            bound["value"],
            bound.get("dropout_p", 0.0),
            bound.get("is_causal", False),
            attn_mask=bound.get("attn_mask"),
            scale=bound.get("scale"),
        )
        return out


def _saved_bytes(module: nn.Module, args: Any, kwargs: Any) -> int:
    """Bytes autograd saves for the backward of one forward of ``module`` on meta tensors:
    each storage once, weights and buffers not counted (they are the part's own memory).
    Tied tensors are given once: ``functional_call`` ties their other names to them."""
    stand_ins = {
        n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(
            t.requires_grad and t.dtype.is_floating_point
        )
        for n, t in [
            *module.named_parameters(),
            *module.named_buffers(),
        ]
    }
    own = {t.untyped_storage()._cdata for t in stand_ins.values()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in own:
            storages[storage._cdata] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with torch.enable_grad(), hooks, _FusedAttention():
        out = functional_call(module, stand_ins, _on_meta(args, True), _on_meta(kwargs, False),
                              strict=False)  # fmt: skip
    del out
    return sum(storages.values())


def _run(model: nn.Module, parts: list[Part], training: bool, inputs: tuple, kwargs: dict
         ) -> tuple[dict[str, int], dict[str, tuple], Any]:  # fmt: skip
    """The dry run (no FLOPs, no table: the figures stay on the modules), with hooks noting
    the parts' order and inputs and the returned cache."""
    order: dict[str, int] = {}
    specs: dict[str, tuple] = {}
    caught: list[Any] = []
    handles = []

    def noting(name: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any, kw: Any) -> None:
            if name not in order:
                order[name] = len(order)
                if training:
                    specs[name] = (_spec(args), _spec(kw))

        return pre

    for part in parts:
        if part.own_only:  # its module's forward is its children's and more: not this part's
            continue
        handles.append(part.module.register_forward_pre_hook(noting(part.name), with_kwargs=True))
    handles.append(model.register_forward_hook(lambda m, a, out: caught.append(out)))
    try:
        with _mode(model, training):
            try:
                run_forward(model, *inputs, flops=False, reuse_repeats=True, **kwargs)
            except Exception as e:  # say which step failed, and what usually helps
                on_meta = any(p.is_meta for p in model.parameters())
                hint = (
                    "; a model on the meta device cannot run code that reads values: build it "
                    "under meta_init()"
                    if on_meta
                    else "; dry_run(model, ...) shows the same"
                )
                first = str(e).splitlines()[0] if str(e) else ""
                raise RuntimeError(
                    f"place(): the dry run of the workload failed ({type(e).__name__}: "
                    f"{first}){hint}"
                ) from e
    finally:
        for handle in handles:
            handle.remove()
    return order, specs, caught[0] if caught else None


def _loss_keeps(output: Any, last: Part) -> int:
    """What a loss computed by the model's own code keeps for backward: cross-entropy keeps
    the log-softmax of the logits (the last part's output) in float32 (transformers upcasts
    the logits first)."""
    if not isinstance(output, Mapping) or "loss" not in list(output.keys()):
        return 0
    shape = _record(last.module).get("output_shape")
    if not isinstance(shape, tuple) or not all(isinstance(d, int) for d in shape):
        return 0
    numel = 1
    for d in shape:
        numel *= d
    return 4 * numel


def _record(module: nn.Module) -> dict[str, Any]:
    """The figures the dry run left on ``module`` ({} where the forward did not reach it)."""
    return module.__dict__.get(DRY_RUN_ATTR) or {}


def measure(model: nn.Module, parts: list[Part], *, training: bool, inputs: tuple,
            kwargs: dict | None = None) -> Activity:  # fmt: skip
    """Run the workload once (dry run, plus meta forwards for training) and split what it
    needs over ``parts``."""
    start = time.perf_counter()
    ids = inputs[0] if len(inputs) == 1 else None
    kwargs = {**_workload_kwargs(model, training, ids), **(kwargs or {})}
    order, specs, output = _run(model, parts, training, inputs, kwargs)
    activity = Activity(notes=[])
    activity.cache = _cache_per_part(_cache_of(output), parts) if not training else {}
    by_module = list(parts)
    # Execution order; a part the forward never ran keeps its place after its predecessor.
    rank: dict[str, float] = {}
    last = -1.0
    for part in by_module:
        last = order[part.name] if part.name in order else last + 1e-6
        rank[part.name] = last
    ranked = sorted(by_module, key=lambda p: rank[p.name])
    activity.order = [p.name for p in ranked]
    peak = {
        p.name: 0 if p.own_only else int(_record(p.module).get("peak_activation_bytes", 0))
        for p in by_module
    }
    before = 0
    for part in ranked:
        activity.transient[part.name] = max(0, peak[part.name] - before)
        before += activity.cache.get(part.name, 0)
    # What the model's own code does outside every part (a loss on the logits) counts on the
    # part that ran last.
    root_peak = int(_record(model)["run"]["peak_activation_bytes"])
    outside = root_peak - max(peak.values(), default=0)
    ran = [p for p in ranked if not p.own_only] or ranked  # the last one holds what follows
    if outside > 0 and ran:
        name = ran[-1].name
        activity.transient[name] = max(activity.transient[name], root_peak - before)
    if training and ran:
        loss = _loss_keeps(output, ran[-1])
        _measure_saved(parts, specs, activity, max(0, outside, loss), ran[-1].name)
        # Its backward holds the gradients of the log-softmax and of the logits at once.
        last = ran[-1].name
        activity.transient[last] = max(activity.transient[last], 2 * loss)
    activity.dtype = activation_dtype(model)
    activity.seconds = time.perf_counter() - start
    return activity


def _measure_saved(
    parts: list[Part], specs: dict[str, tuple], activity: Activity, outside: int, last: str
) -> None:
    measured: dict[str, int] = {}
    for part in parts:
        if part.name not in specs:
            activity.saved[part.name] = 0
            continue
        if part.group and part.group in measured:  # identical blocks save the same
            activity.saved[part.name] = measured[part.group]
            continue
        args, kw = specs[part.name]
        try:
            saved = _saved_bytes(part.module, args, kw)
        except Exception as e:  # a part that cannot run on meta tensors: its live peak
            saved = activity.transient[part.name]
            activity.notes.append(_estimated_note(part.name, e))
        activity.saved[part.name] = saved
        if part.group:
            measured[part.group] = saved
    # The model's own code after the parts (a loss on the logits) keeps what it computed for
    # backward: what it adds to the peak, at least cross-entropy's log-softmax.
    if activity.order:
        activity.saved[last] += outside


def _estimated_note(name: str, error: Exception) -> str:
    """The plan's note for a part whose saved activations could not be measured."""
    reason = str(error).splitlines()[0].strip() if str(error).strip() else type(error).__name__
    if len(reason) > 160:
        reason = reason[:157] + "..."
    return (
        f"{describe(name)}: what it keeps for the backward pass is estimated by its forward "
        f"peak, because its forward could not run again on shape-only tensors ({reason})"
    )


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.get_default_dtype()
