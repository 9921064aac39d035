"""What a training step holds, measured on meta tensors: what autograd saves, and what is alive
while each part of a model runs forward and backward.

The planner runs a training workload's forward once more on meta stand-ins of the model's
weights and inputs with autograd on, then its backward from the loss (or from a gradient of
each output). A saved-tensors hook notes each storage autograd keeps, and every storage made
meanwhile is followed by weak reference, as PyTorch's ``MemTracker`` follows a real step: saved
tensors leave as the nodes that kept them run, temporaries come and go, the weights' gradients
stay. Forward hooks tell which part runs (code between parts counts for the part that started
last); a hook on each part's output's autograd node tells when its backward starts.

:func:`trace_step` runs the whole model; :func:`backward_figures` one module alone (for a model
whose whole forward cannot run on meta tensors: then the code between parts is not seen).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from jupyter_metainit.estimates.forward.answers import Answers, Replay, shapes_depend_on_values
from jupyter_metainit.estimates.forward.attention import AttentionKernels, AttentionPolicy
from jupyter_metainit.estimates.forward.dtype_checks import run_past_cuda_only_meta_checks
from jupyter_metainit.estimates.forward.nested import op_tensors, tensors_in

__all__ = [
    "StepFigures",
    "backward_figures",
    "each_alone",
    "estimate_note",
    "shapes_of",
    "trace_step",
]


@dataclass
class StepFigures:
    """Per part (by name), bytes of activations (weights, buffers and inputs not counted):
    ``saved`` (what autograd keeps for its backward, each storage once), ``forward`` /
    ``backward`` (the most alive while it runs forward / while its backward runs, everything
    included) and ``grads`` (its weights' gradients). ``order``: parts as the forward started
    them."""

    saved: dict[str, int] = field(default_factory=dict)
    forward: dict[str, int] = field(default_factory=dict)
    backward: dict[str, int] = field(default_factory=dict)
    grads: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


def shapes_of(obj: Any) -> Any:
    """Shapes and dtypes of the tensors in a module's inputs (no values, nothing kept alive)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(shapes_of(o) for o in obj)
    if isinstance(obj, dict):
        return {k: shapes_of(v) for k, v in obj.items()}
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


class _Live(TorchDispatchMode):
    """Live bytes of the storages made while it is on (and of those handed to ``follow``),
    each dropped when its storage is freed, never the weights' (``owns``: views of them are
    made all the time); ``on_op`` sees the live bytes after every op."""

    def __init__(
        self,
        owns: set[int],
        on_op: Callable[[int], None] | None = None,
        replay: Replay | None = None,
    ) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.owns = owns
        self.on_op = on_op
        self.replay = replay  # outputs of value-dependent ops, as the dry run made them
        self._refs: dict[int, weakref.ref] = {}

    def follow(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._refs or key in self.owns or not storage.nbytes():
            return
        size = storage.nbytes()
        self.live += size

        def gone(_: Any, key: int = key, size: int = size) -> None:
            self.live -= size
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, gone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.replay is not None and shapes_depend_on_values(func):
            out = self.replay.made(func)
        else:  # as the dry run runs it (meta kernels that refuse the CPU's dtypes)
            out = run_past_cuda_only_meta_checks(func, args, kwargs, op_tensors(args, kwargs))
        for t in op_tensors(out):
            self.follow(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        if self.on_op is not None:
            self.on_op(self.live)
        return out


def _stand_ins(module: nn.Module) -> dict[str, torch.Tensor]:
    """Meta tensors for every parameter and buffer (tied ones once: ``functional_call`` ties
    their other names to them)."""
    return {
        n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(
            t.requires_grad and t.dtype.is_floating_point
        )
        for n, t in [*module.named_parameters(), *module.named_buffers()]
    }


@dataclass
class _Phases:
    """Which part runs, forward and backward, and the most alive in each one's turn."""

    forward_of: str
    backward_of: str
    figures: StepFigures
    owns: set[int]  # storages of the stand-ins: the weights, never activations
    seen: set[int] = field(default_factory=set)

    def start(self, name: str) -> None:
        self.forward_of = name
        if name not in self.figures.saved:
            self.figures.order.append(name)
            self.figures.saved[name] = 0

    def pack(self, t: torch.Tensor, live: _Live) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.owns and key not in self.seen:
            self.seen.add(key)
            saved = self.figures.saved
            saved[self.forward_of] = saved.get(self.forward_of, 0) + storage.nbytes()
            live.follow(storage)
        return t

    def forward_op(self, live: int) -> None:
        peaks = self.figures.forward
        peaks[self.forward_of] = max(peaks.get(self.forward_of, 0), live)

    def backward_op(self, live: int) -> None:
        peaks = self.figures.backward
        peaks[self.backward_of] = max(peaks.get(self.backward_of, 0), live)


def _roots(output: Any) -> list[torch.Tensor]:
    """What a step's backward starts from: the loss the model returned, else every output
    that has a gradient."""
    if isinstance(output, Mapping) and "loss" in list(output.keys()):
        loss = output["loss"]
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            return [loss]
    return [t for t in tensors_in(output) if t.grad_fn is not None]


def trace_step(
    model: nn.Module,
    parts: Sequence[tuple[str, nn.Module]],
    owners: Mapping[int, str],
    args: Any,
    kwargs: Any,
    policy: AttentionPolicy,
    answers: Answers,
    forced: str = "",
) -> StepFigures:
    """One forward and backward of ``model`` on meta tensors (``args``/``kwargs``:
    ``shapes_of`` the workload's inputs), attention costed by ``policy``, the values it reads
    given by ``answers`` (the dry run's of the same forward), and per part (the
    ``(name, module)`` pairs; ``owners``: id of each parameter -> its part) what it held.
    The model's output is freed before the backward (only the loss is kept), as
    ``model(x).loss.backward()`` and a trainer's step free it."""
    stand_ins = _stand_ins(model)
    originals = dict([*model.named_parameters(), *model.named_buffers()])
    phases = _Phases(
        parts[0][0] if parts else "",
        "",
        StepFigures(),
        {t.untyped_storage()._cdata for t in stand_ins.values()},
    )
    replay = Replay(answers)
    live = _Live(phases.owns, phases.forward_op, replay)
    handles = []
    for name, module in parts:
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: phases.start(n)))
        handles.append(
            module.register_forward_hook(
                lambda m, a, out, n=name: _on_backward_start(out, phases, n)
            )
        )
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: phases.pack(t, live), lambda t: t)
    try:
        meta = torch.device("meta")  # what the forward makes without a device (a mask) too
        with meta, torch.enable_grad(), hooks, AttentionKernels(policy, forced), replay, live:
            output = functional_call(
                model,
                stand_ins,
                tuple(_on_meta(args, False)),
                _on_meta(kwargs, False),
                strict=False,
            )
    finally:
        for handle in handles:
            handle.remove()
    roots = _roots(output)
    del output  # what the backward does not need is freed first, as in a training loop
    phases.backward_of = phases.figures.order[-1] if phases.figures.order else ""
    live.on_op = phases.backward_op
    if roots:
        with live:
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    del roots
    grads = phases.figures.grads
    for name, t in stand_ins.items():
        owner = owners.get(id(originals[name]))
        if owner is not None and t.grad is not None:
            grads[owner] = grads.get(owner, 0) + t.grad.untyped_storage().nbytes()
    return phases.figures


def _on_backward_start(output: Any, phases: _Phases, name: str) -> None:
    """When autograd reaches the node that made this part's output, its backward starts."""

    def enter(*_: Any) -> None:
        phases.backward_of = name

    for t in tensors_in(output):
        if t.grad_fn is not None:
            t.grad_fn.register_prehook(enter)


def backward_figures(
    module: nn.Module, args: Any, kwargs: Any, policy: AttentionPolicy, forced: str = ""
) -> tuple[int, int, int]:
    """``(saved, peak, grads)`` for ``module`` alone: one forward on meta stand-ins of its
    weights and of its inputs (``args``/``kwargs``: ``shapes_of`` them; floating positional
    ones get gradients, as activations do), then its backward from a gradient of each output;
    ``peak`` is the most alive during that backward (what it saved included)."""
    stand_ins = _stand_ins(module)
    owns = {t.untyped_storage()._cdata for t in stand_ins.values()}
    phases = _Phases("", "", StepFigures(), owns)
    live = _Live(owns)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: phases.pack(t, live), lambda t: t)
    with torch.device("meta"), torch.enable_grad(), hooks, AttentionKernels(policy, forced):
        out = functional_call(
            module, stand_ins, _on_meta(args, True), _on_meta(kwargs, False), strict=False
        )
    roots = [t for t in tensors_in(out) if t.grad_fn is not None]
    del out
    before = live.live
    if roots:
        with live:
            gradients = [torch.empty_like(t) for t in roots]
            live.peak = max(live.peak, live.live)
            torch.autograd.backward(roots, gradients)
    grads = sum(t.grad.untyped_storage().nbytes() for t in stand_ins.values() if t.grad is not None)
    return sum(phases.figures.saved.values()), max(before, live.peak), grads


def each_alone(
    units: Sequence[tuple[str, nn.Module, str, tuple]],
    policy: AttentionPolicy,
    forced: str,
    fallback: Mapping[str, int],
) -> tuple[dict[str, tuple[int, int]], list[tuple[str, Exception]]]:
    """Per unit ``(name, module, group, (args, kwargs) shapes)``, measured alone: ``(saved,
    the most its backward holds beyond its weights' gradients)``, units of one group (identical
    blocks) once. A unit that cannot run on meta tensors gets ``fallback`` (its forward peak)
    as what it saves and twice that going backward, and is listed with its error."""
    measured: dict[str, tuple[int, int]] = {}
    found: dict[str, tuple[int, int]] = {}
    failed: list[tuple[str, Exception]] = []
    for name, module, group, (args, kwargs) in units:
        figures = measured.get(group) if group else None
        if figures is None:
            try:
                saved, peak, grads = backward_figures(module, args, kwargs, policy, forced)
                figures = (saved, max(saved, peak - grads))
            except Exception as e:  # its forward peak stands in
                figures = (fallback.get(name, 0), 2 * fallback.get(name, 0))
                failed.append((name, e))
            if group:
                measured[group] = figures
        found[name] = figures
    return found, failed


def estimate_note(what: str, error: Exception, whole: bool = False) -> str:
    """A plan's note for a step (``whole``) or a part whose backward could not be measured."""
    reason = str(error).splitlines()[0].strip() if str(error).strip() else type(error).__name__
    if len(reason) > 160:
        reason = reason[:157] + "..."
    if whole:
        return (
            f"{what} could not run on shape-only tensors ({reason}): each part's backward is "
            "measured alone, and what the code between the parts keeps (a loss, attention "
            "scores computed outside the parts) is estimated"
        )
    return (
        f"{what}: what it keeps for the backward pass is estimated by its forward peak, "
        f"because its forward could not run again on shape-only tensors ({reason})"
    )
