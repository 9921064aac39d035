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
from collections.abc import Iterator

from jupyter_metainit.core._interrupts import critical
from jupyter_metainit.core.errors import BusyError

__all__ = ["busy_with", "exclusive"]

_lock = threading.RLock()
_activity: list[tuple[str, str, float]] = []  # (what, thread name, start), outermost first


@contextlib.contextmanager
def exclusive(what: str, *, wait: bool = True) -> Iterator[None]:
    """Hold the lock while doing ``what`` (re-entrant on one thread).

    With ``wait=False``, raise :class:`BusyError` at once if another thread holds it.
    """
    while True:
        # Each attempt is a critical section (Ctrl-C cannot leave the lock taken and not
        # recorded); between attempts, a wait for another thread can be interrupted.
        with critical():
            if _lock.acquire(timeout=0.1 if wait else 0):
                _activity.append((what, threading.current_thread().name, time.monotonic()))
                break
        if not wait:
            raise BusyError(
                f"busy with {busy_with() or 'another materialization'}; wait for it to finish, "
                "or cancel it, then try again"
            )
    try:
        yield
    finally:
        with critical():
            _activity.pop()
            _lock.release()


def busy_with() -> str | None:
    """What holds the lock now (``"materializing model.layers.0 (12 s, thread ...)"``), if any."""
    if not _activity:
        return None
    what, thread, start = _activity[0]
    return f"{what} ({time.monotonic() - start:.0f} s so far, in thread {thread!r})"
