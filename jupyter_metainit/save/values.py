"""One tensor's values as ``materialize`` would give them (exact mode), without changing it.

A deferred tensor's values come from the core's ``values_to_write``: only the recorded ops it
depends on run, on the CPU, on every core (the parallel exact fills); nothing in the model is
swapped and nothing is kept afterwards. A real tensor is saved as it is now (also with
``rng="fast"`` values); a sharded one (DTensor) gives its local shard.
"""

from __future__ import annotations

import torch

from jupyter_metainit.core import DeferredTensor, local_tensor, values_to_write

__all__ = ["cpu_values"]


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
