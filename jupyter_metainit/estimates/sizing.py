"""The assumptions behind a memory table's figures: element sizes under a "what if" dtype and
the optimizer's state bytes per trainable parameter.

Use these to read ``memory_table(dtype=..., optimizer=...)``: they turn the user's words
(``"bf16"``, ``"nf4"``, ``"adamw"``, ``8``) into bits and bytes, with a clear error otherwise.
"""

from __future__ import annotations

import re

import torch

from jupyter_metainit.core import ESTIMATE_ONLY_BITS, dtype_name, parse_dtype
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.estimates._arguments import check_optimizer_bytes

__all__ = ["OPTIMIZER_STATE_BYTES", "optimizer_state_bytes", "whatif_bits"]

# Bytes per trainable parameter kept by the optimizer (its states, fp32).
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adam": 8.0,  # exp_avg + exp_avg_sq
    "adamw": 8.0,
    "sgd": 0.0,  # plain SGD keeps nothing
    "sgd_momentum": 4.0,  # momentum buffer
    "adafactor": 4.0,  # rough: factored second moments + first moment are at most ~1 state
    "none": 0.0,
}

# The "what if" dtypes accepted by ``dtype=``: torch's dtypes by any name ``parse_dtype`` reads,
# plus the core's estimate-only sizes (quantized weights; Note [One argument policy]).
_WHATIF_CANONICAL = {"fp8": "float8", "nf4": "int4"}


def whatif_bits(dtype: torch.dtype | str | None) -> tuple[int | None, str | None]:
    """``(bits per element, dtype name)`` for ``dtype=``; ``(None, None)`` for ``None``."""
    if dtype is None:
        return None, None
    if isinstance(dtype, torch.dtype):
        name = dtype_name(dtype)
        # torch's sub-byte dtypes (int1..int7, uint1..uint7) report one byte per element
        sub_byte = re.fullmatch(r"u?int([1-7])", name)
        return (int(sub_byte.group(1)) if sub_byte else dtype.itemsize * 8), name
    key = dtype.strip().lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if key in ESTIMATE_ONLY_BITS:
        return ESTIMATE_ONLY_BITS[key], _WHATIF_CANONICAL.get(key, key)
    # any torch dtype by name or alias ("bf16", "half", "torch.int16"); else parse_dtype's error
    return whatif_bits(parse_dtype(dtype))


def optimizer_state_bytes(optimizer: str | float | None) -> float:
    """Bytes of optimizer state per trainable parameter for ``optimizer=``."""
    if optimizer is None:
        return 0.0
    check_optimizer_bytes(optimizer)
    if isinstance(optimizer, (int, float)):
        return float(optimizer)
    if not isinstance(optimizer, str):
        raise ArgumentTypeError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, None, or a number of "
            f"bytes per trainable parameter, not {optimizer!r}"
        )
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise ArgumentError(
            f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_BYTES)} "
            "or a number of bytes per trainable parameter"
        )
    return OPTIMIZER_STATE_BYTES[key]
