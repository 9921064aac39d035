"""One tensor's values as ``materialize`` would give them (exact mode), without changing it.

A deferred tensor's values come from reading it: ``numpy()`` replays exactly the recorded ops it
depends on, on the CPU, on every core (the core's parallel exact fills), and leaves the tensor
deferred; nothing in the model is swapped. The read goes through an integer view of the same
element size, because numpy has no bfloat16 or float8: the bytes are the same. A real tensor
is saved as it is now (also with ``rng="fast"`` values).
"""

from __future__ import annotations

import numpy as np
import torch

from jupyter_metainit.core import is_deferred

__all__ = ["cpu_values"]

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def cpu_values(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous CPU tensor with ``t``'s values (cast to ``dtype`` if it is floating)."""
    values = _read_deferred(t) if is_deferred(t) else t.detach().to("cpu")
    if dtype is not None and values.is_floating_point() and values.dtype != dtype:
        values = values.to(dtype)
    return values.contiguous()


def _read_deferred(t: torch.Tensor) -> torch.Tensor:
    as_int = _SAME_SIZE_INT.get(t.dtype.itemsize)
    if as_int is None or t.is_complex():
        as_int = None
    view = t.detach() if as_int is None else t.detach().view(as_int)
    array = np.asarray(view.numpy())
    values = torch.from_numpy(array)
    return values if as_int is None else values.view(t.dtype)
