"""How a widget follows its model whoever changes it (code, a magic, another widget).

The core publishes the tensors it changed (``core.events``); a widget showing one of them
recomputes its rows once per burst of changes (``SYNC_DELAY_S``) and sends the page only the
rows that changed. Nothing polls while the model is idle.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from jupyter_metainit.core import local_tensor, unique_tensors
from jupyter_metainit.jupyter.module_tree import ModuleTree, NodeStats
from jupyter_metainit.jupyter.row_schema import ROW, STATS_FIELDS
from jupyter_metainit.jupyter.tree_widget.host import WidgetHost
from jupyter_metainit.jupyter.tree_widget.stale_results import drop_stale_results
from jupyter_metainit.jupyter.tree_widget.wording import MODEL_GONE, model_changed_in_words

__all__ = ["ModelFollower"]

SYNC_DELAY_S = 0.1  # changes published within this window make one refresh


class ModelFollower:
    """A widget's view of its model's state: each node's totals as last measured, and the
    refresh that follows the core's changes, the cells and the model's end.

    Args:
        host: the widget whose rows, selection and messages it keeps current.
        tree: the widget's tree (drawn once from ``module``).
        module: the model (only read here, to know which tensors are its own).
    """

    def __init__(self, host: WidgetHost, tree: ModuleTree, module: nn.Module) -> None:
        self._host = host
        self._tree = tree
        self.stats: list[NodeStats] = tree.stats()  # each node's totals, as the page shows them
        self._ids = _tensor_ids(module)  # the tensors whose changes concern this widget
        self._lock = threading.Lock()  # the timer's check-and-set, and one refresh at a time
        self._timer: threading.Timer | None = None

    def on_core_change(self, _kind: str, tensors: list[torch.Tensor]) -> None:
        """The core changed tensors (any thread): refresh once per burst if any is ours."""
        if self._host.comm is None or not any(id(t) in self._ids for t in tensors):
            return
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(SYNC_DELAY_S, self._synced_refresh)
            self._timer.daemon = True
            self._timer.start()

    def _synced_refresh(self) -> None:
        with self._lock:
            self._timer = None
        host = self._host
        if host.comm is not None:
            # Runs in a timer thread while other threads may be swapping tensors: a refresh
            # that catches one half-way is dropped, the change that follows refreshes again.
            with contextlib.suppress(Exception):
                # A change made elsewhere (code, a magic, another widget) makes this widget's
                # last message stale: it is about a state that no longer holds.
                if self.refresh() and not host.busy:
                    host.status = ""
                    host.error = ""
                self._say_stale_results()

    def after_cell(self) -> None:
        """After each cell (``cell_watch``): a cell that deleted, replaced or added a module
        (``del model.layers[0]``) turns the actions off now, not at the next click."""
        if self._host.model_gone:
            return
        with contextlib.suppress(Exception):  # never in the way of the user's cells
            if not self.model_changed():
                self._say_stale_results()

    def _say_stale_results(self) -> None:
        """Drop Values / Compare results whose tensors changed since, and say so."""
        if self._host.busy:  # a Values or Compare job sets its result as it ends
            return
        notice = drop_stale_results(self._host)
        if notice:
            self._host.status = notice

    def model_changed(self) -> bool:
        """Whether the model was freed, or a module of it added, removed or replaced since the
        tree was drawn; if so the actions are turned off, saying which."""
        if not self._tree.alive:
            self.mark_model_gone()
            return True
        changed = self._tree.first_difference()
        if changed is not None:
            self.mark_model_gone(model_changed_in_words(changed, self._host.var_name))
            return True
        return False

    def mark_model_gone(self, why: str = MODEL_GONE) -> None:
        """The model was freed, or changed under the tree (``why``): say so, and turn every
        action off for good (the page greys its buttons, as when the kernel is gone)."""
        self._host.model_gone = True
        self._host.error = why

    def refresh(self) -> bool:
        """Recompute every node's totals and state; send the page only the rows that changed.
        True if any row changed."""
        if self.model_changed():
            return False
        host = self._host
        with self._lock:
            stats = self._tree.stats()
            changed = [
                [node, *new.row()]
                for node, (old, new) in enumerate(zip(self.stats, stats, strict=True))
                if old.row() != new.row()
            ]
            self.stats = stats
            rows = host.tree["nodes"]
            for node, *fields in changed:
                # keep the synced tree current for pages opened later
                for name, value in zip(STATS_FIELDS, fields, strict=True):
                    rows[node][ROW[name]] = value
            if changed:
                host.send({"kind": "patch", "nodes": changed})
            host.selection = host._selection_summary()
        if host.show_table:
            host._update_table()
        return bool(changed)

    def close(self) -> None:
        """Stop a pending refresh (the widget closes)."""
        timer = self._timer
        if timer is not None:
            timer.cancel()
            # a cancelled timer's thread still holds this widget until it wakes and ends
            if timer is not threading.current_thread():
                timer.join(1.0)


def _tensor_ids(module: nn.Module) -> set[int]:
    ids = set()
    for t in unique_tensors(module, attributes=True):
        ids.add(id(t))
        ids.add(id(local_tensor(t)))  # a DTensor's shard is what the core changes
    return ids
