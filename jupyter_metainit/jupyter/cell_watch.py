"""Whether a notebook cell is running now: widgets' clicks that change the model wait for it.

Kept apart from the widget: the magics start watching at ``%load_ext``, widgets wait on it."""

from __future__ import annotations

import weakref
from typing import Any


class _CellWatch:
    """Whether a notebook cell is running now, from IPython's ``pre_run_cell`` and
    ``post_run_cell`` events.

    The kernel can hand a widget its page messages while a cell runs (whenever the cell lets
    go of the GIL, e.g. in torch ops), so a click's Free could pull weights from under a
    forward pass in that cell.  Page actions that change the model wait for the cell to end
    instead (see ``tree_widget/actions.ActionRunner``).  Only cells that start after
    the watch is set up are seen: it is set up by ``%load_ext jupyter_metainit`` and by every
    widget made."""

    def __init__(self) -> None:
        self.shell: Any = None
        self.running = False
        # widgets' action runners with a queued action (tree_widget/actions.ActionRunner)
        self.waiting: weakref.WeakSet[Any] = weakref.WeakSet()
        # widgets' model followers told after each cell, which may have changed their model's
        # modules (tree_widget/following.ModelFollower)
        self.followers: weakref.WeakSet[Any] = weakref.WeakSet()

    def watch(self, shell: Any) -> None:
        if shell is None or shell is self.shell or not hasattr(shell, "events"):
            return
        if self.shell is not None:
            self.shell.events.unregister("pre_run_cell", self._started)
            self.shell.events.unregister("post_run_cell", self._ended)
        shell.events.register("pre_run_cell", self._started)
        shell.events.register("post_run_cell", self._ended)
        self.shell, self.running = shell, False

    def _started(self, info: Any = None) -> None:
        self.running = True

    def _ended(self, result: Any = None) -> None:
        self.running = False
        for runner in list(self.waiting):
            self.waiting.discard(runner)
            runner.run_queued()
        for follower in list(self.followers):
            follower.after_cell()


cells = _CellWatch()


def watch_cells(shell: Any = None) -> None:
    """Follow which cells run in ``shell`` (the current IPython shell if None)."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:  # no IPython: no cells to wait for
            return
        shell = get_ipython()
    cells.watch(shell)
