"""Gradients taken while recording, replayed: the forward they differentiate runs in grad mode.

A ``GradCall`` (``torch.autograd.grad`` or ``backward`` called on deferred tensors, GradInit- and
MetaInit-style code in ``__init__``) names the ops of its forward (``span``) and the storages of
its inputs (``leaves``). Replay runs every other op without autograd, as always; it runs those
ops in grad mode, on the same tensors eager code had: an input that required grad is the storage's
real tensor itself (an input of a ``leaves`` storage made a tensor that requires grad first, as a
parameter is), one that did not (``detach()``, ``.data``) is detached. Autograd then builds the
graph eager code had, and the call takes the gradient of the real tensors; its results are
detached before they leave the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.value_reads import as_eager
from jupyter_metainit.core.record.graph import GradCall, OpRecord, TensorRecord
from jupyter_metainit.core.runtime.plain import map_args

__all__ = ["GradSpans"]


class GradSpans:
    """The ops of a plan that replay in grad mode, and the storages made leaves that require
    grad, for the ``GradCall`` ops of the plan."""

    def __init__(self, calls: list[GradCall]) -> None:
        self.span: set[int] = set()
        self.leaves: set[int] = set()
        for call in calls:
            self.span |= call.span
            self.span.add(call.seq)
            self.leaves |= call.leaves

    @staticmethod
    def of(ops: list[OpRecord]) -> GradSpans | None:
        """The spans of the plan's gradient calls, or None when it has none (nearly always)."""
        calls = [op for op in ops if isinstance(op, GradCall)]
        return GradSpans(calls) if calls else None

    @contextlib.contextmanager
    def mode(self, op: OpRecord) -> Iterator[None]:
        """How ``op`` runs: the nodes of a gradient's graph in grad mode, and only them (an
        in-place write of a leaf after the gradient is taken runs as eager's, under
        ``no_grad``); autograd's dispatch keys on, as eagerly, even when a value read runs the
        replay from inside a dispatch handler (they are off there)."""
        with as_eager(), torch.set_grad_enabled(op.seq in self.span):
            yield

    def arguments(self, run: Any, op: OpRecord, device: torch.device) -> tuple[tuple, dict]:
        """``op``'s real arguments as eager autograd saw them (``run``: the ``run.Run``)."""
        grad_args = op.grad_args or frozenset()
        written = {id(s) for s in op.mutates}

        def arg(x: Any) -> Any:
            if not isinstance(x, TensorRecord):
                return run.arg(x, device)
            if id(x) in grad_args:
                self.leaf(run, id(x.storage))
                return run.arg(x, device)
            real = run.arg(x, device)
            # Written in place: the storage's own tensor (autograd rebases it); else a tensor
            # that did not require grad here (eager's ``detach()``, ``.data``) leads nowhere.
            return real if id(x.storage) in written else real.detach()

        return map_args(arg, op.args, op.kwargs)

    def leaf(self, run: Any, storage_id: int) -> None:
        """The real tensor of a ``leaves`` storage made a tensor that requires grad (a
        parameter is one), once: every op after it sees that very tensor."""
        base = run.env.get(storage_id)
        if (
            storage_id in self.leaves
            and isinstance(base, torch.Tensor)
            and not base.requires_grad
            and (base.is_floating_point() or base.is_complex())
        ):
            run.env[storage_id] = base.detach().requires_grad_(True)

    def gradients(self, run: Any, call: GradCall, device: torch.device) -> tuple:
        """Run ``call``: ``torch.autograd.grad`` of its outputs with respect to its inputs'
        storages' real tensors (the leaves the forward used: inputs are whole storages)."""
        outputs_recs, inputs_recs = call.args
        for r in inputs_recs:
            run.real(r, device)  # allocated, if nothing made it yet
            self.leaf(run, id(r.storage))  # an unused input (``allow_unused``) requires grad too
        outputs = [run.real(r, device) for r in outputs_recs]
        # The storage's own tensor: an input covers its whole storage (checked when recorded).
        inputs = [run.real(r, device) for r in inputs_recs]
        kwargs = dict(call.kwargs)
        if kwargs["grad_outputs"] is not None:
            kwargs["grad_outputs"] = [
                run.arg(g, device) if g is not None else None for g in kwargs["grad_outputs"]
            ]
        with torch.enable_grad():
            return torch.autograd.grad(outputs, inputs, **kwargs)


def detached(env: dict[int, Any]) -> dict[int, Any]:
    """A replay's results without the autograd graphs a gradient call built."""
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in env.items()}
