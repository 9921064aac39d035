"""Where a tensor lives, as the estimates layer reports it ("deferred", "cpu", "cuda:0")."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["tensor_state"]


def _core_tensor_state() -> Callable[[torch.Tensor], str] | None:
    try:
        from jupyter_metainit.core import tensor_state as core_state
    except ImportError:
        return None
    return core_state


_CORE_STATE = _core_tensor_state()


def tensor_state(t: torch.Tensor) -> str:
    """Return "deferred" for tensors without data (core deferred or ``meta``), else the device.

    Prefers the core's ``tensor_state``; tensors on the ``meta`` device (e.g. built under
    ``with torch.device("meta"):``) are treated as deferred too.
    """
    if t.is_meta:
        return "deferred"
    if _CORE_STATE is not None:
        return _CORE_STATE(t)
    return str(t.device)
