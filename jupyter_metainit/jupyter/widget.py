"""The clickable model tree that ``%%meta_init`` shows under the cell.

Use :func:`explore` on any ``nn.Module`` (deferred, real or a mix) to see its hierarchy with
parameter counts, sizes, dtypes and where each part lives, to select subtrees with checkboxes,
and to materialize or free them with a button.

The kernel owns the truth: the page can only request actions and set the selection and the
options (``_PAGE_WRITABLE``); every other trait describes the kernel and is refused when the page
writes it. Every widget showing a model follows it whoever changes it (code, magics, another
widget, ``materialize_sharded``): the core publishes what it changed (``core._events``), and the
widget refreshes once per burst of changes, with no polling while idle.
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

import anywidget
import torch
import traitlets
from torch import nn

from jupyter_metainit import core
from jupyter_metainit.core.runtime import events as _events
from jupyter_metainit.core.runtime.format import format_bytes, format_count, format_duration
from jupyter_metainit.core.runtime.lock import busy_with as core_busy_with
from jupyter_metainit.core.runtime.walk import unique_tensors
from jupyter_metainit.estimates import memory_table
from jupyter_metainit.estimates.fit import device_budget
from jupyter_metainit.jupyter._cells import cells as _cells
from jupyter_metainit.jupyter._cells import watch_cells
from jupyter_metainit.jupyter._tree import ModelGoneError, ModuleTree, NodeStats
from jupyter_metainit.jupyter.row_schema import ROW, STATS_FIELDS

__all__ = ["ModuleTreeWidget", "explore", "widgets_of"]

_STATIC = pathlib.Path(__file__).parent / "static"
_DTYPES: dict[str, torch.dtype | None] = {
    "": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_PROGRESS_INTERVAL_S = 0.05  # at most 20 progress messages a second
_SYNC_DELAY_S = 0.1  # changes published within this window make one refresh
# What the page may write; everything else describes the kernel.
_PAGE_WRITABLE = frozenset({"selected", "rng", "dtype", "show_table", "table_full"})
_live_widgets: weakref.WeakSet[ModuleTreeWidget] = weakref.WeakSet()
_MODEL_GONE = (
    "The model this widget showed is gone: no name in the kernel refers to it any more, so it "
    "was freed. Nothing was done. Show the model you have now with "
    "jupyter_metainit.explore(model)."
)


_SAVED_ADVICE = (
    "This is a saved copy: the live tree needs the kernel that made it. Run the cell again "
    "(or jupyter_metainit.explore(model) on a model you have) to get a live tree."
)


def _static_text(name: str) -> str:
    # The built front end as text, not as a path: anywidget turns a path into a FileContents
    # whose class-level `changed` signal holds every widget ever made (file watching or not),
    # so no widget could be freed.
    return (_STATIC / name).read_text(encoding="utf-8")


def widgets_of(module: nn.Module) -> list[ModuleTreeWidget]:
    """The open widgets showing ``module`` (as their model or a part of it).

    ``%%meta_init`` displays a widget without binding it to a name; this finds it again::

        (w,) = jupyter_metainit.widgets_of(model)
        w.selected = ["model.layers.0"]
    """
    return [w for w in list(_live_widgets) if w.comm is not None and w._tree.holds(module)]


class ActionCancelled(Exception):
    """Raised from the progress callback when the person clicks Cancel."""


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
            {"name": f"cuda:{i}", "label": f"{props.name}, {format_bytes(props.total_memory)}"}
        )
    return devices, ""


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
    do, for the current selection.  The widget follows the model by itself: whatever
    materializes or frees a part of it (code, a magic, another widget) shows here within a
    fraction of a second.
    """

    _esm = _static_text("widget.js")
    _css = _static_text("widget.css")

    # kernel-owned: the page's writes are refused (see set_state)
    tree = traitlets.Dict(help="The whole tree, sent once; later changes come as patches.").tag(
        sync=True
    )
    selection = traitlets.Dict(help="Totals of the selection, computed here.").tag(sync=True)
    expand_depth = traitlets.Int(2, help="Depth the tree opens to at first.").tag(sync=True)
    busy = traitlets.Unicode("", help="The running action, '' when idle.").tag(sync=True)
    progress = traitlets.List(
        [0, 0], help="[bytes held so far, bytes the selection holds when done]."
    ).tag(sync=True)
    phase = traitlets.Unicode("", help="What the running action does now, in words.").tag(sync=True)
    error = traitlets.Unicode("", help="Why the last action failed, in plain words.").tag(sync=True)
    status = traitlets.Unicode("", help="What the last action did.").tag(sync=True)
    notice = traitlets.Dict(
        {"id": 0, "text": ""}, help="A refused request: shown briefly, beside the status."
    ).tag(sync=True)
    devices = traitlets.List(help="Visible CUDA devices.").tag(sync=True)
    no_cuda_reason = traitlets.Unicode("").tag(sync=True)
    table_html = traitlets.Unicode("").tag(sync=True)
    var_name = traitlets.Unicode(
        "model", help="The model's name in the notebook, for paths usable in the magics."
    ).tag(sync=True)
    # page-writable: the selection and the options of the next action
    selected = traitlets.List(traitlets.Unicode(), help="Selected subtrees (qualified names).").tag(
        sync=True
    )
    rng = traitlets.Enum(["exact", "fast"], "exact").tag(sync=True)
    dtype = traitlets.Enum(list(_DTYPES), "", help="'' keeps each tensor's dtype.").tag(sync=True)
    show_table = traitlets.Bool(False, help="Show the memory table of the selection.").tag(
        sync=True
    )
    table_full = traitlets.Bool(False, help="All columns of the memory table.").tag(sync=True)

    def __init__(
        self, module: nn.Module, *, depth: int = 2, name: str = "model", **kwargs: Any
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"explore() needs an nn.Module, got {type(module).__name__}")
        # Held weakly (see ModuleTree): the widget outlives its output in ipywidgets' registry.
        self._module_ref = weakref.ref(module)
        self._model_type = type(module).__name__
        self._tree = ModuleTree.build(module)
        self._stats = self._tree.stats()
        self._ids = self._tensor_ids()
        devices, reason = _cuda_devices()
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        self._action_lock = threading.Lock()  # check-and-set of `busy`, from any thread
        self._refresh_lock = threading.Lock()
        self._sync_timer: threading.Timer | None = None
        self._last_progress = 0.0
        self._queued: dict | None = None  # a page action waiting for the running cell to end
        super().__init__(
            tree=self._tree.to_json(self._stats),
            expand_depth=depth,
            var_name=name,
            devices=devices,
            no_cuda_reason=reason,
            **kwargs,
        )
        self.selection = self._selection_summary()
        self.on_msg(self._on_msg)
        watch_cells()
        _events.subscribe(self._on_core_change)
        _live_widgets.add(self)

    @property
    def module(self) -> nn.Module:
        """The model shown; :class:`ModelGoneError` once nothing else refers to it."""
        module = self._module_ref()
        if module is None:
            raise ModelGoneError(_MODEL_GONE)
        return module

    def __repr__(self) -> str:
        # What plain-text front ends (terminals, nbconvert to text) show instead of the tree.
        root = self._stats[0]
        gone = "" if self._tree.alive else ", model gone"
        return (
            f"ModuleTreeWidget({self._model_type}: {format_count(root.params)} params, "
            f"{format_bytes(root.bytes)}, {root.state}{gone})"
        )

    def _summary_line(self) -> str:
        root = self._stats[0]
        return (
            f"{self._model_type}: {format_count(root.params)} params, "
            f"{format_bytes(root.bytes)}, {root.state or 'no tensors'}"
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """The live widget, plus what a saved notebook shows once the kernel is gone (GitHub,
        nbconvert, an untrusted or reopened notebook): the model's summary line in words and
        how to get a live tree again, instead of a bare "model not found"."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        line = self._summary_line()
        data["text/plain"] = f"Model tree of {line}.\n{_SAVED_ADVICE}"
        data["text/html"] = (
            f"<div class='jmi-saved'><b>Model tree</b> of {escape(line)}.<br>"
            f"<small>{escape(_SAVED_ADVICE)}</small></div>"
        )
        return data, metadata

    # ------------------------------------------------------------------ what the page may write
    def set_state(self, sync_data: dict) -> None:
        """Apply the page's writes of page-writable traits; refuse the rest, visibly.

        A refused or invalid write is undone on the page (the kernel's value is sent back)
        and said in a notice; nothing in the kernel changes.
        """
        if not isinstance(sync_data, dict):
            self._notify(
                f"Ignored a malformed update from the page (a {type(sync_data).__name__}, "
                "not a set of traits); nothing changed."
            )
            return
        allowed = {k: v for k, v in sync_data.items() if k in _PAGE_WRITABLE}
        refused = sorted(str(k) for k in set(sync_data) - set(allowed))
        unknown = [k for k in refused if not self.has_trait(k)]
        owned = [k for k in refused if self.has_trait(k)]
        if unknown:
            self._notify(f"Ignored an update of {', '.join(unknown)} from the page: no such trait.")
        if owned:
            self._notify(
                f"Ignored a change of {', '.join(owned)} from the page: the kernel owns it."
            )
            self.send_state(owned)
        for key, value in allowed.items():
            try:
                super().set_state({key: value})
            except (traitlets.TraitError, TypeError, ValueError) as exc:
                self._notify(f"Refused from the page: {exc}")
                self.send_state([key])

    def _handle_msg(self, msg: dict) -> None:
        # A page message of an unexpected shape is a notice, never a traceback in the kernel.
        data = msg.get("content", {}).get("data") if isinstance(msg, dict) else None
        if not isinstance(data, dict) or not isinstance(data.get("method"), str):
            self._notify("Ignored a malformed message from the page.")
            return
        if (
            data["method"] == "update"
            and "buffer_paths" in data
            and not isinstance(data.get("state"), dict)
        ):
            self._notify("Ignored a malformed update from the page.")
            return
        try:
            super()._handle_msg(msg)
        except Exception as exc:  # whatever the page sent, the kernel stays quiet and unchanged
            self._notify(f"Ignored a message from the page that could not be read ({exc}).")

    def _notify(self, text: str) -> None:
        self.notice = {"id": int(self.notice.get("id", 0)) + 1, "text": text}

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
        if not self._tree.alive:
            return {}
        nodes = [self._tree.index[n] for n in self.selected]
        summary = self._tree.selection_stats(nodes, _DTYPES[self.dtype])
        summary["fit"] = self._fit(summary) if nodes else {}
        return summary

    def _fit(self, summary: dict) -> dict[str, dict]:
        """Per device: the memory materializing the selection there takes (in the chosen dtype,
        minus what is on that device already), the device's free memory (as ``fits`` measures
        it) and whether the one fits in the other."""
        out = {}
        for device in ["cpu", *(d["name"] for d in self.devices)]:
            try:
                free = device_budget(device)
            except ValueError:  # cannot measure: say nothing rather than guess
                continue
            need = sum(b for state, b in summary["states_as"].items() if state != device)
            out[device] = {"need": need, "free": free, "fits": need <= free}
        return out

    # ------------------------------------------------------------------ table
    @traitlets.observe("show_table", "table_full")
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
        """The memory table of the selection (of the model, to the tree's depth, if none)."""
        names = self.selected or [""]
        depth = 1 if self.selected else max(1, self.expand_depth)
        parts = []
        for name in names:
            table = memory_table(
                self.module.get_submodule(name), depth=depth, dtype=_DTYPES[self.dtype]
            )
            # always say which module the table shows (the selection, or the whole model)
            title = _code_path(self.var_name, name) if name else f"{self.var_name} (whole model)"
            parts.append(f"<h4 class='jmi-table-title'>Memory table of {escape(title)}</h4>")
            parts.append(table.to_html_view(compact=not self.table_full))
        return "\n".join(parts)

    # ------------------------------------------------------------------ actions
    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("id") is not None:
            self.send({"kind": "ack", "id": content.get("id")})  # the page knows we are alive
        if isinstance(content, dict) and self._queue_while_a_cell_runs(content):
            return
        self.handle_action(content)

    def _queue_while_a_cell_runs(self, content: dict) -> bool:
        """A click that changes the model while a cell runs waits for the cell to end (the cell
        may be using the very weights): True if the message was taken care of here."""
        action = content.get("action")
        if action == "cancel" and self._queued is not None:
            with self._action_lock:
                self._queued = None
                self.busy = ""
            _cells.waiting.discard(self)
            self.phase = ""
            self.status = "Cancelled before it ran: nothing was changed."
            return True
        if action not in ("materialize", "free") or not _cells.running:
            return False
        with self._action_lock:
            if self.busy:
                self._notify(f"Still busy with {self.busy}; wait for it or cancel it first.")
                return True
            device = content.get("device")
            self.busy = f"{action} {device if isinstance(device, str) else ''}".strip()
            self._queued = content
        self.error = ""
        self.status = ""
        self.progress = [0, 0]
        self.phase = "waits for the running cell to end (Cancel drops it)"
        _cells.waiting.add(self)
        return True

    def _run_queued(self) -> None:
        """The cell ended: carry out the action that waited for it."""
        with self._action_lock:
            content, self._queued = self._queued, None
            if content is None:
                return
            self.busy = ""
        self.phase = ""
        self.handle_action(content)

    def handle_action(self, content: Any) -> None:
        """Carry out one action message from the front end (also usable from Python).

        ``{"action": "materialize", "device": "cpu" | "cuda:N" | None, "names": [...]}``,
        ``{"action": "free", "names": [...]}``, ``{"action": "cancel"}``,
        ``{"action": "refresh"}`` or ``{"action": "ping"}``.  Anything invalid is refused
        with a brief notice and changes nothing; it never replaces the message of the
        running or last action.
        """
        if not isinstance(content, dict):
            self._notify("Ignored a malformed message from the page.")
            return
        action = content.get("action")
        if action == "ping":
            return
        if action == "cancel":
            self._cancel.set()
            return
        if action == "refresh":
            self.refresh()
            return
        if action not in ("materialize", "free"):
            self._notify(f"Unknown action {action!r}; nothing was done.")
            return
        if not self._tree.alive:
            self.error = _MODEL_GONE
            return
        try:
            names = self._check_names(content.get("names"))
            device = self._check_device(content.get("device")) if action == "materialize" else ""
        except ValueError as exc:
            self._notify(str(exc))
            return
        with self._action_lock:
            if self.busy:
                self._notify(f"Still busy with {self.busy}; wait for it or cancel it first.")
                return
            self.busy = f"{action} {device}".strip()
        self.error = ""
        self.status = ""
        self.phase = "waiting for the model" if core_busy_with() else "starting"
        self._cancel.clear()
        self.progress = [0, 0]
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
            if found is not self._tree.module(self._tree.index[name]):
                raise ValueError(
                    f"The model changed since the tree was drawn ({name!r} is no longer the "
                    "same module); run explore() again."
                )
        return names

    def _check_device(self, device: Any) -> str:
        if device is None:
            return ""  # each tensor's recorded device, as materialize() without device=
        if device == "cpu":
            return device
        if isinstance(device, str) and device in {d["name"] for d in self.devices}:
            return device
        raise ValueError(f"Refused: {device!r} is not a device this kernel can use.")

    def _progress(self, done: int, total: int, phase: str = "") -> None:
        if self._cancel.is_set():
            raise ActionCancelled
        now = time.monotonic()
        if (
            phase != self.phase
            or done >= total
            or now - self._last_progress >= _PROGRESS_INTERVAL_S
        ):
            self._last_progress = now
            self.phase = phase
            self.progress = [int(done), int(total)]

    def _run(self, action: str, names: list[str], device: str) -> None:
        modules = [self.module.get_submodule(n) for n in names]
        what = _describe(names)
        # modules sharing a tensor with the selection change with it: the message names them
        also = list(self.selection.get("also") or []) if names == list(self.selected) else []
        tied_too = f" Tied to it, so changed too: {_describe(also)}." if also else ""
        # Measured now, not taken from the last refresh: a change made in code just before
        # (its refresh still pending) is not this action's doing.
        before = [s.row() for s in self._tree.stats()]
        t0 = time.monotonic()
        regenerated, kept_fast = 0, ""
        try:
            if action == "materialize" and self.rng == "exact":
                regenerated, kept_fast = _forget_fast_values(modules)
            if action == "materialize":
                core.materialize(
                    modules,
                    device or None,
                    dtype=_DTYPES[self.dtype],
                    rng=self.rng,
                    keep_cache=True,  # so that Free can make them deferred again
                    progress=self._progress,
                )
            else:
                core.dematerialize(modules, root=self.module)  # refusals name layers.3.weight
        except ActionCancelled:
            self.refresh()
            self.status = f"Cancelled: nothing was changed ({what} as before)."
        except Exception as exc:
            self.refresh()
            after = [s.row() for s in self._stats]
            self.error = _explain(exc, action, device, what, self.selection.get("bytes_as", 0)) + (
                " The model was left as it was."
                if after == before
                else " Part of the model changed state; see the badges."
            )
        else:
            self.refresh()
            total = self.progress[1]
            self.progress = [total, total]
            left = {self._stats[self._tree.index[n]].state for n in names} - {"deferred", ""}
            if action == "free" and left:
                self.error = (
                    f"Could not make all of {what} deferred again: parts were materialized "
                    "outside this widget without keep_cache=True, so their recipe is gone."
                )
                return
            took = time.monotonic() - t0
            self.status = (
                f"Materialized {what} on {device or 'its recorded device'}"
                + (f" as {self.dtype}" if self.dtype else "")
                + f" in {format_duration(took)}"
                # said, not only tagged: these values are deterministic but not eager's
                + (
                    " with RNG fast (its values are not those eager code gives)."
                    if self.rng == "fast"
                    else "."
                )
                + (
                    f" Re-generated {regenerated} tensor(s) that held fast-RNG values with "
                    "exact (eager) values."
                    if regenerated
                    else ""
                )
                + kept_fast
                + tied_too
                if action == "materialize"
                else f"Freed {what} (deferred again) in {format_duration(took)}." + tied_too
            )
        finally:
            self.phase = ""
            self.busy = ""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running action ends; True if none is running any more."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def materialize(self, device: str | None = None, *, wait: bool = True) -> None:
        """Materialize the selected subtrees on ``device``, as the buttons do; by default each
        tensor goes to the device it was recorded for (an error if this machine lacks it)."""
        self.handle_action({"action": "materialize", "device": device, "names": self.selected})
        if wait:
            self.wait()

    def free(self, *, wait: bool = True) -> None:
        """Turn the selected subtrees back into deferred tensors, freeing their memory."""
        self.handle_action({"action": "free", "names": self.selected})
        if wait:
            self.wait()

    # ------------------------------------------------------------------ following the model
    def _tensor_ids(self) -> set[int]:
        ids = set()
        for t in unique_tensors(self.module, attributes=True):
            ids.add(id(t))
            local = getattr(t, "_local_tensor", None)  # a DTensor's shard
            if local is not None:
                ids.add(id(local))
        return ids

    def _on_core_change(self, _kind: str, tensors: list[torch.Tensor]) -> None:
        """The core changed tensors (any thread): refresh once per burst if any is ours."""
        if self.comm is None or not any(id(t) in self._ids for t in tensors):
            return
        with self._refresh_lock:
            if self._sync_timer is not None:
                return
            self._sync_timer = threading.Timer(_SYNC_DELAY_S, self._synced_refresh)
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

    def refresh(self) -> bool:
        """Recompute every node's totals and state; send the page only the rows that changed.
        True if any row changed."""
        if not self._tree.alive:
            self.error = _MODEL_GONE
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


def _forget_fast_values(modules: list[nn.Module]) -> tuple[int, str]:
    """Before an exact materialization: make the parts holding fast-RNG values deferred again,
    so that they are re-generated with eager's values rather than kept. Returns how many tensors
    that concerns, and a sentence for the status when they could not be (then they keep their
    fast values)."""
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in unique_tensors(module):
            if core.tensor_values(t) == "fast":
                seen.setdefault(id(t), t)
    fast = list(seen.values())
    if not fast:
        return 0, ""
    try:
        core.dematerialize(fast)
    except Exception as exc:
        return 0, (
            f" {len(fast)} tensor(s) keep their fast-RNG values (not eager's): they cannot be "
            f"re-generated ({exc})"
        )
    return len(fast), ""


def _code_path(var_name: str, qname: str) -> str:
    """``model.layers.5`` of ``model`` as Python the magics take: ``model.model.layers[5]``."""
    path = var_name
    for part in qname.split(".") if qname else []:
        if part.isdigit():
            path += f"[{part}]"
        elif part.isidentifier():
            path += f".{part}"
        else:
            return f"{var_name}.get_submodule({qname!r})"
    return path


def _describe(names: Sequence[str]) -> str:
    shown = ", ".join(n or "the whole model" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _explain(exc: Exception, action: str, device: str, what: str, nbytes: int) -> str:
    """An error, in plain words."""
    name = type(exc).__name__
    if _is_oom(exc):
        return (
            f"Out of memory: {device or 'the device'} has no room for the "
            f"{format_bytes(nbytes)} that {what} needs. Try a smaller selection, another "
            "device or a smaller dtype."
        )
    if name == "UnsupportedOperatorError":
        return f"An operation used to build {what} cannot be replayed: {exc}."
    if name == "DeferredDataError":
        return f"{what} needs real data that is not available: {exc}."
    verb = "Materializing" if action == "materialize" else "Freeing"
    return f"{verb} {what} failed ({name}): {exc}."


def explore(module: nn.Module, *, depth: int = 2, name: str = "model") -> ModuleTreeWidget:
    """Show ``module`` as an interactive tree (what ``%%meta_init`` displays under the cell).

    ``depth`` is how many levels are open at first; ``name`` is the model's name in the notebook,
    used to offer each row's path as code (``model.model.layers[5]``). Works on deferred, real
    and partly materialized models alike; the returned widget's ``selected`` lists the ticked
    subtrees.
    """
    return ModuleTreeWidget(module, depth=depth, name=name)
