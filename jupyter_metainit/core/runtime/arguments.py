"""Reading the arguments people pass: devices, dtypes and sizes, one parser of each for every layer.

Note [One argument policy]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``materialize``, ``meta_init``, ``save``, the estimates, ``place``, the magics and the widget all
take devices, dtypes and memory sizes from users, as objects or as text. They read them here,
so that the same spelling means the same thing everywhere:

- a dtype is a ``torch.dtype`` or its name, with or without ``torch.``, or a short name:
  ``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"`` are one dtype;
- a device is a ``torch.device``, its name or a GPU index (``0`` is ``"cuda:0"``, as
  ``torch.device(0)``); a bare ``"cuda"`` is the *current* CUDA device, as in torch
  (:func:`indexed_device`: ``cuda:0`` unless the program changed it);
- a size is a number of bytes or text with a unit: ``"80GiB"`` (2**30), ``"80GB"`` (10**9, as
  transformers reads ``max_shard_size``), ``"500MB"``, ``"1.5TiB"``. A lowercase final ``b``
  (``"5gb"``) is refused: transformers reads it as *bits*, people mean bytes.

- a path is a ``str`` or an ``os.PathLike``; ``~`` is the home directory everywhere. Text typed
  into a magic or a widget field is read as a shell reads it: ``$NAME`` and ``${NAME}`` are
  environment variables too. A path given in Python keeps ``$`` as written, as ``open`` does;
  where that names an environment variable and no such file exists, it is refused
  (:func:`parse_path`), so ``save(m, "$HOME/x")`` never makes a folder called ``$HOME``.

A wrong type is an :class:`~jupyter_metainit.core.errors.ArgumentTypeError` (a ``TypeError``), a
wrong value an :class:`~jupyter_metainit.core.errors.ArgumentError` (a ``ValueError``); both name
the argument as the user wrote it. Each caller adds only its own wording around them (a magic's
``UsageError``, for instance).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "ESTIMATE_ONLY_BITS",
    "check_flag",
    "check_floating_dtype",
    "check_progress",
    "dtype_name",
    "indexed_device",
    "parse_path",
    "missing_device_reason",
    "parse_device",
    "parse_dtype",
    "parse_size",
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
# Sizes the estimates take as "what if the weights were stored in N bits" (memory_table, fits,
# summary: quantized weights) that name no dtype a tensor can have here: every other function
# refuses them, saying so.
ESTIMATE_ONLY_BITS: dict[str, int] = {"float8": 8, "fp8": 8, "int4": 4, "nf4": 4}
_ESTIMATE_ONLY = (
    "is an estimate-only size: memory_table, fits and summary take it as a what-if of the "
    "weights' size (dtype=), but a tensor needs a torch dtype"
)


def _estimate_only_hint(value: Any) -> str:
    """For a refused dtype: why an estimate's what-if size is refused here, if it is one."""
    if isinstance(value, str) and _dtype_key(value) in ESTIMATE_ONLY_BITS:
        return f" ({value!r} {_ESTIMATE_ONLY})"
    return ""


def _dtype_key(name: str) -> str:
    return name.strip().lower().removeprefix("torch.")


def parse_dtype(value: Any, arg: str = "dtype") -> torch.dtype | None:
    """A ``torch.dtype`` from itself or its name: ``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"``.

    ``None`` stays ``None``. A name that is no dtype is an ``ArgumentError`` (a ``ValueError``),
    anything else that is not a dtype an ``ArgumentTypeError`` (a ``TypeError``); both name
    ``arg`` (the argument the user gave it as).

    Examples:
        >>> parse_dtype("bf16"), parse_dtype("torch.float16"), parse_dtype(torch.float32)
        (torch.bfloat16, torch.float16, torch.float32)
    """
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = _dtype_key(value)
        dtype = _ALIASES.get(name) or getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            return dtype
        if name in ESTIMATE_ONLY_BITS:
            raise ArgumentError(
                f"{arg}={value!r} {_ESTIMATE_ONLY} (torch.float8_e4m3fn, torch.float8_e5m2, "
                "torch.bfloat16, ...)"
            )
        raise ArgumentError(
            f"{arg}={value!r} is not a dtype: use a torch.dtype (torch.bfloat16) or its name "
            "('bfloat16', 'bf16', 'float16', 'fp16', 'float32', 'int64', ...)"
        )
    raise ArgumentTypeError(
        f"{arg} must be a torch.dtype (torch.bfloat16) or its name ('bfloat16'), not {value!r}"
    )


def dtype_name(dtype: torch.dtype, *, short: bool = False) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, or with ``short`` ``"bf16"`` (a badge's text; dtypes
    with no short name keep their name: ``"int64"``)."""
    if short and dtype in _SHORT_NAMES:
        return _SHORT_NAMES[dtype]
    return str(dtype).removeprefix("torch.")


def check_floating_dtype(dtype: Any, *, arg: str, use: str) -> torch.dtype | None:
    """``dtype`` (any spelling :func:`parse_dtype` reads) if it is a floating dtype (None stays
    None), else an error that names ``arg`` and says what the dtype is used for (``use``)."""
    parsed = parse_dtype(dtype, arg)
    if parsed is None:
        return None
    if not parsed.is_floating_point:
        hint = _estimate_only_hint(dtype)
        raise ArgumentError(f"{arg}={parsed} is not a floating-point dtype{hint}; {use}")
    return parsed


def check_flag(value: Any, arg: str) -> bool:
    """``value`` if it is a bool; anything else (``"no"``, ``0``, ``None``) an
    ``ArgumentTypeError``: a flag is never truth-tested, ``force="no"`` must not force."""
    if isinstance(value, bool):
        return value
    raise ArgumentTypeError(f"{arg} takes True or False, not {value!r}")


def check_progress(progress: Any, arg: str = "progress") -> Any:
    """``progress=`` as every public function takes it: None or False (no progress), True (a
    progress bar) or a ``callable(done_bytes, total_bytes)``; anything else an
    ``ArgumentTypeError``, before any work."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise ArgumentTypeError(
        f"{arg} takes None, a bool (True: a progress bar) or a callable(done_bytes, "
        f"total_bytes), not {progress!r}"
    )


def parse_device(device: Any, arg: str = "device") -> torch.device | None:
    """A ``torch.device`` from itself, its name (``"cpu"``, ``"cuda:1"``) or a GPU index (``1``).

    ``None`` stays None. Only the spelling is checked: whether the device exists here is
    :func:`missing_device_reason`'s question (recording for a GPU needs none), and which GPU a
    bare ``"cuda"`` is, :func:`indexed_device`'s.

    Examples:
        >>> parse_device("cuda:1"), parse_device(0), parse_device(" cpu ")
        (device(type='cuda', index=1), device(type='cuda', index=0), device(type='cpu'))
    """
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise ArgumentTypeError(
            f"{arg} must be a device name ('cpu', 'cuda:0'), a GPU index or a torch.device, "
            f"not {device!r}"
        )
    if isinstance(device, int):
        if device < 0:
            raise ArgumentError(f"{arg}={device!r} is not a GPU index: use 0, 1, ... or 'cpu'")
        # A GPU index, as in accelerate's device maps (torch.device(0) asks for an accelerator).
        return torch.device("cuda", device)
    try:
        return torch.device(device.strip())
    except (RuntimeError, TypeError, ValueError) as e:
        raise ArgumentError(
            f"{arg}={device!r} is not a device: use e.g. 'cpu', 'cuda' (the current GPU), "
            "'cuda:0' or a GPU index"
        ) from e


def indexed_device(device: Any, arg: str = "device") -> torch.device:
    """:func:`parse_device`, with the index an eager tensor would get: a bare ``"cuda"`` (or
    ``"xpu"``) is the current device of that kind, ``cuda:0`` unless the program changed it.

    Examples:
        >>> indexed_device("cuda")  # without CUDA, or before any torch.cuda.set_device
        device(type='cuda', index=0)
    """
    d = parse_device(device, arg)
    if d is None:
        raise ArgumentTypeError(f"{arg} must be a device such as 'cpu' or 'cuda:0', not None")
    if d.type in ("cuda", "xpu") and d.index is None:
        current = 0
        if d.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
            current = torch.cuda.current_device()
        d = torch.device(d.type, current)
    return d


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtTpP]?[iI]?[bB]?)\s*")
_PREFIXES = "kmgtp"


def parse_size(size: Any, arg: str = "size") -> int:
    """Bytes from a number of bytes or a size with a unit, the one grammar of every layer.

    ``"80GiB"`` is 80 * 2**30, ``"80GB"`` 80 * 10**9 (decimal, as transformers and
    huggingface_hub read ``max_shard_size``), ``"1.5 TiB"``, ``"500MB"`` and ``"500M"`` (no B:
    decimal) likewise. A lowercase final ``b`` (``"5Gb"``, ``"5gb"``) is refused: transformers
    reads it as bits, people mean bytes.

    Examples:
        >>> parse_size("80GiB"), parse_size("5GB"), parse_size(1024)
        (85899345920, 5000000000, 1024)
    """
    if isinstance(size, bool) or not isinstance(size, (int, float, str)):
        raise ArgumentTypeError(
            f"{arg} must be a number of bytes or a size such as '80GiB' or '5GB', not {size!r}"
        )
    if isinstance(size, (int, float)):
        if not math.isfinite(size) or size < 0:
            raise ArgumentError(f"{arg}={size!r} is not a size: give a number of bytes >= 0")
        return int(size)
    match = _SIZE.fullmatch(size)
    if match is None:
        raise ArgumentError(
            f"{arg}={size!r} is not a size: give bytes, or a number with a unit such as "
            "'80GiB' (2**30 bytes a GiB) or '80GB' (10**9 bytes a GB)"
        )
    number, unit = float(match.group(1)), match.group(2)
    prefix = unit[:1].lower() if unit[:1].lower() in _PREFIXES else ""
    binary = "i" in unit.lower()
    if unit.endswith("b"):
        bytes_unit = prefix.upper() + ("i" if binary else "") + "B"
        raise ArgumentError(
            f"{arg}={size!r} is ambiguous: transformers reads a lowercase 'b' as bits. Write "
            f"'{match.group(1)}{bytes_unit}' for bytes (or 'GiB'-style binary units)."
        )
    power = _PREFIXES.index(prefix) + 1 if prefix else 0
    value = number * (1024 if binary else 1000) ** power
    if not math.isfinite(value):
        raise ArgumentError(f"{arg}={size!r} is not a size: it is past any memory there is")
    return int(value)


_VARIABLE = re.compile(r"\$(\w+|\{\w+\})")


def parse_path(path: Any, arg: str = "path", *, typed: bool = False) -> str:
    """A file system path from a ``str`` or ``os.PathLike``, the one reading of every layer.

    ``~`` is the home directory. With ``typed`` (text a person typed into a magic or a widget
    field), ``$NAME`` and ``${NAME}`` are environment variables, as in a shell. Without it (a path
    given in Python), ``$`` stays as written, as ``open`` keeps it, and a path that does not exist
    but whose ``$NAME`` is an environment variable is refused: it almost surely meant the
    variable.

    Examples:
        >>> import os
        >>> parse_path("~/ckpt") == os.path.join(os.path.expanduser("~"), "ckpt")
        True
        >>> parse_path("$HOME/ckpt", typed=True) == os.path.expandvars("$HOME/ckpt")
        True
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ArgumentTypeError(f"{arg} must be a path (a str or os.PathLike), not {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str):
        text = os.fsdecode(text)
    if typed:
        return os.path.expandvars(os.path.expanduser(text.strip()))  # as IPython's expand_path
    expanded = os.path.expanduser(text)
    if "$" in expanded and not os.path.exists(expanded):
        names = [m.group(1).strip("{}") for m in _VARIABLE.finditer(expanded)]
        if any(name in os.environ for name in names):
            raise ArgumentError(
                f"{arg}={text!r}: Python does not expand ${names[0]} in a path; pass "
                f"os.path.expandvars({text!r}), or write the path out"
            )
    return expanded


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
