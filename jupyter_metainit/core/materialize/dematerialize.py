"""``dematerialize``: make materialized tensors deferred again and give their memory back.

What runs when you click Free: find the shadow kept for each real tensor (``shadows``), refuse
by name any tensor whose shadow would not give its current values again (or that holds a
gradient) unless ``force=True``, then, in one critical section, swap each shadow back into the
tensor object, carrying what the user set on it, and return the freed pages to the OS.
Refusals change nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.materialize import shadows
from jupyter_metainit.core.materialize.failures import check_options
from jupyter_metainit.core.materialize.queries import (
    as_list_if_iterator,
    collect,
    describe_request,
    is_uninitialized,
)
from jupyter_metainit.core.materialize.shadows import Shadow, freeable, why_not_reproducible
from jupyter_metainit.core.materialize.user_state import UserState
from jupyter_metainit.core.materialize.walk import named_tensors
from jupyter_metainit.core.record.tensor import INTERNAL_ATTRS, DeferredTensor
from jupyter_metainit.core.runtime import events
from jupyter_metainit.core.runtime.interrupts import critical, handling_interrupts
from jupyter_metainit.core.runtime.lock import exclusive
from jupyter_metainit.core.runtime.swap import swap_in_place

__all__ = ["dematerialize"]


def dematerialize(
    obj: torch.Tensor | torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module],
    *,
    force: bool = False,
    root: torch.nn.Module | None = None,
) -> torch.Tensor | torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module]:
    """Make materialized tensors deferred again and free their memory.

    Use it to give back the memory of a part you are done with (a layer you inspected, a model
    you will materialize elsewhere) while keeping it usable: materializing it again later gives
    the values it has now, bit for bit. Works on tensors materialized with ``keep_cache=True``
    (the widget and magics do that), read from a file (``from_pretrained`` under
    ``meta_init``) or loaded with ``checkpoint=``. That the values would come back is checked
    here, whatever happened since (training, loads, casts, moves, a changed source tensor or
    file; ``fast`` values too: a tensor freed with them gets them again from
    ``materialize``'s default, eager's from an explicit ``rng="exact"``). What the user set on
    the tensor objects (``requires_grad``, attributes, hooks, a Parameter subclass) is kept.

    Args:
        obj: a tensor, a module (all its tensors), or a list or other iterable of them
            (``model.parameters()``; an iterator is returned as a list).
        force: free tensors whose current values a replay would not give again (their values
            are dropped) and tensors holding a gradient (``.grad`` is dropped).
        root: the whole model, when ``obj`` is a part or a list of parts: it only names the
            tensors in errors (``model.layers.3.mlp.weight``).

    Returns:
        ``obj`` itself, its tensors deferred again (an iterator's items as a list).

    Raises:
        MaterializationError: a tensor cannot be made deferred again: it was never deferred,
            was materialized without ``keep_cache=True``, holds a gradient (clear it with
            ``zero_grad(set_to_none=True)``), or holds values a replay would not give again
            (without ``force=True``). It names the tensors; nothing was changed.
        ArgumentTypeError: ``obj`` is not a tensor, a module or an iterable of them.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init
        >>> with meta_init():
        ...     layer = nn.Linear(256, 256)
        >>> _ = materialize(layer, keep_cache=True)  # keep what a free needs
        >>> before = layer.weight.clone()
        >>> dematerialize(layer)
        Linear(in_features=256, out_features=256, bias=True)
        >>> is_deferred(layer)
        True
        >>> _ = materialize(layer)
        >>> torch.equal(layer.weight, before)  # the same values again
        True
    """
    check_options("dematerialize", root, force=force)
    obj = as_list_if_iterator(obj)
    with handling_interrupts(), exclusive(f"freeing {describe_request(obj)}"):
        pairs = _shadows_to_free(obj, force, root)
        prepared = [(t, _deferred_for(t, shadow), UserState(t)) for t, shadow in pairs]
        with critical():
            for t, deferred, state in prepared:
                shadows.note_freed(t)
                swap_in_place(t, deferred)
                shadows.freed_state[t] = state
        freed = [t for t, _, _ in prepared]
        pairs.clear()
        prepared.clear()
        deferred = None  # the real storages' last references go with these
        _return_memory_to_the_os()
        events.publish("dematerialized", freed)
    return obj


def _shadows_to_free(
    obj: Any, force: bool, root: torch.nn.Module | None
) -> list[tuple[torch.Tensor, Shadow]]:
    """Each real tensor of ``obj`` (the one holding the memory) with the shadow to swap back;
    a ``MaterializationError`` naming the tensors that cannot be freed, if any."""
    # (the object the user holds, the one that holds the memory): a DTensor and its shard
    tensors = [
        (t, freeable(t))
        for t in collect(obj, "dematerialize")
        if not isinstance(t, DeferredTensor) and not t.is_meta
    ]
    names = _names_in(root) if root is not None else _names_in(obj)
    pairs: list[tuple[torch.Tensor, Shadow]] = []
    refused: list[str] = []
    with_grad: list[str] = []
    lost: list[torch.Tensor] = []
    for held, t in tensors:
        shadow = shadows.kept.get(t)
        if shadow is None:
            if not is_uninitialized(t):
                lost.append(t)
            continue
        if not force:
            # A gradient is the user's data and its memory: freeing would drop it silently.
            if _grad_of(held) is not None or _grad_of(t) is not None:
                with_grad.append(_name(t, names))
            reason = why_not_reproducible(t, shadow)
            if reason is not None:
                refused.append(f"{_name(t, names)} {reason}")
        pairs.append((t, shadow))
    _refuse(lost, with_grad, refused)
    return pairs


def _refuse(lost: list[torch.Tensor], with_grad: list[str], refused: list[str]) -> None:
    """Raise for the first kind of tensor that cannot be freed: nothing kept, a gradient held,
    values a replay would not give again."""
    if lost:
        raise MaterializationError(
            shadows.why_not_kept(lost, "cannot be made deferred again") + " Nothing was changed."
        )
    if with_grad:
        more = f" (and {len(with_grad) - 3} more)" if len(with_grad) > 3 else ""
        raise MaterializationError(
            f"cannot free {len(with_grad)} tensor(s) holding a gradient (.grad), which "
            f"freeing would drop: {', '.join(with_grad[:3])}{more}. Nothing was changed. "
            "Clear the gradients first (model.zero_grad(set_to_none=True), or "
            "optimizer.zero_grad()), or pass force=True to drop them."
        )
    if refused:
        more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
        raise MaterializationError(
            f"cannot free {len(refused)} tensor(s): materializing again would not give "
            f"their current values, so freeing would lose them: {'; '.join(refused[:3])}"
            f"{more}. Nothing was changed. Pass force=True to free them anyway (their "
            "current values are dropped; materializing gives the recorded ones)."
        )


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad`` without torch's warning for non-leaf tensors (they hold none)."""
    return t.grad if t.is_leaf else None


def _names_in(obj: Any) -> dict[int, str]:
    """Qualified names (``layers.3.weight``) of the tensors of ``obj``, by ``id``."""
    names: dict[int, str] = {}
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for i, x in enumerate(items):
        prefix = f"[{i}]" if isinstance(obj, (list, tuple)) else ""
        if isinstance(x, torch.nn.Module):
            for mname, own in named_tensors(x, attributes=True):
                name = f"{mname}.{own.name}" if mname else own.name
                for t in (own.tensor, freeable(own.tensor)):
                    names.setdefault(id(t), f"{prefix}.{name}" if prefix else name)
        elif isinstance(x, torch.Tensor):
            names.setdefault(id(freeable(x)), prefix or "the tensor")
    return names


def _name(t: torch.Tensor, names: dict[int, str]) -> str:
    return names.get(id(t), f"a tensor of shape {tuple(t.shape)}")


def _deferred_for(t: torch.Tensor, shadow: Shadow) -> DeferredTensor:
    """The deferred tensor to swap back into ``t``: its recording, carrying what the user set
    on ``t`` since (attributes, ``requires_grad``, being a Parameter)."""
    deferred = shadow.deferred
    for k in [k for k in deferred.__dict__ if k not in INTERNAL_ATTRS]:
        del deferred.__dict__[k]
    deferred.__dict__.update(t.__dict__)
    if isinstance(t, torch.nn.Parameter):
        deferred.__dict__["_is_param"] = True
    deferred._rg = t.requires_grad
    return deferred


def _return_memory_to_the_os() -> None:
    """glibc keeps freed heap pages; give them back so the process's memory visibly drops."""
    if os.name != "posix":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
