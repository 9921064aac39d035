"""The FSDP2 strategy: which modules become ``fully_shard`` units and each rank's peak.

Every rank holds ``1/world_size`` of the weights, gradients and optimizer states; a unit's
weights are all-gathered whole while it runs. By default the units are the repeated blocks
(decoder layers), then the root, which holds everything else, as PyTorch's FSDP2 examples
shard a transformer.

Per rank, training: the shards of the weights and optimizer states, the root unit's weights
unsharded, the largest block unit unsharded twice (the one running and the one prefetched);
going backward through the parts in reverse, the activations saved by the parts not reached
yet (at the per-rank batch), the gradient shards of those done, and the part's working set or
its unsharded gradients before the reduce-scatter, the larger; the optimizer step instead holds
every gradient shard and its temporaries for the rank's shards. Inference: the shards, the
unsharded root and two block units, the cache and the largest working set.

Not modelled: communication time and its buffers (NCCL's, the all-gather's staging copies),
``MixedPrecisionPolicy`` (all-gathering in another dtype than the weights are stored in),
``reshard_after_forward=False`` and other per-unit choices, activation checkpointing, padding
of uneven shards, and that buffers are replicated rather than sharded (counted as sharded).
"""

from __future__ import annotations

from torch import nn

from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.plan.partition import Costs, Load
from jupyter_metainit.plan.parts import Part
from jupyter_metainit.plan.precision import Convention
from jupyter_metainit.plan.result import Placement
from jupyter_metainit.plan.workload import Activity

__all__ = ["plan_fsdp"]

PREFETCH = 2  # units unsharded at once: the one running and the next, prefetched


def _units(parts: list[Part]) -> list[str]:
    """The repeated blocks, innermost first in module order, then the root."""
    return [p.name for p in parts if p.group and p.name] + [""]


def plan_fsdp(
    model: nn.Module,
    parts: list[Part],
    activity: Activity,
    devices: dict[str, int],
    own: dict[str, Costs],
    conv: Convention,
    world_size: int | None,
    training: bool,
) -> Placement:
    """Each rank's predicted peak with the repeated blocks as ``fully_shard`` units."""
    if world_size is None:
        world_size = len(devices)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"world_size={world_size!r}: give the number of ranks, an int >= 1")
    if len(devices) not in (1, world_size):
        raise ArgumentError(
            f"strategy='fsdp' takes one rank's device and capacity ({{'cuda': '80GiB'}}) with "
            f"world_size=, or one entry per rank; got {len(devices)} devices for "
            f"world_size={world_size}"
        )
    device = min(devices, key=devices.__getitem__)  # every rank is held to the smallest
    units = _units(parts)
    in_block = {p.name for p in parts if p.group and p.name}
    block_weights = max((own[n].weights for n in in_block), default=0)
    root_weights = sum(c.weights for n, c in own.items() if n not in in_block)
    total = Costs(
        **{f: sum(getattr(c, f) for c in own.values()) for f in Costs.__dataclass_fields__}
    )
    shards = (total.weights + total.states) // world_size
    unsharded = root_weights + PREFETCH * block_weights
    if training:
        # Backward, part by part in reverse: the saved activations of the parts not yet
        # reached, the gradient shards of those done, and the part's working set or its
        # unsharded gradients (before the reduce-scatter), the larger; then the step.
        backward = Load(True, foreach=True)
        for name in activity.order:
            c = own[name]
            shard = c.grads // world_size
            backward.add(
                Costs(
                    transient=c.transient,
                    saved=c.saved,
                    grads=shard,
                    step_all=c.step_all // world_size,
                    backward=c.backward,
                )
            )
        peak = shards + unsharded + backward.peak
    else:
        forward = Load(False)
        for name in activity.order:
            forward.add(Costs(cache=own[name].cache, transient=own[name].transient))
        peak = shards + unsharded + forward.peak
    parts_table = [(p.label, p.kind, device, own[p.name]) for p in parts]
    return Placement(
        device_map={"": device},
        peak={device: peak},
        capacity={device: devices[device]},
        parts=parts_table,
        strategy="fsdp",
        training=training,
        precision=conv.name,
        units=units,
        world_size=world_size,
        notes=list(activity.notes),
        measure_seconds=activity.seconds,
    )
