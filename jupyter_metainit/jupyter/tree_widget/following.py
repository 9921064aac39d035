"""How a widget follows its model whoever changes it (code, a magic, another widget).

The core publishes the tensors it changed (``core.events``); a widget showing one of them
recomputes its rows once per burst of changes (``SYNC_DELAY_S``) and sends the page only the
rows that changed. Nothing polls while the model is idle.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from jupyter_metainit.core import local_tensor, unique_tensors
from jupyter_metainit.jupyter.module_tree import NodeStats
from jupyter_metainit.jupyter.row_schema import ROW, STATS_FIELDS
from jupyter_metainit.jupyter.tree_widget.stale_results import drop_stale_results
from jupyter_metainit.jupyter.tree_widget.wording import MODEL_GONE, model_changed_in_words

__all__ = ["FollowsModel"]

SYNC_DELAY_S = 0.1  # changes published within this window make one refresh


class FollowsModel:
    """Mixin of :class:`~jupyter_metainit.jupyter.widget.ModuleTreeWidget`: refreshes."""

    _ids: set[int]
    _refresh_lock: threading.Lock
    _measured: dict[str, tuple]
    _sync_timer: threading.Timer | None
    _stats: list[NodeStats]
    # the widget's traits and helpers these methods use
    comm: Any
    busy: Any
    status: Any
    error: Any
    tree: Any
    selection: Any
    show_table: Any
    module: Any
    _tree: Any
    send: Any
    _selection_summary: Any
    _update_table: Any

    def _tensor_ids(self) -> set[int]:
        ids = set()
        for t in unique_tensors(self.module, attributes=True):
            ids.add(id(t))
            ids.add(id(local_tensor(t)))  # a DTensor's shard is what the core changes
        return ids

    def _on_core_change(self, _kind: str, tensors: list[torch.Tensor]) -> None:
        """The core changed tensors (any thread): refresh once per burst if any is ours."""
        if self.comm is None or not any(id(t) in self._ids for t in tensors):
            return
        with self._refresh_lock:
            if self._sync_timer is not None:
                return
            self._sync_timer = threading.Timer(SYNC_DELAY_S, self._synced_refresh)
            self._sync_timer.daemon = True
            self._sync_timer.start()

    def _synced_refresh(self) -> None:
        with self._refresh_lock:
            self._sync_timer = None
        if self.comm is not None:
            # Runs in a timer thread while other threads may be swapping tensors: a refresh
            # that catches one half-way is dropped, the change that follows refreshes again.
            with contextlib.suppress(Exception):
                # A change made elsewhere (code, a magic, another widget) makes this widget's
                # last message stale: it is about a state that no longer holds.
                if self.refresh() and not self.busy:
                    self.status = ""
                    self.error = ""
                self._say_stale_results()

    def after_cell(self) -> None:
        """After each cell (``cell_watch``): a cell that deleted, replaced or added a module
        (``del model.layers[0]``) turns the actions off now, not at the next click."""
        if self.model_gone:
            return
        with contextlib.suppress(Exception):  # never in the way of the user's cells
            if not self.model_changed():
                self._say_stale_results()

    def _say_stale_results(self) -> None:
        """Drop Values / Compare results whose tensors changed since, and say so."""
        if self.busy:  # a Values or Compare job sets its result as it ends
            return
        notice = drop_stale_results(self)
        if notice:
            self.status = notice

    def model_changed(self) -> bool:
        """Whether the model was freed, or a module of it added, removed or replaced since the
        tree was drawn; if so the actions are turned off, saying which."""
        if not self._tree.alive:
            self.mark_model_gone()
            return True
        changed = self._tree.first_difference()
        if changed is not None:
            self.mark_model_gone(model_changed_in_words(changed, self.var_name))
            return True
        return False

    def mark_model_gone(self, why: str = MODEL_GONE) -> None:
        """The model was freed, or changed under the tree (``why``): say so, and turn every
        action off for good (the page greys its buttons, as when the kernel is gone)."""
        self.model_gone = True
        self.error = why

    def refresh(self) -> bool:
        """Recompute every node's totals and state; send the page only the rows that changed.
        True if any row changed."""
        if self.model_changed():
            return False
        with self._refresh_lock:
            stats = self._tree.stats()
            changed = [
                [node, *new.row()]
                for node, (old, new) in enumerate(zip(self._stats, stats, strict=True))
                if old.row() != new.row()
            ]
            self._stats: list[NodeStats] = stats
            rows = self.tree["nodes"]
            for node, *fields in changed:
                # keep the synced tree current for pages opened later
                for name, value in zip(STATS_FIELDS, fields, strict=True):
                    rows[node][ROW[name]] = value
            if changed:
                self.send({"kind": "patch", "nodes": changed})
            self.selection = self._selection_summary()
        if self.show_table:
            self._update_table()
        return bool(changed)

    def close(self) -> None:
        timer = getattr(self, "_sync_timer", None)  # None if __init__ failed
        if timer is not None:
            timer.cancel()
            # a cancelled timer's thread still holds this widget until it wakes and ends
            if timer is not threading.current_thread():
                timer.join(1.0)
        super().close()
