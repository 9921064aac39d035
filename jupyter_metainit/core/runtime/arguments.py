"""Reading the arguments people pass: devices and dtypes, the one parser of each for every layer.

``materialize``, ``meta_init``, the estimates, the magics and the widget all take a device or a
dtype from users, as an object or as text (``"cuda:1"``, ``"bf16"``). They read them here, so
that every entry point accepts the same spellings (one alias table) and names dtypes the same
way; each caller adds only its own refusal wording (a magic's ``UsageError``, for instance).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "check_floating_dtype",
    "dtype_name",
    "missing_device_reason",
    "parse_device",
    "parse_dtype",
]

# The one table of short dtype names: what a badge shows (``dtype_name(d, short=True)``), and,
# where a short name stands for one dtype only, a spelling ``parse_dtype`` accepts.
_SHORT_NAMES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}
_SHORT_COUNTS: dict[str, int] = {}
for _short in _SHORT_NAMES.values():
    _SHORT_COUNTS[_short] = _SHORT_COUNTS.get(_short, 0) + 1
# Spellings people write for dtypes (the magics' --dtype, dry_run's input_dtype=, fits' dtype=).
_ALIASES: dict[str, torch.dtype] = {
    **{short: d for d, short in _SHORT_NAMES.items() if _SHORT_COUNTS[short] == 1},
    "half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
    "long": torch.int64,
    "int": torch.int32,
}
del _short


def parse_dtype(value: Any, arg: str = "dtype") -> torch.dtype | None:
    """A ``torch.dtype`` from itself or its name: ``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"``.

    ``None`` stays ``None``. A name that is no dtype is a ``ValueError``, anything else that is
    not a dtype a ``TypeError``; both name ``arg`` (the argument the user gave it as).
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.strip().removeprefix("torch.").lower()
        dtype = _ALIASES.get(name) or getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            return dtype
        raise ValueError(
            f"{arg}={value!r} is not a dtype: use a torch.dtype (torch.bfloat16) or its name "
            "('bfloat16', 'bf16', 'float16', 'fp16', 'float32', 'int64', ...)"
        )
    raise TypeError(
        f"{arg} must be a torch.dtype (torch.bfloat16) or its name ('bfloat16'), not {value!r}"
    )


def dtype_name(dtype: torch.dtype, *, short: bool = False) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, or with ``short`` ``"bf16"`` (a badge's text; dtypes
    with no short name keep their name: ``"int64"``)."""
    if short and dtype in _SHORT_NAMES:
        return _SHORT_NAMES[dtype]
    return str(dtype).removeprefix("torch.")


def check_floating_dtype(
    dtype: Any, *, arg: str, use: str, not_floating: type[Exception] = ValueError
) -> torch.dtype | None:
    """``dtype`` if it is a floating ``torch.dtype`` (None stays None), else an error that names
    ``arg`` and says what the dtype is used for (``use``)."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{arg} must be a torch.dtype (e.g. torch.bfloat16), not {dtype!r}")
    if not dtype.is_floating_point:
        raise not_floating(f"{arg}={dtype} is not a floating-point dtype; {use}")
    return dtype


def parse_device(device: Any) -> torch.device | None:
    """A ``torch.device`` from itself or its name (``"cpu"``, ``"cuda:1"``); ``None`` stays None.

    Only the spelling is checked: whether the device exists here is
    :func:`missing_device_reason`'s question (recording for a GPU needs none).
    """
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device
    try:
        return torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"not a device: {device!r} (use e.g. 'cpu' or 'cuda:0')") from e


def missing_device_reason(d: torch.device) -> str | None:
    """Why ``d`` cannot hold tensors on this machine (``"CUDA is not available here"``), or None
    when it can."""
    if d.type == "cpu":
        return None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available here"
        count = torch.cuda.device_count()
        if d.index is not None and not 0 <= d.index < count:
            return f"this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        return None
    backend = getattr(torch, d.type, None)
    is_available = getattr(backend, "is_available", None)
    if not (callable(is_available) and is_available()):
        return f"no {d.type} device is available here"
    return None
