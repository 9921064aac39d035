"""Ctrl-C that never lands half-way: ``KeyboardInterrupt`` is held back over critical sections.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Landing in the
middle of swapping a dozen tensors into place, or between the steps of entering the ``plain``
guard, would leave one tensor real and the rest deferred, or torch-function handling switched
off on the thread. So while a materialization or a ``meta_init`` block runs on the main thread,
SIGINT goes to a handler of ours: outside a :func:`critical` section it raises at once, as usual;
inside one it is remembered and raised when the outermost section ends. Long loops (replay) call
:func:`check` between steps, so Ctrl-C stops them within one op.

Long work inside one op (a fill of a few GB, cut across threads) goes in steps of a few
milliseconds counted by a :class:`Steps`: between two steps it says how far it is on the thread
that waits for it, and stops there when that thread's progress callback raises (Cancel) or
Ctrl-C is held back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

from jupyter_metainit.core.errors import ArgumentError

__all__ = [
    "Meter",
    "Steps",
    "Stopped",
    "check",
    "copy_in_steps",
    "counting",
    "critical",
    "current_meter",
    "handling_interrupts",
    "hold_interrupts",
    "interrupted",
    "protect",
    "release_interrupts",
    "telling",
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


# How often the thread waiting for long work tells how far it is: a Cancel raised from that
# telling stops the work within this and one step of it. The documented switch
# JUPYTER_METAINIT_PROGRESS_SECONDS (docs/notebook-workflow.md) sets another interval, read
# when the work starts: 0 tells after every step (a callable that logs wants less often).
TELL_S = 0.2
PROGRESS_SECONDS_VARIABLE = "JUPYTER_METAINIT_PROGRESS_SECONDS"


def tell_interval() -> float:
    """Seconds between two tellings of how far long work is: :data:`TELL_S`, or what
    :data:`PROGRESS_SECONDS_VARIABLE` sets."""
    text = os.environ.get(PROGRESS_SECONDS_VARIABLE, "").strip()
    if not text:
        return TELL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ArgumentError(
            f"{PROGRESS_SECONDS_VARIABLE}={text!r}: give the seconds between two progress "
            f"reports, a number >= 0 (or unset it for {TELL_S})"
        )
    return seconds


class Stopped(Exception):
    """Raised at a worker thread's next step once the work it belongs to was stopped (by the
    waiting thread's failure or Cancel, or by Ctrl-C); the waiting thread raises the reason."""


class Steps:
    """Long work, in steps on one or several threads, that says how far it is and stops
    between two steps: one per ``materialize`` or ``save`` call.

    The thread that makes it (the *owner*, the caller's) calls ``tell(units)`` with the units
    counted so far at most every :data:`TELL_S`: after a step it runs itself (:meth:`step`),
    and while it waits for threads doing the work (:meth:`wait`). A ``tell`` that raises stops
    the work: every other thread raises :class:`Stopped` at its next step, and the owner raises
    the ``tell``'s exception once they have. A held-back Ctrl-C (:func:`interrupted`) stops it
    the same way, raised on the owner as ``KeyboardInterrupt``.
    """

    def __init__(self, tell: Callable[[int], None] | None = None) -> None:
        self.tell = tell
        self.owner = threading.get_ident()
        self._lock = threading.Lock()
        self._done = 0.0
        self._stop = threading.Event()
        self._told = time.monotonic()
        self.every = tell_interval()

    @property
    def done(self) -> int:
        """Units counted so far (what ``tell`` gets)."""
        return int(self._done)

    def add(self, units: float, meter: Meter | None = None) -> None:
        """Count ``units`` (from any thread; negative to take them back), silently."""
        with self._lock:
            self._done += units
            if meter is not None:
                meter.added += units

    def step(self) -> None:
        """Between two steps of work: on the owner, tell how far it is when due (and raise a
        held-back Ctrl-C); on another thread, raise :class:`Stopped` if the work was stopped."""
        if threading.get_ident() != self.owner:
            if self._stop.is_set() or interrupted():
                raise Stopped
            return
        check()
        if self.tell is None or time.monotonic() - self._told < self.every:
            return
        self._told = time.monotonic()
        try:
            self.tell(self.done)
        except BaseException:
            self._stop.set()
            raise

    def wait(self, futures: Sequence[concurrent.futures.Future]) -> list[Any]:
        """The results of ``futures`` (work of these steps queued on threads), in order; on
        the owner, telling how far it is meanwhile. The first failure, Cancel or Ctrl-C stops
        the others at their next step and is raised once they have all ended."""
        try:
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(
                    pending, max(self.every / 2, 0.005), concurrent.futures.FIRST_EXCEPTION
                )
                self.step()
                for f in done:
                    f.result()
            return [f.result() for f in futures]
        except BaseException as exc:
            self._stop.set()
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
            if isinstance(exc, Stopped) and threading.get_ident() == self.owner:
                raise KeyboardInterrupt from None  # a Ctrl-C another check took first
            raise


class Meter:
    """What one piece of work (an op) counts into its :class:`Steps`: its own units (bytes it
    made) times ``weight`` (how much of the caller's progress each stands for). The work finds
    it with :func:`current_meter` and hands it to the threads it starts."""

    __slots__ = ("added", "steps", "weight")

    def __init__(self, steps: Steps, weight: float = 1.0) -> None:
        self.steps = steps
        self.weight = weight
        self.added = 0.0

    def step(self, units: int = 0) -> None:
        """After a step of ``units``: count them, then :meth:`Steps.step`."""
        if units and self.weight:
            self.steps.add(units * self.weight, self)
        self.steps.step()

    def wait(self, futures: Sequence[concurrent.futures.Future]) -> list[Any]:
        """:meth:`Steps.wait`."""
        return self.steps.wait(futures)


class _Current(threading.local):
    meter: Meter | None = None


_current = _Current()


def current_meter() -> Meter:
    """The meter :func:`counting` put on this thread, or one of new steps owned by this thread
    (work nobody watches still stops everywhere on a failure or Ctrl-C)."""
    meter = _current.meter
    return meter if meter is not None else Meter(Steps())


class counting:
    """Within the block, work on this thread counts into ``steps`` with ``weight``
    (:func:`current_meter`); ``take_back``: what it counted is taken back at the end (an op
    whose outputs are then counted whole). Ctrl-C cannot cut entering or leaving it
    (:func:`protect`): a meter left behind would count a later call's work."""

    __slots__ = ("meter", "previous", "take_back")

    def __init__(self, steps: Steps, weight: float = 1.0, take_back: bool = False) -> None:
        self.meter = Meter(steps, weight)
        self.take_back = take_back
        self.previous: Meter | None = None

    def __enter__(self) -> Meter:
        self.previous = _current.meter
        _current.meter = self.meter
        return self.meter

    def __exit__(self, *exc: Any) -> None:
        _current.meter = self.previous
        if self.take_back and self.meter.added:
            self.meter.steps.add(-self.meter.added, self.meter)


protect(counting.__enter__, counting.__exit__)


# A copy of more than this many bytes goes in steps of this many (a few milliseconds each).
STEP_BYTES = 16 << 20


def copy_in_steps(dst: Any, src: Any, counted: bool = True) -> None:
    """``dst.copy_(src)`` (a cast, or a move between devices, too) in steps of
    :data:`STEP_BYTES` of ``dst``: between two the caller's progress is told (the bytes copied,
    if ``counted``) and may stop it. For copies of gigabytes: a checkpoint's bytes read from
    its file (the copy is what reads them), a cast. Both contiguous, else one copy."""
    n = dst.numel()
    if (
        dst.nbytes <= STEP_BYTES
        or src.numel() != n
        or not (dst.is_contiguous() and src.is_contiguous())
    ):
        dst.copy_(src)
        return
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    meter = current_meter()
    step = STEP_BYTES // dst.element_size()
    for a in range(0, n, step):
        meter.step()
        flat_dst[a : a + step].copy_(flat_src[a : a + step])
        if counted:
            meter.step((min(n, a + step) - a) * dst.element_size())


def telling(tell: Callable[[int], None]) -> counting:
    """Within the block, long work on this thread (and on the threads it starts) counts the
    bytes it makes in steps, and ``tell(bytes so far)`` is called on this thread about every
    :data:`TELL_S`; raising from it (Cancel) stops the work within a step and propagates. How
    ``save`` reports progress inside a batch of tensors being generated."""
    return counting(Steps(tell))
