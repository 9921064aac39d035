"""The assumptions behind a memory table's figures: element sizes under a "what if" dtype and
the optimizer's state bytes per trainable parameter.

Use these to read ``memory_table(dtype=..., optimizer=...)``: they turn the user's words
(``"bf16"``, ``"nf4"``, ``"adamw"``, ``8``) into bits and bytes, with a clear error otherwise.
"""

from __future__ import annotations

import re

import torch

from jupyter_metainit.core import dtype_name, parse_dtype
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

# Bits per element of the "what if" dtypes accepted by ``dtype=``: torch's floating dtypes by
# any name ``parse_dtype`` reads, plus sizes torch has no dtype for (quantized weights).
_WHATIF_ONLY_BITS: dict[str, int] = {
    "float8": 8,
    "fp8": 8,
    "int4": 4,
    "nf4": 4,
}
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
    key = str(dtype).lower().removeprefix("torch.")
    if key in _WHATIF_ONLY_BITS:
        return _WHATIF_ONLY_BITS[key], _WHATIF_CANONICAL.get(key, key)
    try:  # any torch dtype by name or alias ("bf16", "half", "double", "torch.int16")
        return whatif_bits(parse_dtype(dtype))
    except (TypeError, ValueError):
        pass
    known = sorted({*_WHATIF_ONLY_BITS, "float64", "fp64", "float32", "fp32", "bfloat16",
                    "bf16", "float16", "fp16", "half", "float8_e4m3fn", "float8_e5m2",
                    "int8"})  # fmt: skip
    raise ValueError(f"unknown dtype {dtype!r}; use a torch.dtype or one of {known}")


def optimizer_state_bytes(optimizer: str | float | None) -> float:
    """Bytes of optimizer state per trainable parameter for ``optimizer=``."""
    if optimizer is None:
        return 0.0
    check_optimizer_bytes(optimizer)
    if isinstance(optimizer, (int, float)):
        return float(optimizer)
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, None, or a number of "
            f"bytes per trainable parameter, not {optimizer!r}"
        )
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_BYTES)} "
            "or a number of bytes per trainable parameter"
        )
    return OPTIMIZER_STATE_BYTES[key]
