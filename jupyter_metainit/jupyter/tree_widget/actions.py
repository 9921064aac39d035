"""The widget's actions: Materialize, Free and Cancel, from a click or from Python, and the
worker thread every action runs on (:class:`ActionRunner`).

An action runs on a worker thread (the kernel stays responsive and Cancel can stop it), one at
a time; a click that changes the model while a notebook cell runs waits for the cell to end.
Progress reaches the page at most ``1 / PROGRESS_INTERVAL_S`` times a second. The other actions
(plan, pin, save, values, compare) are checked and made into a job by ``plan_actions``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
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
from jupyter_metainit.jupyter.tree_widget.following import ModelFollower
from jupyter_metainit.jupyter.tree_widget.host import WidgetHost
from jupyter_metainit.jupyter.tree_widget.stale_results import drop_stale_results
from jupyter_metainit.jupyter.tree_widget.wording import (
    failure_in_words,
    materialized_in_words,
    modules_in_words,
)

__all__ = ["ActionCancelled", "ActionRunner", "Job", "Prepare"]

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


#: A prepared job: run on the worker thread, it returns what it did in words (``{took}`` is
#: filled in), or that and whether it is a problem (a plan that does not fit).
Job = Callable[[], str | tuple[str, bool]]
#: Checks an action message other than materialize and free: its busy label and its job
#: (``plan_actions.prepare_job``); ValueError, said as a notice, when it cannot be carried out.
Prepare = Callable[[str, dict], tuple[str, Job]]


class ActionCancelled(Exception):
    """Raised from the progress callback when the person clicks Cancel."""


class ActionRunner:
    """A widget's one running action: the worker thread, Cancel, the click that waits for a
    running cell, the progress callback, and Materialize and Free themselves.

    Args:
        host: the widget whose ``busy``, ``phase``, ``progress``, ``status`` and ``error`` say
            what runs and how it ended.
        follower: the widget's view of its model (refreshed after each action; it says whether
            the model changed under the tree).
        prepare: checks the other actions' messages and makes their jobs (``plan_actions``).
    """

    def __init__(self, host: WidgetHost, follower: ModelFollower, prepare: Prepare) -> None:
        self._host = host
        self._follower = follower
        self._prepare = prepare
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # check-and-set of `busy`, from any thread
        self._last_progress = 0.0
        self._queued: dict | None = None  # a page action waiting for the running cell to end

    def on_message(self, content: Any) -> None:
        """A message from the page: acknowledged, then carried out (or queued behind a cell)."""
        if isinstance(content, dict) and content.get("id") is not None:
            self._host.send({"kind": "ack", "id": content.get("id")})  # the page knows we live
        if isinstance(content, dict) and self._queue_while_a_cell_runs(content):
            return
        self.handle(content)

    def _queue_while_a_cell_runs(self, content: dict) -> bool:
        """A click that changes the model while a cell runs waits for the cell to end (the cell
        may be using the very weights): True if the message was taken care of here."""
        host = self._host
        action = content.get("action")
        if action == "cancel" and self._queued is not None:
            with self._lock:
                self._queued = None
                host.busy = ""
            _cells.waiting.discard(self)
            host.phase = ""
            host.status = "Cancelled before it ran: nothing was changed."
            return True
        if action not in _CHANGING_ACTIONS or not _cells.running:
            return False
        with self._lock:
            if host.busy:
                host._notify(f"Still busy with {host.busy}; wait for it or cancel it first.")
                return True
            device = content.get("device")
            label = _ACTION_LABELS.get(action, action)
            host.busy = f"{label} {device if isinstance(device, str) else ''}".strip()
            self._queued = content
        host.error = ""
        host.status = ""
        host.progress = [0, 0]
        host.phase = "waits for the running cell to end (Cancel drops it)"
        _cells.waiting.add(self)
        return True

    def run_queued(self) -> None:
        """The cell ended (``cell_watch``): carry out the action that waited for it."""
        with self._lock:
            content, self._queued = self._queued, None
            if content is None:
                return
            self._host.busy = ""
        self._host.phase = ""
        self.handle(content)

    def handle(self, content: Any) -> None:
        """Carry out one action message (``ModuleTreeWidget.handle_action`` says which)."""
        host = self._host
        if not isinstance(content, dict):
            host._notify("Ignored a malformed message from the page.")
            return
        action = content.get("action")
        if action == "ping":
            return
        if action == "cancel":
            self._cancel.set()
            return
        if action == "refresh":
            self._follower.refresh()
            return
        if action not in _CHANGING_ACTIONS:
            host._notify(f"Unknown action {action!r}; nothing was done.")
            return
        if self._follower.model_changed():  # actions off, saying how it changed
            return
        if action not in ("materialize", "free"):  # plan, pin, save...: tree_widget/plan_actions.py
            try:
                label, job = self._prepare(action, content)
            except ValueError as exc:
                host._notify(str(exc))
                return
            self.launch(label, self._run_job, (label, job))
            return
        try:
            names = host._check_names(content.get("names"))
            device = self._check_device(content.get("device")) if action == "materialize" else ""
            if action == "materialize":
                self._check_room(names, device)
        except ValueError as exc:
            host._notify(str(exc))
            return
        self.launch(f"{action} {device}".strip(), self._run, (action, names, device))

    def launch(self, label: str, target: Callable[..., object], args: tuple) -> None:
        """Run ``target(*args)`` on the worker thread as the one running action ``label``."""
        host = self._host
        with self._lock:
            if host.busy:
                host._notify(f"Still busy with {host.busy}; wait for it or cancel it first.")
                return
            host.busy = label
        host.error = ""
        host.status = ""
        host.phase = "waiting for the model" if busy_with() else "starting"
        self._cancel.clear()
        host.progress = [0, 0]
        self._worker = threading.Thread(
            target=self._guarded, args=(target, args), name="jupyter_metainit-widget", daemon=True
        )
        self._worker.start()

    def _guarded(self, target: Callable[..., object], args: tuple) -> None:
        """The worker thread: ``target(*args)``, and whatever it raises, the widget is left
        idle (never "busy" for good) and says why."""
        try:
            target(*args)
        except ModelGoneError:
            self._follower.refresh()  # says how it changed
        except Exception as exc:  # a bug of ours: said, not swallowed
            self._host.error = f"The action failed unexpectedly ({type(exc).__name__}: {exc})."
        finally:
            self._host.phase = ""
            self._host.busy = ""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running action ends; False if ``timeout`` passed first."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def progress(self, done: int, total: int, phase: str = "") -> None:
        """The progress callback: raises :class:`ActionCancelled` once Cancel was clicked, and
        sends the page the progress at most every ``PROGRESS_INTERVAL_S``."""
        if self._cancel.is_set():
            raise ActionCancelled
        host = self._host
        now = time.monotonic()
        if phase != host.phase or done >= total or now - self._last_progress >= PROGRESS_INTERVAL_S:
            self._last_progress = now
            host.phase = phase
            host.progress = [int(done), int(total)]

    def _check_device(self, device: Any) -> str:
        if device is None:
            return ""  # each tensor's recorded device, as materialize() without device=
        if device == "cpu":
            return device
        if isinstance(device, str) and device in {d["name"] for d in self._host.devices}:
            return device
        raise ValueError(f"Refused: {device!r} is not a device this kernel can use.")

    def _check_room(self, names: list[str], device: str) -> None:
        """Refuse a selection that cannot fit the free memory of the device it would go to, as
        the page's button does and in its words, whichever side asked (a page, ``w.materialize``
        from code): measured now, not when the selection was made."""
        host = self._host
        tree = host._tree
        nodes = [tree.index[n] for n in names]
        if not device:  # each tensor's recorded device: checked when they all go to one
            targets = {self._follower.stats[n].target or "cpu" for n in nodes}
            if len(targets) != 1 or "mixed" in targets:
                return
            device = targets.pop()
        summary = tree.selection_stats(nodes, parse_dtype(host.dtype or None))
        fit = fit_per_device(summary, host.devices).get(device)
        if fit is not None and not fit["fits"]:
            raise ValueError(fit["why"])

    def _run(self, action: str, names: list[str], device: str) -> None:
        """The worker thread's job: carry out one action, then say what happened."""
        host, follower = self._host, self._follower
        modules = [host.module.get_submodule(n) for n in names]
        what = modules_in_words(names, host.var_name)
        # modules sharing a tensor with the selection change with it: the message names them
        also = list(host.selection.get("also") or []) if names == list(host.selected) else []
        tied_too = (
            f" Tied to it, so changed too: {modules_in_words(also, host.var_name)}." if also else ""
        )
        # Measured now, not taken from the last refresh: a change made in code just before
        # (its refresh still pending) is not this action's doing.
        before = [s.row() for s in host._tree.stats()]
        t0 = time.monotonic()
        try:
            regenerated, kept_fast = self._carry_out(action, modules, device)
        except ActionCancelled:
            follower.refresh()
            host.status = f"Cancelled: nothing was changed ({what} as before)."
        except Exception as exc:
            follower.refresh()
            after = [s.row() for s in follower.stats]
            nbytes = host.selection.get("bytes_as", 0)
            host.error = failure_in_words(exc, action, device, what, nbytes) + (
                " The model was left as it was."
                if after == before
                else " Part of the model changed state; see the badges."
            )
        else:
            follower.refresh()
            total = host.progress[1]
            host.progress = [total, total]
            left = {follower.stats[host._tree.index[n]].state for n in names} - {"deferred", ""}
            took = time.monotonic() - t0
            if action == "free" and left:
                host.error = (
                    f"Could not make all of {what} deferred again: parts were materialized "
                    "outside this widget without keep_cache=True, so their recipe is gone. Run "
                    "the cell that builds the model again to get a model you can free."
                )
            elif action == "free":
                host.status = (
                    f"Freed {what} (deferred again) in {format_duration(took)}." + tied_too
                )
            else:
                host.status = (
                    materialized_in_words(
                        what, device, host.dtype, host.rng, took, regenerated, kept_fast
                    )
                    + tied_too
                )
        finally:
            self._say_stale_results()
            host.phase = ""
            host.busy = ""

    def _say_stale_results(self) -> None:
        """As an action ends: drop the Values / Compare results it made stale, the note after
        the action's own message (the refresh that follows the core's change would otherwise
        drop them later, its note replacing the message)."""
        host = self._host
        with contextlib.suppress(Exception):  # a model gone is said by the refresh
            notice = drop_stale_results(host)
            if notice:
                host.status = f"{host.status} {notice}" if host.status else notice

    def _carry_out(self, action: str, modules: list[nn.Module], device: str) -> tuple[int, str]:
        """Materialize or free ``modules``; for an exact materialization, also how many tensors
        holding fast-RNG values were re-generated, and a sentence if some could not be."""
        host = self._host
        if action != "materialize":
            dematerialize(modules, root=host.module)  # refusals name layers.3.weight
            return 0, ""
        regenerated, kept_fast = 0, ""
        if host.rng == "exact":
            regenerated, kept_fast = _forget_fast_values(modules)
        materialize(
            modules,
            device or None,
            dtype=parse_dtype(host.dtype or None),
            rng=host.rng,
            keep_cache=True,  # so that Free can make them deferred again
            progress=host._progress,  # the widget's hook, which every job reports to
        )
        return regenerated, kept_fast

    def _run_job(self, label: str, job: Job) -> None:
        """The worker thread's job for plan, pin, save, values, compare and materialize plan:
        run it, then say what it did (its sentence, ``{took}`` filled in) or why it failed."""
        host, follower = self._host, self._follower
        before = [s.row() for s in host._tree.stats()]

        def changed() -> bool:  # after a failure: did part of the model change state anyway?
            follower.refresh()
            return [s.row() for s in follower.stats] != before

        t0 = time.monotonic()
        try:
            said = job()
        except ActionCancelled as exc:
            host.status = f"Cancelled: {label} stopped; " + (
                "part of the model changed state, see the badges."
                if changed()
                else str(exc) or "nothing was changed."
            )
        except Exception as exc:
            host.error = f"Could not {label}: {_sentence(str(exc))}" + (
                " Part of the model changed state; see the badges."
                if changed()
                else ""
                if label == "plan"
                else " The model was left as it was."
            )
        else:
            follower.refresh()
            # a plan that does not fit is said as a problem (red), not as a success
            text, problem = said if isinstance(said, tuple) else (said, False)
            text = text.replace("{took}", format_duration(time.monotonic() - t0))
            if problem:
                host.error = text
            else:
                host.status = text
        finally:
            self._say_stale_results()
            host.phase = ""
            host.busy = ""


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


def _sentence(text: str) -> str:
    """``text`` ending as a sentence does (what follows it is another sentence)."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else text + "."
