"""One lock for everything that turns recordings into values.

``materialize``, ``dematerialize``, ``materialize_sharded`` and value reads while recording
(``.item()``) all take it *before* they look at any tensor, so a second request on any thread
(another widget, a cell while a widget works) waits for the first, or, asked not to wait, gets a
:class:`BusyError` that says what is running. Recording itself does not take it: building a model
in one cell while another is being materialized only waits if it has to read values.
"""

from __future__ import annotations

import contextlib
import threading
import time

from jupyter_metainit.core.errors import BusyError
from jupyter_metainit.core.runtime.interrupts import check, interrupted, protect

__all__ = ["busy_with", "exclusive"]

_lock = threading.RLock()
_activity: list[tuple[str, str, float]] = []  # (what, thread name, start), outermost first


class exclusive:
    """Hold the lock while doing ``what`` (re-entrant on one thread).

    With ``wait=False``, raise :class:`BusyError` at once if another thread holds it. A class
    whose ``__enter__``/``__exit__`` Ctrl-C cannot cut (``interrupts.protect``): an interrupt
    between taking the lock and entering the ``with`` body would otherwise leave it taken
    for good. While waiting for another thread, Ctrl-C stops the wait.
    """

    __slots__ = ("wait", "what")

    def __init__(self, what: str, *, wait: bool = True) -> None:
        self.what = what
        self.wait = wait

    def __enter__(self) -> None:
        while True:
            if _lock.acquire(timeout=0.1 if self.wait else 0):
                _activity.append((self.what, threading.current_thread().name, time.monotonic()))
                return
            if not self.wait:
                raise BusyError(
                    f"busy with {busy_with() or 'another materialization'}; wait for it to "
                    "finish, or cancel it, then try again"
                )
            check()  # nothing is held yet: a Ctrl-C while waiting stops the wait

    def __exit__(self, *exc: object) -> None:
        _activity.pop()
        _lock.release()
        if exc[0] is None:
            check()  # a Ctrl-C held back in here surfaces now, not in some later call
        elif interrupted():
            with contextlib.suppress(KeyboardInterrupt):  # the exception aborts the work anyway
                check()


protect(exclusive.__enter__, exclusive.__exit__)


def busy_with() -> str | None:
    """What holds the lock now (``"materializing model.layers.0 (12 s, thread ...)"``), if any."""
    if not _activity:
        return None
    what, thread, start = _activity[0]
    return f"{what} ({time.monotonic() - start:.0f} s so far, in thread {thread!r})"
