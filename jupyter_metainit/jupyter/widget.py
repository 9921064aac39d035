"""The clickable model tree that ``%%meta_init`` shows under the cell.

Use :func:`explore` on any ``nn.Module`` (deferred, real or a mix) to see its hierarchy with
parameter counts, sizes and where each part lives, to select subtrees with checkboxes, and to
materialize or free them with a button.  The front end never sends code: only actions on
qualified module names, which this side checks against the tree before calling the core.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

import anywidget
import torch
import traitlets
from torch import nn

from jupyter_metainit.jupyter._tree import ModuleTree, NodeStats

__all__ = ["ModuleTreeWidget", "explore"]

_STATIC = pathlib.Path(__file__).parent / "static"
_DTYPES: dict[str, torch.dtype | None] = {
    "": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_PROGRESS_INTERVAL_S = 0.05  # at most 20 progress messages a second


class ActionCancelled(Exception):
    """Raised from the progress callback when the person clicks Cancel."""


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; the same units the front end shows."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cuda_devices() -> tuple[list[dict[str, str]], str]:
    """The visible CUDA devices as ``[{"name", "label"}]``, and why there are none if so."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return [], "This PyTorch build has no CUDA support, so there is no GPU to materialize to."
    if not torch.cuda.is_available():
        return [], "No CUDA device is visible to this kernel (torch.cuda.is_available() is False)."
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {"name": f"cuda:{i}", "label": f"{props.name}, {human_bytes(props.total_memory)}"}
        )
    return devices, ""


def _core() -> Any:
    import jupyter_metainit.core as core  # imported late: the widget must load without it

    return core


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


class ModuleTreeWidget(anywidget.AnyWidget):
    """Interactive tree of a model: explore it, select subtrees, materialize or free them.

    Read or set the selection from Python with ``w.selected`` (qualified module names,
    ``""`` is the whole model).  ``w.materialize("cpu")`` and ``w.free()`` do what the buttons
    do, for the current selection.  After changing the model from code, ``w.refresh()``
    updates the badges and totals.
    """

    _esm = _STATIC / "widget.js"
    _css = _STATIC / "widget.css"

    tree = traitlets.Dict(help="The whole tree, sent once; later changes come as patches.").tag(
        sync=True
    )
    selected = traitlets.List(traitlets.Unicode(), help="Selected subtrees (qualified names).").tag(
        sync=True
    )
    selection = traitlets.Dict(help="Totals of the selection, computed here.").tag(sync=True)
    expand_depth = traitlets.Int(2, help="Depth the tree opens to at first.").tag(sync=True)
    busy = traitlets.Unicode("", help="The running action, '' when idle.").tag(sync=True)
    progress = traitlets.List([0, 0], help="[bytes done, bytes total] of the action.").tag(
        sync=True
    )
    error = traitlets.Unicode("", help="The last error, in plain words.").tag(sync=True)
    status = traitlets.Unicode("", help="What the last action did.").tag(sync=True)
    rng = traitlets.Enum(["exact", "fast"], "exact").tag(sync=True)
    dtype = traitlets.Enum(list(_DTYPES), "", help="'' keeps each tensor's dtype.").tag(sync=True)
    devices = traitlets.List(help="Visible CUDA devices.").tag(sync=True)
    no_cuda_reason = traitlets.Unicode("").tag(sync=True)
    show_table = traitlets.Bool(False, help="Show the memory table of the selection.").tag(
        sync=True
    )
    table_html = traitlets.Unicode("").tag(sync=True)

    def __init__(self, module: nn.Module, *, depth: int = 2, **kwargs: Any) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"explore() needs an nn.Module, got {type(module).__name__}")
        self.module = module
        self._tree = ModuleTree.build(module)
        self._stats = self._tree.stats()
        devices, reason = _cuda_devices()
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        self._last_progress = 0.0
        super().__init__(
            tree=self._tree.to_json(self._stats),
            expand_depth=depth,
            devices=devices,
            no_cuda_reason=reason,
            **kwargs,
        )
        self.selection = self._selection_summary()
        self.on_msg(self._on_msg)

    def __repr__(self) -> str:
        # What plain-text front ends (terminals, nbconvert to text) show instead of the tree.
        from jupyter_metainit.estimates.render import format_bytes, format_count

        root = self._stats[0]
        return (
            f"ModuleTreeWidget({type(self.module).__name__}: {format_count(root.params)} params, "
            f"{format_bytes(root.bytes)}, {root.state})"
        )

    # ------------------------------------------------------------------ selection
    @traitlets.validate("selected")
    def _validate_selected(self, proposal: dict) -> list[str]:
        return self._normalize(proposal["value"])

    def _normalize(self, names: Iterable[str]) -> list[str]:
        """Check names and bring them to the front end's canonical form (see ModuleTree)."""
        nodes = []
        for name in names:
            if not isinstance(name, str) or name not in self._tree.index:
                raise traitlets.TraitError(f"{name!r} is not a module of this model")
            nodes.append(self._tree.index[name])
        return [self._tree.names[n] for n in self._tree.normalize_selection(nodes)]

    @traitlets.observe("selected", "dtype")
    def _on_selection(self, _change: dict) -> None:
        self.selection = self._selection_summary()
        if self.show_table:
            self._update_table()

    def _selection_summary(self) -> dict:
        nodes = [self._tree.index[n] for n in self.selected]
        return self._tree.selection_stats(nodes, _DTYPES[self.dtype])

    # ------------------------------------------------------------------ table
    @traitlets.observe("show_table")
    def _on_show_table(self, _change: dict) -> None:
        self._update_table()

    def _update_table(self) -> None:
        if not self.show_table:
            self.table_html = ""
            return
        try:
            self.table_html = self._table_html()
        except Exception as exc:  # the table is an aid; never break the widget over it
            self.table_html = ""
            self.error = f"Could not build the memory table: {type(exc).__name__}: {exc}"

    def _table_html(self) -> str:
        names = self.selected or [""]
        dtype = _DTYPES[self.dtype]
        try:
            from jupyter_metainit.estimates import memory_table
        except ImportError:
            memory_table = None
        if memory_table is not None:
            parts = []
            for name in names:
                table = memory_table(self.module.get_submodule(name), depth=1, dtype=dtype)
                html = table._repr_html_() if hasattr(table, "_repr_html_") else None
                if len(names) > 1:
                    parts.append(f"<h4 class='jmi-table-title'>{escape(name or '(model)')}</h4>")
                parts.append(html or table.to_html(border=0))
            return "\n".join(parts)
        return self._fallback_table(names).to_html(border=0, index=False, classes="jmi-table")

    def _fallback_table(self, names: Sequence[str]) -> Any:
        import pandas as pd

        rows = []
        for name in names:
            for node in [self._tree.index[name], *self._tree.children[self._tree.index[name]]]:
                st = self._stats[node]
                rows.append(
                    {
                        "module": self._tree.names[node] or "(model)",
                        "type": type(self._tree.modules[node]).__name__,
                        "params": st.params,
                        "size": human_bytes(st.bytes),
                        "state": st.state,
                    }
                )
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ actions
    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        self.handle_action(content)

    def handle_action(self, content: Any) -> None:
        """Carry out one action message from the front end (also usable from Python).

        ``{"action": "materialize", "device": "cpu" | "cuda:N", "names": [...]}``,
        ``{"action": "free", "names": [...]}``, ``{"action": "cancel"}`` or
        ``{"action": "refresh"}``.  Anything invalid is refused with a visible error.
        """
        if not isinstance(content, dict):
            self.error = "Ignored a malformed message from the page."
            return
        action = content.get("action")
        if action == "cancel":
            self._cancel.set()
            return
        if action == "refresh":
            self.refresh()
            return
        if action not in ("materialize", "free"):
            self.error = f"Unknown action {action!r}."
            return
        if self.busy:
            self.error = f"Still busy with {self.busy}; wait for it or cancel it first."
            return
        try:
            names = self._check_names(content.get("names"))
            device = self._check_device(content.get("device")) if action == "materialize" else ""
        except ValueError as exc:
            self.error = str(exc)
            return
        self.error = ""
        self.status = ""
        self._cancel.clear()
        self.progress = [0, self._tree.selection_stats(self._tree.index[n] for n in names)["bytes"]]
        self.busy = f"{action} {device}".strip()
        self._worker = threading.Thread(
            target=self._run,
            args=(action, names, device),
            name="jupyter_metainit-widget",
            daemon=True,
        )
        self._worker.start()

    def _check_names(self, names: Any) -> list[str]:
        if not isinstance(names, list) or not names:
            raise ValueError("Select at least one module first (tick its checkbox).")
        try:
            names = self._normalize(names)
        except traitlets.TraitError as exc:
            raise ValueError(f"Refused: {exc}. Nothing was done.") from None
        for name in names:
            try:
                found = self.module.get_submodule(name)
            except AttributeError:
                found = None
            if found is not self._tree.modules[self._tree.index[name]]:
                raise ValueError(
                    f"The model changed since the tree was drawn ({name!r} is no longer the "
                    "same module); run explore() again."
                )
        return names

    def _check_device(self, device: Any) -> str:
        if device == "cpu":
            return device
        if device in {d["name"] for d in self.devices}:
            return device
        raise ValueError(f"Refused: {device!r} is not a device this kernel can use.")

    def _progress(self, done: int, total: int) -> None:
        if self._cancel.is_set():
            raise ActionCancelled
        now = time.monotonic()
        if now - self._last_progress >= _PROGRESS_INTERVAL_S or done >= total:
            self._last_progress = now
            self.progress = [int(done), int(total)]

    def _run(self, action: str, names: list[str], device: str) -> None:
        modules = [self.module.get_submodule(n) for n in names]
        what = _describe(names)
        before = [(s.params, s.bytes, s.state) for s in self._stats]
        t0 = time.monotonic()
        try:
            core = _core()
            if action == "materialize":
                core.materialize(
                    modules,
                    device,
                    dtype=_DTYPES[self.dtype],
                    rng=self.rng,
                    keep_cache=True,  # so that Free can make them deferred again
                    progress=self._progress,
                )
            else:
                core.dematerialize(modules)
        except ActionCancelled:
            self.refresh()
            self.status = f"Cancelled: {what} left as it was."
        except Exception as exc:
            self.refresh()
            after = [(s.params, s.bytes, s.state) for s in self._stats]
            self.error = _explain(exc, action, device, what, self.selection.get("bytes", 0)) + (
                " The model was left as it was."
                if after == before
                else " Part of the model changed state; see the badges."
            )
        else:
            self.refresh()
            self.progress = [self.progress[1], self.progress[1]]
            left = {self._stats[self._tree.index[n]].state for n in names} - {"deferred", ""}
            if action == "free" and left:
                self.error = (
                    f"Could not make all of {what} deferred again: parts were materialized "
                    "outside this widget without keep_cache=True, so their recipe is gone."
                )
                return
            took = time.monotonic() - t0
            self.status = (
                f"Materialized {what} to {device} in {took:.1f} s."
                if action == "materialize"
                else f"Freed {what} (deferred again) in {took:.1f} s."
            )
        finally:
            self.busy = ""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running action ends; True if none is running any more."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def materialize(self, device: str = "cpu", *, wait: bool = True) -> None:
        """Materialize the selected subtrees on ``device``, as the buttons do."""
        self.handle_action({"action": "materialize", "device": device, "names": self.selected})
        if wait:
            self.wait()

    def free(self, *, wait: bool = True) -> None:
        """Turn the selected subtrees back into deferred tensors, freeing their memory."""
        self.handle_action({"action": "free", "names": self.selected})
        if wait:
            self.wait()

    # ------------------------------------------------------------------ updates
    def refresh(self) -> None:
        """Recompute every node's totals and state; send the page only the rows that changed."""
        stats = self._tree.stats()
        changed = [
            [node, new.params, new.bytes, new.state]
            for node, (old, new) in enumerate(zip(self._stats, stats, strict=True))
            if (old.params, old.bytes, old.state) != (new.params, new.bytes, new.state)
        ]
        self._stats: list[NodeStats] = stats
        rows = self.tree["nodes"]
        for node, params, nbytes, state in changed:  # keep the synced tree current for reloads
            rows[node][3], rows[node][4], rows[node][5] = params, nbytes, state
        if changed:
            self.send({"kind": "patch", "nodes": changed})
        self.selection = self._selection_summary()
        if self.show_table:
            self._update_table()


def _describe(names: Sequence[str]) -> str:
    shown = ", ".join(n or "the whole model" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _explain(exc: Exception, action: str, device: str, what: str, nbytes: int) -> str:
    """An error, in plain words."""
    name = type(exc).__name__
    if _is_oom(exc):
        return (
            f"Out of memory: {device or 'the device'} has no room for the "
            f"{human_bytes(nbytes)} that {what} needs. Try a smaller selection, another "
            "device or a smaller dtype."
        )
    if name == "UnsupportedOperatorError":
        return f"An operation used to build {what} cannot be replayed: {exc}."
    if name == "DeferredDataError":
        return f"{what} needs real data that is not available: {exc}."
    verb = "Materializing" if action == "materialize" else "Freeing"
    return f"{verb} {what} failed ({name}): {exc}."


def explore(module: nn.Module, *, depth: int = 2) -> ModuleTreeWidget:
    """Show ``module`` as an interactive tree (what ``%%meta_init`` displays under the cell).

    ``depth`` is how many levels are open at first.  Works on deferred, real and partly
    materialized models alike; the returned widget's ``selected`` lists the ticked subtrees.
    """
    return ModuleTreeWidget(module, depth=depth)
