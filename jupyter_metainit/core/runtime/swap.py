"""Exchange the contents of two tensor objects, so that every reference sees the new one."""

from __future__ import annotations

import torch


def swap_in_place(old: torch.Tensor, new: torch.Tensor) -> None:
    """After this call ``old`` (the object every reference points at) holds ``new``'s tensor,
    class and attributes, and ``new`` holds what ``old`` had.

    Like ``torch.utils.swap_tensors`` but without its use-count and weak-reference checks: a
    deferred tensor's implementation may also be held by views of it, which only ever see the
    deferred side, and weak references (``nn.LSTM`` keeps some to its weights) follow the object,
    whose identity is exactly what we preserve.
    """
    old_cls, new_cls = type(old), type(new)
    old.__class__, new.__class__ = new_cls, old_cls
    old_dict, new_dict = old.__dict__, new.__dict__
    old.__dict__, new.__dict__ = new_dict, old_dict
    torch._C._swap_tensor_impl(old, new)
