"""What the user set on a tensor object, carried across materialize and dematerialize.

The tensor object the model holds keeps its identity when it turns real or deferred again, and
so does what the user put on it: attributes (``p.is_shared = True``), ``requires_grad``,
autograd hooks, a ``Parameter`` subclass, being an inference tensor (made under
``torch.inference_mode()``). The deferred side keeps attributes in its ``__dict__`` beside our own
bookkeeping; :func:`copy_user_attributes` carries the user's part over to the real tensor,
:class:`UserState` keeps what ``__dict__`` does not hold while a tensor is freed, and
:func:`as_inference` makes the real tensor an inference tensor where eager's is one.
"""

from __future__ import annotations

import contextlib

import torch

from jupyter_metainit.core.record.tensor import INTERNAL_ATTRS, PARAMETER_ATTRS

__all__ = ["UserState", "as_inference", "copy_user_attributes", "made_as"]


def copy_user_attributes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Set on ``dst`` (the real tensor) every attribute the user set on ``src`` (its deferred
    side, or an earlier real tensor), leaving out our bookkeeping: a real tensor is a
    ``Parameter`` of the recorded class rather than carrying ``_is_param``."""
    for k, v in src.__dict__.items():
        if k not in INTERNAL_ATTRS and k not in PARAMETER_ATTRS:
            setattr(dst, k, v)


def made_as(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``torch.inference_mode()`` where ``t`` (the deferred side) was made under it, else nothing:
    a parameter or a tensor that requires grad is made of an inference tensor only there."""
    return torch.inference_mode() if t.is_inference() else contextlib.nullcontext()


def as_inference(t: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``real`` as an inference tensor where ``t`` was made under ``torch.inference_mode()``, as
    eager construction makes it (``is_inference()``, no version counter, no autograd): over the
    same memory, not a copy, so that tensors sharing it still share it."""
    if not t.is_inference() or real.is_inference():
        return real
    with torch.inference_mode():
        alias = torch.empty(0, dtype=real.dtype, device=real.device)
        return alias.set_(real.untyped_storage(), real.storage_offset(), real.size(), real.stride())


class UserState:
    """What a user set on a tensor object that its ``__dict__`` does not hold (autograd hooks,
    a Parameter subclass), kept while it is freed and put back when it is materialized."""

    __slots__ = ("backward_hooks", "cls", "post_accumulate_grad_hooks")

    def __init__(self, t: torch.Tensor) -> None:
        self.cls = type(t)
        self.backward_hooks = t._backward_hooks
        self.post_accumulate_grad_hooks = getattr(t, "_post_accumulate_grad_hooks", None)

    def apply(self, real: torch.Tensor) -> None:
        if (
            isinstance(real, torch.nn.Parameter)
            and issubclass(self.cls, torch.nn.Parameter)
            and type(real) is not self.cls
        ):
            real.__class__ = self.cls
        # The same dicts: handles returned by register_hook still remove them.
        if self.backward_hooks is not None:
            real._backward_hooks = self.backward_hooks
        if self.post_accumulate_grad_hooks is not None:
            real._post_accumulate_grad_hooks = self.post_accumulate_grad_hooks
