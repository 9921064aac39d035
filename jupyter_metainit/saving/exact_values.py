"""One tensor's values as ``materialize`` would give them (exact mode), without changing it.

A deferred tensor's values come from the core's ``values_to_write``: only the recorded ops it
depends on run, on the CPU, on every core (the parallel exact fills); nothing in the model is
swapped and nothing is kept afterwards. A deferred view of memory an earlier ``materialize`` made
real gets that memory's values now, as materializing it would (the core's one rule for it). A
real tensor is saved as it is now (also with ``rng="fast"`` values); a sharded one (DTensor)
gives its local shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from jupyter_metainit.core import (
    DeferredTensor,
    Recycler,
    copy_in_steps,
    local_tensor,
    values_to_write,
)

__all__ = ["Recycler", "cpu_values", "cpu_values_of_batch"]


def cpu_values(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous CPU tensor with ``t``'s values (cast to ``dtype`` if it is floating)."""
    local = local_tensor(t)
    if isinstance(local, DeferredTensor):
        values = values_to_write(local)
    else:
        values = local.detach().to("cpu")
    if dtype is not None and values.is_floating_point() and values.dtype != dtype:
        values = values.to(dtype)
    return values.contiguous()


def cpu_values_of_batch(
    tensors: Sequence[torch.Tensor],
    dtype: torch.dtype | None = None,
    memory: Callable[[int], torch.UntypedStorage] | None = None,
    on_part: Callable[[int, int, int, torch.Tensor], None] | None = None,
) -> list[torch.Tensor]:
    """:func:`cpu_values` of each tensor; the deferred ones computed together, in one replay
    whose fills of one random stream run cut across all cores (``values_to_write`` of a list),
    into storages from ``memory(nbytes)`` (the core's ``Recycler``) where given. ``on_part(j, a, b,
    flat)`` (from the replay's threads): elements ``[a, b)`` of tensor ``j``'s values (``flat``)
    are final before the whole batch is (never for a tensor that ``dtype`` casts)."""
    locals_ = [local_tensor(t) for t in tensors]
    which = [j for j, x in enumerate(locals_) if isinstance(x, DeferredTensor)]

    def deferred_part(k: int, a: int, b: int, flat: torch.Tensor) -> None:
        if dtype is None or not flat.is_floating_point() or flat.dtype == dtype:
            on_part(which[k], a, b, flat)

    parts = None if on_part is None else deferred_part
    computed = values_to_write([locals_[j] for j in which], memory, parts) if which else []
    out = [
        t if isinstance(x, DeferredTensor) else cpu_values(t, dtype)
        for t, x in zip(tensors, locals_, strict=True)
    ]
    for j, values in zip(which, computed, strict=True):
        if dtype is not None and values.is_floating_point() and values.dtype != dtype:
            cast = torch.empty(values.shape, dtype=dtype)  # ``.to(dtype)``, a Cancel between steps
            copy_in_steps(cast, values)
            values = cast
        out[j] = values.contiguous()
    return out
