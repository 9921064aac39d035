"""Per-thread recording state: is this thread inside ``meta_init``, and with which defaults.

Every ``meta_init`` block pushes its ``device``/``dtype`` here; the recorder reads them. Kept in
its own module so that the recorder, the context manager and the device rewriting share it
without importing each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._device import DeviceContext

from jupyter_metainit.core.runtime.interrupts import critical

__all__ = [
    "default_device",
    "default_dtype",
    "default_dtype_as",
    "dtype_override",
    "tls",
]


class RecordingState(threading.local):
    """What the current thread's ``meta_init`` blocks asked for (innermost last)."""

    def __init__(self) -> None:
        self.depth = 0
        self.devices: list[torch.device | None] = []
        # Thread-local default dtype while a ``meta_init(dtype=...)`` block runs (innermost
        # last); ``torch.set_default_dtype`` inside such a block changes the innermost entry.
        self.dtypes: list[torch.dtype | None] = []
        # Device the tensors of the torch-level call being recorded must report.
        self.pending_device: torch.device | None = None
        # Where user code made the torch-level call being handled (``ops.Where``): found once
        # per call rather than once per ATen op it dispatches.
        self.where: Any = None


tls = RecordingState()


def default_device() -> torch.device:
    """The device a new tensor reports when its code names none."""
    if tls.devices and tls.devices[-1] is not None:
        return tls.devices[-1]
    return _torch_default_device()


_CPU = torch.device("cpu")
# What torch.get_default_device reads, on every torch this package supports; if a release moves
# them, torch's own function answers.
_MODE_STACK_READABLE = all(
    hasattr(torch._C, name) for name in ("_len_torch_function_stack", "_get_function_stack_at")
) and hasattr(torch, "_GLOBAL_DEVICE_CONTEXT")


def _torch_default_device() -> torch.device:
    """``torch.get_default_device()``, which this asks for every factory call, without its
    per-call imports and mode-stack list: the innermost ``DeviceContext`` mode's device, else
    ``torch.set_default_device``'s, else the CPU."""
    if not _MODE_STACK_READABLE:
        return torch.get_default_device()
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, DeviceContext):
            device = mode.device
            break
    else:
        context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
        if context is None:
            return _CPU
        device = context.device
    if device.index is None and device.type != "cpu":
        return torch.get_default_device()  # the current accelerator index: torch's own answer
    return device


def dtype_override() -> torch.dtype | None:
    """The default dtype of the innermost ``meta_init(dtype=...)`` on this thread, if any."""
    for d in reversed(tls.dtypes):
        if d is not None:
            return d
    return None


def default_dtype() -> torch.dtype:
    """This thread's default floating dtype (the ``meta_init(dtype=)`` one inside such a block)."""
    override = dtype_override()
    return override if override is not None else _global_default_dtype()


# ``torch.get_default_dtype`` may be replaced while a ``meta_init(dtype=)`` block runs (see
# ``context``); the real one is kept here.
_global_default_dtype = torch.get_default_dtype


_default_dtype_lock = threading.Lock()


@contextlib.contextmanager
def default_dtype_as(dtype: torch.dtype | None) -> Iterator[None]:
    """Run one op whose result dtype comes from the default dtype as it was recorded.

    PyTorch's default dtype is process-wide; the few ops that depend on it (an integer tensor
    divided by an int) switch it for their own duration only, under a lock.
    """
    if dtype is None or dtype == torch.get_default_dtype():
        yield
        return
    with critical(), _default_dtype_lock:
        saved = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(saved)
