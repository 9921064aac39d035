"""One tensor's values as ``materialize`` would give them (exact mode), without changing it.

A deferred tensor's values come from the core's ``values_to_write``: only the recorded ops it
depends on run, on the CPU, on every core (the parallel exact fills); nothing in the model is
swapped and nothing is kept afterwards. A real tensor is saved as it is now (also with
``rng="fast"`` values); a sharded one (DTensor) gives its local shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from jupyter_metainit.core import DeferredTensor, local_tensor, values_to_write

__all__ = ["cpu_values", "cpu_values_of_batch"]


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
    tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """:func:`cpu_values` of each tensor; the deferred ones computed together, in one replay
    whose fills of one random stream run cut across all cores (``values_to_write`` of a list)."""
    locals_ = [local_tensor(t) for t in tensors]
    deferred = [x for x in locals_ if isinstance(x, DeferredTensor)]
    computed = iter(values_to_write(deferred) if len(deferred) > 1 else [])
    out = []
    for t, local in zip(tensors, locals_, strict=True):
        if len(deferred) > 1 and isinstance(local, DeferredTensor):
            values = next(computed)
            if dtype is not None and values.is_floating_point() and values.dtype != dtype:
                values = values.to(dtype)
            out.append(values.contiguous())
        else:
            out.append(cpu_values(t, dtype))
    return out
