"""How weights, gradients, optimizer states and activations are stored, per precision setting.

The conventions (bytes per trainable parameter with Adam/AdamW, two moments):

- ``None``: every tensor as the model holds it, and what ``torch.optim`` really keeps for it:
  gradients and optimizer states in the parameter's dtype (fp32 model: 4 + 4 + 8 = 16).
- ``"fp32"``: the same at float32.
- ``"bf16"`` / ``"fp16"``: pure half precision, the model cast (``model.to(torch.bfloat16)``):
  half-precision weights, gradients and states (2 + 2 + 4 = 8).
- ``"bf16-mixed"`` / ``"fp16-mixed"``: ``torch.autocast`` (Lightning's "bf16-mixed"): fp32
  weights, gradients and states (16), activations in half precision.
- ``"bf16-master"`` / ``"fp16-master"``: half-precision weights and gradients with an fp32
  master copy and fp32 states (DeepSpeed/Megatron style: 2 + 2 + 4 + 8 = 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from jupyter_metainit.core import check_floating_dtype
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["Convention", "convention"]

_HALF = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class Convention:
    """``None`` dtypes mean: as the model's tensors are."""

    name: str
    weights: torch.dtype | None
    grads: torch.dtype | None
    states: torch.dtype | None
    master: int  # bytes of master copy per trainable parameter
    activations: torch.dtype | None


_PRECISION_TAKES = (
    "precision takes None, a floating dtype ('fp32', 'bf16', 'fp16'), 'bf16-mixed' / "
    "'fp16-mixed' or 'bf16-master' / 'fp16-master'"
)


def convention(precision: Any) -> Convention:
    """The storage convention for ``precision=`` (see the module's docstring)."""
    if precision is None:
        return Convention("as built", None, None, None, 0, None)
    if not isinstance(precision, (str, torch.dtype)):
        raise ArgumentTypeError(f"{_PRECISION_TAKES}, not {precision!r}")
    if isinstance(precision, str) and "-" in precision:
        base, _, style = precision.strip().lower().partition("-")
        half = _HALF.get(base)
        if half is None or style not in ("mixed", "master"):
            raise ArgumentError(
                f"precision={precision!r}: use None, a dtype ('fp32', 'bf16', 'fp16'), "
                "'bf16-mixed' / 'fp16-mixed' (torch.autocast) or 'bf16-master' / "
                "'fp16-master' (half weights with fp32 master weights)"
            )
        if style == "mixed":
            return Convention(precision, torch.float32, torch.float32, torch.float32, 0, half)
        return Convention(precision, half, half, torch.float32, 4, half)
    dtype = check_floating_dtype(precision, arg="precision", use=_PRECISION_TAKES)
    assert dtype is not None
    return Convention(str(dtype).removeprefix("torch."), dtype, dtype, dtype, 0, dtype)


def itemsize(dtype: torch.dtype | None, own: torch.dtype) -> int:
    """Bytes per element under a convention's dtype (``None``: the tensor's own)."""
    chosen = dtype if dtype is not None and own.is_floating_point else own
    return chosen.itemsize
