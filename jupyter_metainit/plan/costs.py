"""Each part's costs on its device: weights (tie-aware), cache, activations, gradients, states."""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy

from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.estimates.memory import subtree_bytes
from jupyter_metainit.estimates.sizing import OPTIMIZER_STATE_BYTES
from jupyter_metainit.plan.partition import Costs
from jupyter_metainit.plan.parts import Part
from jupyter_metainit.plan.precision import Convention, itemsize
from jupyter_metainit.plan.workload import Activity

__all__ = ["part_costs", "state_bytes_per_parameter"]

# Optimizers whose update makes a temporary the size of the states' second moment.
_ADAM = ("adam", "adamw")


def state_bytes_per_parameter(optimizer: str | float | None, state_itemsize: int) -> float:
    """Optimizer state bytes per trainable parameter at ``state_itemsize`` bytes per state."""
    if optimizer is None:
        return 0.0
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ArgumentError(f"optimizer={optimizer!r}: bytes per parameter must be >= 0")
        return float(optimizer)
    key = str(optimizer).lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise ArgumentError(
            f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_BYTES)}, None, "
            "or a number of state bytes per trainable parameter"
        )
    return OPTIMIZER_STATE_BYTES[key] / 4 * state_itemsize  # the table counts fp32 states


def _tensors(part: Part) -> dict[int, tuple]:
    """id -> (tensor, is_parameter) for every parameter and buffer of the part, once."""
    found: dict[int, tuple] = {}
    for m in part.modules():
        for slots, is_param in ((m._parameters, True), (m._buffers, False)):
            for t in slots.values():
                if t is not None:
                    found.setdefault(id(t), (t, is_param))
    return found


def _own_costs(
    part: Part,
    weights: int,
    shared: set[int],
    activity: Activity,
    conv: Convention,
    optimizer: str | float | None,
    training: bool,
    scale: float,
) -> Costs:
    """One part alone; tensors in ``shared`` are counted by an earlier part of its tie group."""
    grads = states = step_all = step_one = 0
    for key, (t, is_param) in _tensors(part).items():
        if key in shared:
            weights -= t.numel() * itemsize(conv.weights, t.dtype)
            continue
        if not (training and is_param and t.requires_grad):
            continue
        n = t.numel()
        state_size = itemsize(conv.states, t.dtype)
        grads += n * itemsize(conv.grads, t.dtype)
        states += int(n * (state_bytes_per_parameter(optimizer, state_size) + conv.master))
        if isinstance(optimizer, str) and optimizer.lower() in _ADAM:
            step_all += n * state_size  # sqrt of the second moment, all tensors at once
            step_one = max(step_one, 2 * n * state_size)  # sqrt, then divided: two alive
    return Costs(
        weights=max(0, weights),
        cache=int(activity.cache.get(part.name, 0) * scale),
        transient=int(activity.transient.get(part.name, 0) * scale),
        grads=grads,
        states=states,
        saved=int(activity.saved.get(part.name, 0) * scale),
        step_all=step_all,
        step_one=step_one,
        # its activations scaled, its gradients at their own precision
        backward=int(activity.backward.get(part.name, 0) * scale) + grads if training else 0,
    )


def _merge(costs: list[Costs]) -> Costs:
    """A tie group as one part (what the partition moves): its members' sums, the largest
    working sets, going backward through the member that holds the most beyond the others'
    saved activations and gradients."""
    saved, grads = sum(c.saved for c in costs), sum(c.grads for c in costs)
    return Costs(
        weights=sum(c.weights for c in costs),
        cache=sum(c.cache for c in costs),
        transient=max(c.transient for c in costs),
        grads=grads,
        states=sum(c.states for c in costs),
        saved=saved,
        step_all=sum(c.step_all for c in costs),
        step_one=max(c.step_one for c in costs),
        backward=saved + grads + max(c.backward - c.saved - c.grads for c in costs),
    )


def part_costs(
    model: nn.Module,
    parts: list[Part],
    activity: Activity,
    conv: Convention,
    *,
    optimizer: str | float | None,
    training: bool,
) -> tuple[dict[str, Costs], dict[str, Costs]]:
    """Per part its own costs, and per leader (a part that is no follower) the costs of its
    whole tie group, which always shares one device."""
    weights_of = subtree_bytes(model, dtype=conv.weights)
    act_dtype = conv.activations or activity.dtype
    scale = act_dtype.itemsize / activity.dtype.itemsize
    own: dict[str, Costs] = {}
    grouped: dict[str, Costs] = {}
    for part in parts:
        if part.leader is not None:
            continue
        seen: set[int] = set()
        members = []
        for member in [part, *part.followers]:
            found = _tensors(member)
            tensors = set(found)
            weights = (
                sum(
                    t.numel() * itemsize(conv.weights, t.dtype)
                    for t, _ in found.values()
                    if not is_lazy(t)
                )
                if member.own_only
                else weights_of[member.name]
            )
            cost = _own_costs(
                member, weights, seen & tensors, activity, conv, optimizer, training, scale
            )
            own[member.name] = cost
            members.append(cost)
            seen |= tensors
        grouped[part.name] = _merge(members)
    return own, grouped
