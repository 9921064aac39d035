"""A sharded tensor's (DTensor's) local shard: the one place that looks inside a DTensor.

After ``fully_shard`` or ``distribute_tensor`` a parameter is a DTensor wrapping a local tensor
(deferred, or the real shard). Materializing, freeing, counting memory and following a model's
tensors act on that local tensor. Duck-typed, so the core needs no ``torch.distributed`` import.
"""

from __future__ import annotations

import torch

__all__ = ["local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if ``t`` is a DTensor, else ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t
