"""Ctrl-C that never lands half-way: ``KeyboardInterrupt`` is held back over critical sections.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Landing in the
middle of swapping a dozen tensors into place, or between the steps of entering the ``plain``
guard, would leave one tensor real and the rest deferred, or torch-function handling switched
off on the thread. So while a materialization or a ``meta_init`` block runs on the main thread,
SIGINT goes to a handler of ours: outside a :func:`critical` section it raises at once, as usual;
inside one it is remembered and raised when the outermost section ends. Long loops (replay) call
:func:`check` between steps, so Ctrl-C stops them within one op.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "check",
    "protect",
    "critical",
    "handling_interrupts",
    "hold_interrupts",
    "interrupted",
    "release_interrupts",
]


class _Depth(threading.local):
    def __init__(self) -> None:
        self.value = 0


_depth = _Depth()
_pending = threading.Event()  # SIGINT arrived while the main thread was in a critical section
_previous: Any = None  # the handler ours hands signals to outside critical sections


_protected: set[Any] = set()  # code objects during which an interrupt waits


def protect(*functions: Any) -> None:
    """Hold Ctrl-C back while any of ``functions`` runs, from its very first bytecode (for
    ``__enter__``/``__exit__`` methods: a critical section they open themselves would start
    one instruction too late)."""
    _protected.update(f.__code__ for f in functions)


def _in_protected(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _protected:
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    if _depth.value > 0 or _in_protected(frame):
        _pending.set()
        return
    previous = _previous
    if callable(previous) and previous is not _handler:
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def handling_interrupts() -> Iterator[None]:
    """Route SIGINT through :func:`_handler` for the duration (main thread only).

    The outermost use installs it and puts the previous handler back. Written so that a Ctrl-C
    landing anywhere in here leaves at worst our handler installed, which, outside critical
    sections, hands every signal to the previous one: the same behaviour.
    """
    global _previous
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed_here = False
    try:
        current = signal.getsignal(signal.SIGINT)
        if current is not _handler:
            _previous = current
            signal.signal(signal.SIGINT, _handler)
            installed_here = True
    except ValueError:  # not the main interpreter: leave signals alone
        pass
    try:
        yield
    finally:
        if installed_here:
            signal.signal(signal.SIGINT, _previous)


class critical:
    """A section that a ``KeyboardInterrupt`` must not cut in two (re-entrant, per thread).

    A class rather than a generator context manager: it wraps every recorded op.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _depth.value += 1

    def __exit__(self, *exc: Any) -> None:
        _depth.value -= 1
        if _depth.value == 0 and _pending.is_set():
            _pending.clear()
            if exc[0] is None:  # else the exception on its way out aborts the work already
                raise KeyboardInterrupt


def hold_interrupts() -> None:
    """Start a critical section (the function form of ``critical``)."""
    _depth.value += 1


def release_interrupts(raise_pending: bool = True) -> None:
    """End a critical section; raise a held-back ``KeyboardInterrupt`` if this was the outermost
    one and ``raise_pending`` (else it stays pending for the next check)."""
    _depth.value -= 1
    if raise_pending and _depth.value == 0:
        check()


def interrupted() -> bool:
    """True if Ctrl-C arrived and has not been raised yet."""
    return _pending.is_set()


def check() -> None:
    """Raise the ``KeyboardInterrupt`` held back since the last check, if any."""
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
