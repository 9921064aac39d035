"""Autograd links of materialized non-leaf tensors.

In eager code a tensor computed in grad mode from parameters (``self.scaled = self.w * 2``,
pruning's ``weight = weight_orig * weight_mask``, a forward pass's output) is not a leaf: its
``grad_fn`` leads back to the parameters, and ``backward`` fills their ``.grad``. A deferred
non-leaf is materialized the same way here: its recorded ops (those after the leaves' own
initialisation) are run again with grad enabled from the *real* leaves, so that its graph reaches
them; its values are checked to be those of the plain replay, bit for bit.

The leaves must be real by then: materialized in the same call, or earlier. If one is still
deferred and not requested, the tensor comes out as a leaf with a warning that names what to
materialize with it (not an error: materializing one module at a time, as the widget does, must
keep working; and not silently, or its gradients would be lost unnoticed). A non-leaf computed
from a leaf that was written after (no graph from the real leaf gives its values) comes out as a
leaf, with a warning too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from jupyter_metainit.core.materialize.user_state import copy_user_attributes
from jupyter_metainit.core.record.graph import OpRecord, StorageRecord
from jupyter_metainit.core.record.tensor import DeferredTensor, grad_leaves
from jupyter_metainit.core.replay import Plan, Run, plan, real_view
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["link_non_leaves"]


def _is_recorded_non_leaf(t: DeferredTensor) -> bool:
    """Whether eager code would have given ``t`` a ``grad_fn`` (a parameter never has one)."""
    return t._rg and t._derived and not t.__dict__.get("_is_param", False)


def _linked_non_leaf(
    t: DeferredTensor,
    plain_value: torch.Tensor,
    in_call: Callable[[StorageRecord], torch.Tensor | None],
    device: torch.device | None,
    rng: str,
) -> torch.Tensor | None:
    """``t``'s real value with the autograd graph eager code gives it, reaching the real leaves
    (None when no leaf it was computed from is alive and requires grad: nothing to reach).

    ``plain_value`` is what the plain replay gave (the values to match); ``in_call`` gives the
    real tensor of a leaf over a storage materialized in this call (None for none).
    """
    seeds = _real_leaves(t, in_call)
    if not seeds:
        return None
    target = t._rec.storage
    linked: torch.Tensor | None = None
    why = "recomputing it from the real parameters does not give its recorded values (they "
    why += "were written after it was computed, or cast with dtype=)"
    try:
        with plain(), torch.inference_mode(False), torch.enable_grad():
            if id(target) in seeds:  # a view of a leaf (``self.w_t = self.w.t()``)
                linked = real_view(seeds[id(target)][1], t._rec)
            else:
                linked = _replay_with_grad(t, seeds, device, rng)
            if linked.device != plain_value.device or linked.dtype != plain_value.dtype:
                linked = linked.to(plain_value.device, plain_value.dtype)
    except RuntimeError as e:
        # Autograd refuses the recorded ops: the values come from the plain replay, which has
        # already run.
        linked, why = None, f"autograd refused to recompute it ({str(e).splitlines()[0]})"
    if linked is not None and linked.grad_fn is None:
        why = "recomputing it from the real parameters builds no graph"
    if linked is None or linked.grad_fn is None or not torch.equal(linked.detach(), plain_value):
        # No graph from the real leaves gives its values: the values win; the lost link is
        # said, not silent.
        warnings.warn(
            f"a tensor of shape {tuple(t.shape)} computed from parameters (recorded at "
            f"{_where(t)}) is materialized as a leaf, so its gradients will not reach them: "
            f"{why}. Recompute it from the real parameters after materializing if you need "
            "them.",
            stacklevel=5,  # the caller of materialize
        )
        return None
    return linked


def _real_leaves(
    t: DeferredTensor, in_call: Callable[[StorageRecord], torch.Tensor | None]
) -> dict[int, tuple[StorageRecord, torch.Tensor]]:
    """storage id -> (storage, the real leaf over it) for every leaf requiring grad that ``t``
    was computed from; nothing (with a warning) if one of them is deferred and not requested."""
    seeds: dict[int, tuple[StorageRecord, torch.Tensor]] = {}
    missing: list[DeferredTensor] = []
    for storage in _storages_read(t):
        real = in_call(storage)
        if real is None:
            ref = grad_leaves.get(storage)
            leaf = ref() if ref is not None else None
            if leaf is None or not leaf.requires_grad:
                continue  # gone, or frozen since: nothing to reach
            if isinstance(leaf, DeferredTensor):
                if leaf._rec.storage is storage:  # not moved elsewhere since (``set_``)
                    missing.append(leaf)
                continue
            real = leaf  # materialized before: the very object the model holds
        if real.dtype != storage.dtype:  # cast by ``dtype=``: computed as recorded, then cast
            real = real.to(storage.dtype)
        seeds[id(storage)] = (storage, real)
    if missing:
        which = ", ".join(f"shape {tuple(x.shape)} recorded at {_where(x)}" for x in missing[:3])
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        # Materializing them unasked would turn more of the model real than was requested (the
        # widget materializes one module at a time): the values come now, the link is said lost.
        warnings.warn(
            f"a tensor of shape {tuple(t.shape)} computed (at {_where(t)}) from deferred "
            f"parameters is materialized as a leaf, so its gradients will not reach them: "
            f"{len(missing)} of them are not being materialized ({which}{more}). Materialize "
            "them with it, in the same call (materialize([model, tensor])) or first, to keep "
            "the link.",
            stacklevel=6,  # the caller of materialize
        )
        return {}
    return seeds


def _storages_read(t: DeferredTensor) -> list[StorageRecord]:
    """``t``'s storage and every storage its recorded ops read, transitively."""
    out: dict[int, StorageRecord] = {id(t._rec.storage): t._rec.storage}
    for op in plan([t._rec]).ops:
        for s in op.reads:
            out.setdefault(id(s), s)
    return list(out.values())


def _replay_with_grad(
    t: DeferredTensor,
    seeds: dict[int, tuple[StorageRecord, torch.Tensor]],
    device: torch.device | None,
    rng: str,
) -> torch.Tensor:
    """Run the ops that computed ``t`` from its leaves, in grad mode, the leaves' real tensors
    standing in for their storages (the leaves' own initialisation is not run again)."""
    full = plan([t._rec])
    needed = {id(t._rec.storage)}
    ops: list[OpRecord] = []
    for op in reversed(full.ops):
        writes = {id(r.storage) for r in op.outputs if r is not None}
        writes |= {id(s) for s in op.mutates}
        if not writes & needed or writes <= seeds.keys():
            continue
        ops.append(op)
        needed |= {id(s) for s in op.reads if id(s) not in seeds}
    ops.reverse()
    p = Plan(ops, [t._rec.storage], dict(seeds), {}, full.allocate)
    run = Run(p, device, rng, None, None)
    for i, op in enumerate(ops):
        # In the grad mode eager ran it in: a ``no_grad`` part (spectral norm's power
        # iteration, which writes its ``_u`` with ``out=``) is no node of the graph.
        with torch.set_grad_enabled(op.grad_args is not None):
            run.run(i, op)
    return run.real(t._rec, run.op_device(ops[-1]) if ops else torch.device("cpu"))


def _where(t: DeferredTensor) -> str:
    writes = t._rec.storage.writes
    return str(writes[0].where) if writes else "an unknown line"


def link_non_leaves(
    tensors: list[DeferredTensor],
    reals: list[torch.Tensor],
    device: torch.device | None,
    rng: str,
) -> None:
    """Replace, in ``reals`` (the real tensors of ``tensors``, same order), those of recorded
    non-leaves by their linked versions, with the attributes set on them."""
    # storage id -> the real leaf over it: the leaves requiring grad of this call
    leaves = {
        id(t._rec.storage): r
        for t, r in zip(tensors, reals, strict=True)
        if t.requires_grad and not _is_recorded_non_leaf(t)
    }
    for i, t in enumerate(tensors):
        if not _is_recorded_non_leaf(t):
            continue
        linked = _linked_non_leaf(t, reals[i], lambda storage: leaves.get(id(storage)), device, rng)
        if linked is None:
            continue
        copy_user_attributes(reals[i], linked)
        reals[i] = linked
