"""Run real tensor code with every interception switched off."""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.runtime.interrupts import hold_interrupts, protect, release_interrupts

# Bound once: ``plain`` is entered several times for every recorded op.
_DisableTorchFunction = torch._C.DisableTorchFunction
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
_is_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled


class plain:
    """No torch-function modes/subclasses, no dispatch modes, no autograd: real kernels only.

    Replay and internal bookkeeping use it so that an active ``meta_init`` (or a user's own mode,
    such as a FLOP counter) neither records nor counts our own work. A class rather than a
    ``contextlib`` generator because it wraps every recorded op.
    """

    __slots__ = ("_grad", "_guards")

    def __enter__(self) -> None:
        # The whole block is a critical section (see ``interrupts``): a Ctrl-C between two steps
        # of entering or leaving would leave torch-function handling or autograd switched off
        # on this thread. It is raised on the way out, or at a `check()` inside (replay).
        hold_interrupts()
        functions, dispatch = _DisableTorchFunction(), _DisableTorchDispatch()
        self._guards = (functions, dispatch)
        functions.__enter__()
        dispatch.__enter__()
        self._grad = _is_grad_enabled()
        _set_grad_enabled(False)

    def __exit__(self, *exc: Any) -> None:
        try:
            _set_grad_enabled(self._grad)
            functions, dispatch = self._guards
            dispatch.__exit__(*exc)
            functions.__exit__(*exc)
        finally:
            release_interrupts(raise_pending=exc[0] is None)


class subclass_functions_off:
    """``torch._C.DisableTorchFunctionSubclass()``, entered and left in a critical section so
    that a Ctrl-C cannot leave it on (see ``interrupts``); the block runs with Ctrl-C held
    back, raised when it ends or at a ``check()`` inside."""

    __slots__ = ("_guard",)

    def __enter__(self) -> None:
        hold_interrupts()
        self._guard = _DisableTorchFunctionSubclass()
        self._guard.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._guard.__exit__(*exc)
        finally:
            release_interrupts(raise_pending=exc[0] is None)


protect(
    plain.__enter__,
    plain.__exit__,
    subclass_functions_off.__enter__,
    subclass_functions_off.__exit__,
)


_SEQUENCES = (list, tuple)


def _map_sequence(fn: Any, x: list | tuple) -> Any:
    """``fn`` applied to each element of a ``Tensor[]``-like argument; lists of plain ints
    (sizes, dims) are returned as they are."""
    for v in x:
        if type(v) is not int:
            return type(x)([fn(v) for v in x])
    return x


def map_args(fn: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Apply ``fn`` to every argument of an ATen call, one list level deep (``Tensor[]``).

    ATen schemas nest no deeper, and this runs several times for every recorded op (pytree is
    too slow). Lists of plain ints (sizes, dims) are passed through: ``fn`` maps tensors,
    devices and records, never an int.
    """
    mapped = tuple([_map_sequence(fn, x) if type(x) in _SEQUENCES else fn(x) for x in args])
    if not kwargs:
        return mapped, {}
    return mapped, {
        k: _map_sequence(fn, x) if type(x) in _SEQUENCES else fn(x) for k, x in kwargs.items()
    }


def iter_args(args: tuple, kwargs: dict) -> list[Any]:
    """Every argument of an ATen call, lists flattened one level."""
    out: list[Any] = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if type(x) in _SEQUENCES:
            out.extend(x)
        else:
            out.append(x)
    return out
