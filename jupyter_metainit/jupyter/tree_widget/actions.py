"""The widget's actions: Materialize, Free and Cancel, from a click or from Python.

An action runs on a worker thread (the kernel stays responsive and Cancel can stop it), one at
a time; a click that changes the model while a notebook cell runs waits for the cell to end.
Progress reaches the page at most ``1 / PROGRESS_INTERVAL_S`` times a second.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import traitlets
from torch import nn

from jupyter_metainit.core import (
    busy_with,
    dematerialize,
    format_duration,
    materialize,
    parse_dtype,
    tensor_values,
    unique_tensors,
)
from jupyter_metainit.jupyter.cell_watch import cells as _cells
from jupyter_metainit.jupyter.module_tree import ModelGoneError
from jupyter_metainit.jupyter.tree_widget.device_fit import fit_per_device
from jupyter_metainit.jupyter.tree_widget.wording import (
    failure_in_words,
    materialized_in_words,
    modules_in_words,
)

__all__ = ["ActionCancelled", "TreeActions"]

PROGRESS_INTERVAL_S = 0.05  # at most 20 progress messages a second
# The actions that run on the worker thread (and wait for a running cell to end, which may be
# changing the very weights); all but the first two are prepared by tree_widget/plan_actions.py.
_CHANGING_ACTIONS = (
    "materialize",
    "free",
    "plan",
    "pin",
    "unpin",
    "materialize_plan",
    "save",
    "values",
    "compare",
)
# How the busy line names an action that waits.
_ACTION_LABELS = {
    "materialize_plan": "materialize the plan",
    "unpin": "plan",
    "values": "measure the values",
    "compare": "compare",
}


class ActionCancelled(Exception):
    """Raised from the progress callback when the person clicks Cancel."""


class TreeActions:
    """Mixin of :class:`~jupyter_metainit.jupyter.widget.ModuleTreeWidget`: its actions."""

    _worker: threading.Thread | None
    _cancel: threading.Event
    _action_lock: threading.Lock
    _last_progress: float
    _queued: dict | None
    # the widget's traits and helpers these methods use
    busy: Any
    phase: Any
    progress: Any
    error: Any
    status: Any
    selection: Any
    selected: Any
    rng: Any
    dtype: Any
    _tree: Any
    _stats: Any
    module: Any
    send: Any
    refresh: Any
    _notify: Any
    _normalize: Any
    devices: Any
    _prepare_job: Any
    _run_job: Any

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
        if action not in _CHANGING_ACTIONS or not _cells.running:
            return False
        with self._action_lock:
            if self.busy:
                self._notify(f"Still busy with {self.busy}; wait for it or cancel it first.")
                return True
            device = content.get("device")
            label = _ACTION_LABELS.get(action, action)
            self.busy = f"{label} {device if isinstance(device, str) else ''}".strip()
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
        ``{"action": "refresh"}`` or ``{"action": "ping"}``; the plan and save actions
        (``plan``, ``pin``, ``unpin``, ``materialize_plan``, ``save``, ``values``) are described in
        ``plan_actions.py``, ``save_action.py`` and ``values.py``.  Anything invalid is refused
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
        if action not in _CHANGING_ACTIONS:
            self._notify(f"Unknown action {action!r}; nothing was done.")
            return
        if self.model_changed():  # actions off, saying how it changed
            return
        if action not in ("materialize", "free"):  # plan, pin, save...: tree_widget/plan_actions.py
            try:
                label, job = self._prepare_job(action, content)
            except ValueError as exc:
                self._notify(str(exc))
                return
            self._launch(label, self._run_job, (label, job))
            return
        try:
            names = self._check_names(content.get("names"))
            device = self._check_device(content.get("device")) if action == "materialize" else ""
            if action == "materialize":
                self._check_room(names, device)
        except ValueError as exc:
            self._notify(str(exc))
            return
        self._launch(f"{action} {device}".strip(), self._run, (action, names, device))

    def _launch(self, label: str, target: Any, args: tuple) -> None:
        """Run ``target(*args)`` on the worker thread as the one running action ``label``."""
        with self._action_lock:
            if self.busy:
                self._notify(f"Still busy with {self.busy}; wait for it or cancel it first.")
                return
            self.busy = label
        self.error = ""
        self.status = ""
        self.phase = "waiting for the model" if busy_with() else "starting"
        self._cancel.clear()
        self.progress = [0, 0]
        self._worker = threading.Thread(
            target=self._guarded, args=(target, args), name="jupyter_metainit-widget", daemon=True
        )
        self._worker.start()

    def _guarded(self, target: Any, args: tuple) -> None:
        """The worker thread: ``target(*args)``, and whatever it raises, the widget is left
        idle (never "busy" for good) and says why."""
        try:
            target(*args)
        except ModelGoneError:
            self.refresh()  # says how it changed
        except Exception as exc:  # a bug of ours: said, not swallowed
            self.error = f"The action failed unexpectedly ({type(exc).__name__}: {exc})."
        finally:
            self.phase = ""
            self.busy = ""

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

    def _check_room(self, names: list[str], device: str) -> None:
        """Refuse a selection that cannot fit the free memory of the device it would go to, as
        the page's button does and in its words, whichever side asked (a page, ``w.materialize``
        from code): measured now, not when the selection was made."""
        nodes = [self._tree.index[n] for n in names]
        if not device:  # each tensor's recorded device: checked when they all go to one
            targets = {self._stats[n].target or "cpu" for n in nodes}
            if len(targets) != 1 or "mixed" in targets:
                return
            device = targets.pop()
        summary = self._tree.selection_stats(nodes, parse_dtype(self.dtype or None))
        fit = fit_per_device(summary, self.devices).get(device)
        if fit is not None and not fit["fits"]:
            raise ValueError(fit["why"])

    def _progress(self, done: int, total: int, phase: str = "") -> None:
        if self._cancel.is_set():
            raise ActionCancelled
        now = time.monotonic()
        if phase != self.phase or done >= total or now - self._last_progress >= PROGRESS_INTERVAL_S:
            self._last_progress = now
            self.phase = phase
            self.progress = [int(done), int(total)]

    def _run(self, action: str, names: list[str], device: str) -> None:
        """The worker thread's job: carry out one action, then say what happened."""
        modules = [self.module.get_submodule(n) for n in names]
        what = modules_in_words(names, self.var_name)
        # modules sharing a tensor with the selection change with it: the message names them
        also = list(self.selection.get("also") or []) if names == list(self.selected) else []
        tied_too = (
            f" Tied to it, so changed too: {modules_in_words(also, self.var_name)}." if also else ""
        )
        # Measured now, not taken from the last refresh: a change made in code just before
        # (its refresh still pending) is not this action's doing.
        before = [s.row() for s in self._tree.stats()]
        t0 = time.monotonic()
        try:
            regenerated, kept_fast = self._carry_out(action, modules, device)
        except ActionCancelled:
            self.refresh()
            self.status = f"Cancelled: nothing was changed ({what} as before)."
        except Exception as exc:
            self.refresh()
            after = [s.row() for s in self._stats]
            nbytes = self.selection.get("bytes_as", 0)
            self.error = failure_in_words(exc, action, device, what, nbytes) + (
                " The model was left as it was."
                if after == before
                else " Part of the model changed state; see the badges."
            )
        else:
            self.refresh()
            total = self.progress[1]
            self.progress = [total, total]
            left = {self._stats[self._tree.index[n]].state for n in names} - {"deferred", ""}
            took = time.monotonic() - t0
            if action == "free" and left:
                self.error = (
                    f"Could not make all of {what} deferred again: parts were materialized "
                    "outside this widget without keep_cache=True, so their recipe is gone. Run "
                    "the cell that builds the model again to get a model you can free."
                )
            elif action == "free":
                self.status = (
                    f"Freed {what} (deferred again) in {format_duration(took)}." + tied_too
                )
            else:
                self.status = (
                    materialized_in_words(
                        what, device, self.dtype, self.rng, took, regenerated, kept_fast
                    )
                    + tied_too
                )
        finally:
            self.phase = ""
            self.busy = ""

    def _carry_out(self, action: str, modules: list[nn.Module], device: str) -> tuple[int, str]:
        """Materialize or free ``modules``; for an exact materialization, also how many tensors
        holding fast-RNG values were re-generated, and a sentence if some could not be."""
        if action != "materialize":
            dematerialize(modules, root=self.module)  # refusals name layers.3.weight
            return 0, ""
        regenerated, kept_fast = 0, ""
        if self.rng == "exact":
            regenerated, kept_fast = _forget_fast_values(modules)
        materialize(
            modules,
            device or None,
            dtype=parse_dtype(self.dtype or None),
            rng=self.rng,
            keep_cache=True,  # so that Free can make them deferred again
            progress=self._progress,
        )
        return regenerated, kept_fast

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running action (a click, or a call with ``wait=False``) ends.

        Use it in code that started an action without waiting, or that must not read the
        model while a click's materialization runs.

        Args:
            timeout: the most seconds to wait; ``None`` waits as long as it takes.

        Returns:
            ``True`` if no action is running any more, ``False`` if ``timeout`` passed first.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> w.selected = ["0"]
            >>> w.materialize("cpu", wait=False)  # runs on the widget's worker thread
            >>> w.wait(), is_deferred(model[0])
            (True, False)
        """
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def materialize(self, device: str | None = None, *, wait: bool = True) -> None:
        """Materialize the selected subtrees on ``device``, as the *Materialize* buttons do.

        Use it to drive the widget from code, e.g. after setting ``w.selected``: the widget's
        ``rng`` and ``dtype`` apply, the recording is kept so that :meth:`free` can make the
        parts deferred again, and the tree, progress and status show it as for a click.

        Args:
            device: where the tensors go (``"cpu"``, ``"cuda:0"``); ``None``: each tensor goes
                to the device it was recorded for (an error if this machine lacks it).
            wait: block until it is done (otherwise it runs on the widget's worker thread;
                :meth:`wait` waits for it).

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> w.selected = ["0"]
            >>> w.materialize("cpu")
            >>> w.status, w.error  # a failure is said in w.error, nothing raised
            ('Materialized model[0] on cpu in ... ms.', '')
        """
        self.handle_action({"action": "materialize", "device": device, "names": self.selected})
        if wait:
            self.wait()

    def free(self, *, wait: bool = True) -> None:
        """Turn the selected subtrees back into deferred tensors, freeing their memory, as the
        *Free* button does.

        Materializing them again gives the same values; what cannot be freed that way (a part
        trained or loaded into since) is refused and said in ``w.error``.

        Args:
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> w.selected = ["0"]
            >>> w.materialize("cpu")
            >>> w.free()
            >>> is_deferred(model[0])
            True
        """
        self.handle_action({"action": "free", "names": self.selected})
        if wait:
            self.wait()


def _forget_fast_values(modules: list[nn.Module]) -> tuple[int, str]:
    """Before an exact materialization: make the parts holding fast-RNG values deferred again,
    so that they are re-generated with eager's values rather than kept. Returns how many tensors
    that concerns, and a sentence for the status when they could not be (then they keep their
    fast values)."""
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in unique_tensors(module):
            if tensor_values(t) == "fast":
                seen.setdefault(id(t), t)
    fast = list(seen.values())
    if not fast:
        return 0, ""
    try:
        dematerialize(fast)
    except Exception as exc:
        return 0, (
            f" {len(fast)} tensor(s) keep their fast-RNG values (not eager's): they cannot be "
            f"re-generated ({exc})"
        )
    return len(fast), ""
