"""What each part needs besides its weights, measured by running the workload on nothing.

One dry run of the model at the planned batch and sequence length (inference in eval mode,
training in training mode) gives, per part, the live activation bytes while it runs
(:func:`~jupyter_metainit.estimates.dry_run` follows them op by op) and, for inference with a
cache, the model's own cache object, whose tensors are measured layer by layer. For training,
the whole step then runs once more on meta tensors with autograd on (``forward/saved.py``), the
values it reads answered with the dry run's: per part what autograd saves for the backward
pass, the most alive while it runs forward and while its backward runs, and its gradients.
Where the whole step cannot run on meta tensors, each distinct part runs alone (a repeated
block once for its whole group) and the code between parts is estimated. Attention is costed
as ``AttentionPolicy`` says (the planned devices' kernels). A part of a module's own tensors
(``own_only``) runs no forward of its own: it keeps its place in module order (before the
module's children) and has no activations of its own.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jupyter_metainit.core.errors import ArgumentError, MetaInitError
from jupyter_metainit.estimates.dry_run import run_forward
from jupyter_metainit.estimates.forward.answers import Answers
from jupyter_metainit.estimates.forward.attention import AttentionPolicy, transformers_attention
from jupyter_metainit.estimates.forward.nested import cache_of, tensor_bytes_in
from jupyter_metainit.estimates.forward.saved import (
    each_alone,
    estimate_note,
    shapes_of,
    trace_step,
)
from jupyter_metainit.estimates.forward.shape_inputs import ShapeInput, input_names, typed
from jupyter_metainit.estimates.memory import DRY_RUN_ATTR
from jupyter_metainit.plan.parts import Part, describe

__all__ = [
    "Activity",
    "activation_dtype",
    "check_takes_token_ids",
    "eval_mode_notes",
    "measure",
]


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
    # the most its backward holds beyond its weights' gradients (saved activations included)
    backward: dict[str, int] = field(default_factory=dict)
    attention: dict[str, Any] = field(default_factory=dict)  # how the dry run costed attention


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


def _workload_kwargs(
    model: nn.Module, training: bool, args: tuple, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """What the planned call adds to the user's inputs: ``use_cache`` for inference, and for
    training the ``labels`` the forward takes when none are given (:func:`_labels`)."""
    added: dict[str, Any] = {}
    if _accepts(model, "use_cache"):
        added["use_cache"] = not training
    names = input_names(model)
    given = "labels" in kwargs or ("labels" in names and names.index("labels") < len(args))
    if training and _accepts(model, "labels") and not given:
        labels = _labels(model, args, kwargs)
        if labels is not None:
            added["labels"] = labels
    return added


# transformers' heads with one label per sample (the rest take one per token).
_PER_SAMPLE = re.compile(r"For(Sequence|Image|Audio|Video)Classification$|ForMultipleChoice$")


def _labels(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> ShapeInput | None:
    """The labels a training step of ``model`` takes, as transformers' heads compute their
    loss: one class per sample for a sequence, image, audio or video classifier (``(batch,)``;
    floats for a regression head, ``(batch, num_labels)`` floats for a multi-label one or a
    regression of several values), else one token id per decoder (or input) token, the ids'
    shape. None where the inputs have no token ids to copy (a vision or audio model that is no
    classifier: its loss, if any, then comes from its output)."""
    names = [*input_names(model), *[None] * len(args)]
    shaped = [(n, v) for n, v in [*zip(names, args, strict=False), *kwargs.items()] if _shape_of(v)]
    if not shaped:
        return None
    batch = _shape_of(shaped[0][1])[0]  # type: ignore[index]
    if _PER_SAMPLE.search(type(model).__name__):
        config = getattr(model, "config", None)
        problem = getattr(config, "problem_type", None)
        num_labels = getattr(config, "num_labels", 2)
        regression = problem == "regression" or (problem is None and num_labels == 1)
        if problem == "multi_label_classification" or (regression and num_labels > 1):
            return ShapeInput((batch, num_labels), activation_dtype(model))
        return ShapeInput((batch,), activation_dtype(model) if regression else torch.long)
    by_name = dict(shaped)
    ids = [by_name[n] for n in ("decoder_input_ids", "input_ids") if n in by_name]
    ids += [v for _, v in shaped if getattr(v, "dtype", None) == torch.long]
    return ShapeInput(_shape_of(ids[0]), torch.long) if ids else None  # type: ignore[arg-type]


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of an input given as a shape or a tensor, else None."""
    if isinstance(value, ShapeInput):
        return value.shape
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return tuple(value.shape)
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
                    p.name: tensor_bytes_in(layer) for p, layer in zip(members, layers, strict=True)
                }
    total = tensor_bytes_in(cache)
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


def _run(
    model: nn.Module,
    parts: list[Part],
    training: bool,
    inputs: tuple,
    kwargs: dict,
    policy: AttentionPolicy,
) -> tuple[dict[str, int], dict[str, tuple], Any, Answers]:
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
                    specs[name] = (shapes_of(args), shapes_of(kw))

        return pre

    for part in parts:
        if part.own_only:  # its module's forward is its children's and more: not this part's
            continue
        handles.append(part.module.register_forward_pre_hook(noting(part.name), with_kwargs=True))
    handles.append(model.register_forward_hook(lambda m, a, out: caught.append(out)))
    try:
        with _mode(model, training):
            try:
                answers = run_forward(
                    model, *inputs, flops=False, reuse_repeats=True, attention=policy, **kwargs
                )
            except Exception as e:  # say which step failed, and what usually helps
                on_meta = any(p.is_meta for p in model.parameters())
                hint = (
                    "; a model on the meta device cannot run code that reads values: build it "
                    "under meta_init()"
                    if on_meta
                    else "; dry_run(model, ...) shows the same"
                )
                first = str(e).splitlines()[0] if str(e) else ""
                raise MetaInitError(
                    f"place(): the dry run of the workload failed ({type(e).__name__}: "
                    f"{first}){hint}"
                ) from e
    finally:
        for handle in handles:
            handle.remove()
    return order, specs, caught[0] if caught else None, answers


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


def measure(
    model: nn.Module,
    parts: list[Part],
    *,
    training: bool,
    inputs: tuple,
    kwargs: dict | None = None,
    attention: AttentionPolicy | None = None,
) -> Activity:
    """Run the workload once (dry run, plus meta forwards and backwards for training), its
    attention costed as ``attention`` says, and split what it needs over ``parts``."""
    start = time.perf_counter()
    policy = attention or AttentionPolicy()
    inputs, kwargs = typed(model, inputs, kwargs)
    kwargs = {**_workload_kwargs(model, training, inputs, kwargs), **kwargs}
    activity = Activity(notes=[])
    with _every_layer(model) as dropping:
        if dropping and training:
            activity.notes.append(
                "layerdrop is costed with no layer dropped: the most a training step needs"
            )
        _measure(model, parts, training, (inputs, kwargs), policy, activity)
    activity.dtype = activation_dtype(model)
    activity.seconds = time.perf_counter() - start
    return activity


_LAYERDROPS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


@contextlib.contextmanager
def _every_layer(model: nn.Module) -> Iterator[bool]:
    """LayerDrop off while measuring (transformers' ``layerdrop`` of a module or of its
    config): a step that drops no layer is the one that needs the most, and a plan measures
    one draw of it otherwise. Yields whether any was on."""
    changed: list[tuple[Any, str, float]] = []
    seen: set[int] = set()
    for m in model.modules():
        for holder in (m, getattr(m, "config", None)):
            if holder is None or id(holder) in seen:
                continue
            seen.add(id(holder))
            for name in _LAYERDROPS:
                rate = getattr(holder, name, None)
                if isinstance(rate, float) and rate > 0:
                    changed.append((holder, name, rate))
                    setattr(holder, name, 0.0)
    try:
        yield bool(changed)
    finally:
        for holder, name, rate in changed:
            setattr(holder, name, rate)


def _measure(
    model: nn.Module,
    parts: list[Part],
    training: bool,
    workload: tuple[tuple, dict],
    policy: AttentionPolicy,
    activity: Activity,
) -> None:
    """``measure``'s figures, into ``activity``: the dry run's per part, then the step's."""
    inputs, kwargs = workload
    order, specs, output, answers = _run(model, parts, training, inputs, kwargs, policy)
    activity.cache = _cache_per_part(cache_of(output), parts) if not training else {}
    # Execution order; a part the forward never ran keeps its place after its predecessor.
    rank: dict[str, float] = {}
    last = -1.0
    for part in parts:
        last = order[part.name] if part.name in order else last + 1e-6
        rank[part.name] = last
    ranked = sorted(parts, key=lambda p: rank[p.name])
    activity.order = [p.name for p in ranked]
    peak = {
        p.name: 0 if p.own_only else int(_record(p.module).get("peak_activation_bytes", 0))
        for p in parts
    }
    before = 0
    for part in ranked:
        activity.transient[part.name] = max(0, peak[part.name] - before)
        before += activity.cache.get(part.name, 0)
    # What the model's own code does outside every part (a loss on the logits) counts on the
    # part that ran last.
    run = _record(model)["run"]
    activity.attention = dict(run.get("attention") or {})
    outside = int(run["peak_activation_bytes"]) - max(peak.values(), default=0)
    ran = [p for p in ranked if not p.own_only] or ranked  # the last one holds what follows
    if outside > 0 and ran:
        name = ran[-1].name
        activity.transient[name] = max(
            activity.transient[name], int(run["peak_activation_bytes"]) - before
        )
    if training and ran:
        _measure_step(model, parts, activity, specs, (inputs, kwargs, answers), policy, output)


def _measure_step(
    model: nn.Module,
    parts: list[Part],
    activity: Activity,
    specs: dict[str, tuple],
    workload: tuple[tuple, dict, Answers],
    policy: AttentionPolicy,
    output: Any,
) -> None:
    """The training step's figures per part: the whole step traced on meta tensors, or where
    the model's whole forward cannot run on them, each part alone (code between parts, such
    as a loss, then estimated)."""
    args = [_spec(a) for a in workload[0]]
    kwargs = {k: _spec(v) for k, v in workload[1].items()}
    runs = [(p.name, p.module) for p in parts if not p.own_only]
    owners: dict[int, str] = {}
    for part in parts:  # a tied tensor is its leader's, as the costs count it
        for member in [part, *part.followers] if part.leader is None else []:
            for t in member.tensors():
                owners.setdefault(id(t), member.name)
    with transformers_attention(model) as forced, _mode(model, True):
        try:
            figures = trace_step(model, runs, owners, args, kwargs, policy, workload[2], forced)
        except Exception as e:  # each part alone, then
            activity.notes.append(estimate_note("the training step", e, whole=True))
            units = [(p.name, p.module, p.group, specs[p.name]) for p in parts if p.name in specs]
            alone, failed = each_alone(units, policy, forced, activity.transient)
            for part in parts:
                activity.saved[part.name], activity.backward[part.name] = alone.get(
                    part.name, (0, 0)
                )
            activity.notes += [estimate_note(describe(name), error) for name, error in failed]
            ran = [p for p in parts if p.name in specs]
            if ran:
                last = max(ran, key=lambda p: activity.order.index(p.name))
                _add_loss(activity, last, _loss_keeps(output, last))
            return
    total = sum(figures.grads.values())
    saved_before = grads_upto = 0
    for name in activity.order:
        saved, grads = figures.saved.get(name, 0), figures.grads.get(name, 0)
        grads_upto += grads
        if name in figures.forward:  # its turn's peak, less what the parts before it saved
            activity.transient[name] = max(0, figures.forward[name] - saved_before)
        # ... and going backward, less those and the other parts' gradients
        activity.backward[name] = (
            figures.backward[name] - saved_before - (total - grads_upto) - grads
            if name in figures.backward
            else saved
        )
        activity.saved[name] = saved
        saved_before += saved


def _spec(value: Any) -> Any:
    """An input as the meta trace takes it (``shapes_of``'s form)."""
    if isinstance(value, ShapeInput):
        return ("tensor", value.shape, value.dtype)
    return shapes_of(value)


def _add_loss(activity: Activity, last: Part, loss: int) -> None:
    """A loss computed by the model's own code after the parts keeps cross-entropy's
    log-softmax for backward; its backward, before the last part's, holds that and the
    gradients of the log-softmax and of the logits at once."""
    name = last.name
    activity.saved[name] += loss
    activity.backward[name] = max(activity.backward[name], activity.saved[name] + 2 * loss)
    activity.transient[name] = max(activity.transient[name], 2 * loss)


_DROPOUTS = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def eval_mode_notes(model: nn.Module) -> list[str]:
    """An inference plan is for ``model.eval()``: say so when the model is in training mode
    with dropout, whose forward then holds more (and on the CPU runs SDPA's math kernel)."""
    if not model.training:
        return []
    for m in model.modules():
        rates = (
            [getattr(m, "p", 0.0)]
            if isinstance(m, _DROPOUTS)
            else [getattr(m, name, 0.0) for name in ("attention_dropout", "dropout")]
        )
        if any(isinstance(r, float) and r > 0 for r in rates):
            return [
                "the model is in training mode: this inference plan is for model.eval(); a "
                "forward in training mode runs dropout and needs more (on the CPU, attention "
                "with dropout runs SDPA's math kernel, which holds the [batch, heads, queries, "
                "keys] scores): call model.eval() before inference"
            ]
    return []


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.get_default_dtype()
