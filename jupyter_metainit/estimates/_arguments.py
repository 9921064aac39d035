"""Checks of the estimates' arguments: a user mistake is a clear error that says what works.

One small function per argument kind, shared by ``memory_table``, ``summary``, ``fits`` and
``dry_run``, so that every entry point refuses the same things with the same words.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from jupyter_metainit.core import check_flag, indexed_device
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "check_budget",
    "check_depth",
    "check_device",
    "check_flag",
    "check_optimizer_bytes",
    "check_shapes",
    "require_module",
]


def require_module(obj: Any, func: str, *, also: str = "") -> nn.Module:
    """``obj`` if it is an ``nn.Module``; otherwise a ``TypeError`` naming what is accepted."""
    if isinstance(obj, nn.Module):
        return obj
    hint = ""
    if isinstance(obj, torch.Tensor):
        hint = (
            "; pass the module that holds the tensor (one tensor's bytes are "
            "t.numel() * t.element_size())"
        )
    elif obj is None:
        hint = "; did the cell that builds the model run (and return it)?"
    raise ArgumentTypeError(
        f"{func}() takes an nn.Module (a model or a part of it){also}, not "
        f"{type(obj).__name__}{hint}"
    )


def check_depth(depth: Any) -> int | None:
    """``None`` (every row) or a depth ``>= 0`` (0: the root row only)."""
    if depth is None:
        return None
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise ArgumentTypeError(
            f"depth must be an int >= 0 (0: the root only) or None (every row), not {depth!r}"
        )
    if depth < 0:
        raise ArgumentError(
            f"depth must be >= 0 (0: the root only) or None (every row), not {depth}"
        )
    return depth


def check_optimizer_bytes(optimizer: Any) -> None:
    """A number given as ``optimizer=`` is bytes of state per trainable parameter: finite, >= 0."""
    if isinstance(optimizer, bool):
        raise ArgumentTypeError(
            "optimizer must be a name ('adam', 'sgd', ...), None, or a number of bytes per "
            f"trainable parameter, not {optimizer!r}"
        )
    if isinstance(optimizer, (int, float)) and not (math.isfinite(optimizer) and optimizer >= 0):
        raise ArgumentError(
            f"optimizer={optimizer!r}: a number is the optimizer's state bytes per trainable "
            "parameter and must be >= 0 (Adam: 8, SGD with momentum: 4, SGD: 0)"
        )


def check_budget(limit: Any, given: Any) -> int:
    """A budget in bytes is positive; ``given`` is what the user wrote (for the message)."""
    if isinstance(given, bool):
        raise ArgumentTypeError(f"budget must be bytes or a size such as '24GiB', not {given!r}")
    if limit <= 0:
        raise ArgumentError(
            f"budget={given!r} is not a memory size: give a positive number of bytes or a size "
            "such as '24GiB' / '80GB' (or leave it out to use the device's free memory)"
        )
    return int(limit)


def check_device(device: Any, arg: str = "device") -> torch.device:
    """A ``torch.device`` from ``device`` (Note [One argument policy] in the core's
    ``runtime/arguments``): a bare ``"cuda"`` is the current GPU, an int a GPU index."""
    if device is None:
        raise ArgumentTypeError(f"{arg} must be a device such as 'cpu' or 'cuda:0', not None")
    return indexed_device(device, arg)


def check_shapes(inputs: Any, arg: str) -> None:
    """Inputs given as shapes are tuples (or lists, ``torch.Size``) of whole numbers >= 0: a
    tuple of numbers that is not one (``(1, 8.0)``, ``(True, 8)``, ``()``, ``(1, -8)``) is
    refused here, naming it, instead of reaching the model as a tuple."""
    values = inputs.values() if isinstance(inputs, dict) else inputs
    for value in values:
        if not isinstance(value, (tuple, list, torch.Size)):
            continue
        if not all(isinstance(d, (int, float)) for d in value):
            continue  # a tuple of tensors or other inputs: the forward's own business
        if value and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
            continue
        raise ArgumentError(
            f"{arg}: {value!r} is not a shape: give each input as a tensor or as its shape, a "
            "tuple of whole numbers >= 0 such as (1, 8) (a scalar input: a 0-d tensor)"
        )
