"""The clickable model tree that ``%%meta_init`` shows under the cell.

Use :func:`explore` on any ``nn.Module`` (deferred, real or a mix) to see its hierarchy with
parameter counts, sizes, dtypes and where each part lives, to select subtrees with checkboxes,
and to materialize or free them with a button.

The kernel owns the truth: the page can only request actions and set the selection and the
options (``tree_widget/page_trust.py``); every other trait describes the kernel and is refused
when the page writes it. Every widget showing a model follows it whoever changes it (code,
magics, another widget, ``materialize_sharded``): the core publishes what it changed
(``core.events``), and the widget refreshes once per burst of changes
(``tree_widget/following.py``), with no polling while idle.

The widget is made of parts that each own their state, constructed with it: an
``ActionRunner`` (the worker thread, Cancel, the queued click, Materialize and Free), a
``PlanState`` (the last plan, its options and pins), a ``ModelFollower`` (the rows as last
measured, the refresh); what they need back from the widget is ``tree_widget/host.WidgetHost``.
The widget keeps the traits, the selection and the Python API, which hands each call to its
part.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import pathlib
import weakref
from collections.abc import Iterable
from html import escape
from typing import Any

import anywidget
import traitlets
from torch import nn

from jupyter_metainit.core import events, format_bytes, format_count, parse_dtype
from jupyter_metainit.core.errors import ArgumentTypeError
from jupyter_metainit.estimates import memory_table
from jupyter_metainit.jupyter.cell_watch import cells, watch_cells
from jupyter_metainit.jupyter.module_tree import ModelGoneError, ModuleTree
from jupyter_metainit.jupyter.tree_widget.actions import ActionRunner
from jupyter_metainit.jupyter.tree_widget.device_fit import fit_per_device, visible_cuda_devices
from jupyter_metainit.jupyter.tree_widget.following import ModelFollower
from jupyter_metainit.jupyter.tree_widget.page_trust import apply_page_state, handle_page_message
from jupyter_metainit.jupyter.tree_widget.plan_actions import PlanState, prepare_job
from jupyter_metainit.jupyter.tree_widget.wording import MODEL_GONE, SAVED_ADVICE, code_path

__all__ = ["ModuleTreeWidget", "explore", "watch_cells", "widgets_of"]

_STATIC = pathlib.Path(__file__).parent / "static"
# The dtypes the page offers ("" keeps each tensor's own).
_DTYPE_CHOICES = ("", "float32", "bfloat16", "float16")
_live_widgets: weakref.WeakSet[ModuleTreeWidget] = weakref.WeakSet()
# The note before a widget output, in JupyterLab 4 and Notebook 7 (one output area): hidden
# while the output after it holds a tree (live, or dead with its banner); that output hidden
# while it holds none ("Loading widget...", "Error displaying widget: model not found", or its
# own saved summary where widgets do not render), so a reopened notebook shows the note alone.
_NOTE = ".jp-OutputArea-child:has(.jmi-saved-note)"
SAVED_NOTE_STYLE = (
    f"{_NOTE}:has(+ .jp-OutputArea-child .jmi-root){{display:none}}"
    f"{_NOTE} + .jp-OutputArea-child:not(:has(.jmi-root)){{display:none}}"
)


def _static_text(name: str) -> str:
    # The built front end as text, not as a path: anywidget turns a path into a FileContents
    # whose class-level `changed` signal holds every widget ever made (file watching or not),
    # so no widget could be freed.
    return (_STATIC / name).read_text(encoding="utf-8")


def widgets_of(module: nn.Module) -> list[ModuleTreeWidget]:
    """The open widgets showing ``module`` (as their model or a part of it).

    ``%%meta_init`` displays a widget without binding it to a name; use this to find it again
    and drive it from code (set its selection, materialize, plan, save).

    Args:
        module: a model, or a part of one, that widgets show.

    Returns:
        The open widgets whose model is ``module`` or contains it, oldest first (empty when
        none shows it).

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import explore, meta_init, widgets_of
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        >>> w = explore(model)  # what %%meta_init displays under the cell
        >>> widgets_of(model) == [w], widgets_of(model[1]) == [w]
        (True, True)
    """
    _check_module(module, "widgets_of")
    return [w for w in list(_live_widgets) if w.comm is not None and w._tree.holds(module)]


_exiting = False


@atexit.register  # runs before IPython's own exit handler, which empties the namespace
def _note_exit() -> None:
    global _exiting
    _exiting = True


def _on_model_freed(widget_ref: weakref.ref) -> Any:
    """A callback for the model's weak reference: the widget (held weakly: a widget must not
    keep itself alive) shows that the model is gone at once, not at the next click. Not while
    the kernel exits: its models go with it, and the page says the kernel is gone."""

    def freed(_ref: weakref.ref) -> None:
        widget = widget_ref()
        if widget is not None and not _exiting:
            with contextlib.suppress(Exception):  # runs where the model was freed: never raise
                widget.mark_model_gone()

    return freed


class ModuleTreeWidget(anywidget.AnyWidget):
    """Interactive tree of a model: explore it, select subtrees, materialize or free them.

    What ``%%meta_init`` and :func:`explore` display: one row per module with its parameter
    count, size and state (deferred, or the device it is on). Use it in a notebook to decide
    what to materialize, plan or save, by clicking or from code. Read or set the selection
    with ``w.selected`` (qualified module names, ``""`` is the whole model).
    ``w.materialize("cpu")`` and ``w.free()`` do what the buttons do, for the current
    selection; ``w.place("cuda:0=80GiB, cuda:1=80GiB", seq_len=4096)``, ``w.pin("cuda:1")``,
    ``w.materialize_plan()`` and ``w.save(path)`` what the plan and save bars do. The widget
    follows the model by itself: whatever materializes or frees a part of it (code, a magic,
    another widget) shows here within a fraction of a second.

    Args:
        module: the model to show: deferred, partly materialized or real.
        depth: how many levels of the tree are open at first.
        name: the model's name in the notebook, used to offer each row's path as code
            (``model.model.layers[5]``).
        **kwargs: traits of the widget (``anywidget.AnyWidget``'s).

    Raises:
        ArgumentTypeError: ``module`` is not an ``nn.Module``.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import ModuleTreeWidget, is_deferred, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        >>> w = ModuleTreeWidget(model, name="model")
        >>> w.selected = ["0"]  # tick model[0]
        >>> w.selection["params"]
        72
        >>> w.materialize("cpu")  # as the button does, waiting for it to finish
        >>> w.status
        'Materialized model[0] on cpu in ... ms.'
        >>> is_deferred(model[0]), is_deferred(model[1])
        (False, True)
        >>> w.free()  # deferred again
        >>> is_deferred(model[0])
        True
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
    model_gone = traitlets.Bool(
        False, help="The model was freed (no name refers to it): every action is off for good."
    ).tag(sync=True)
    status = traitlets.Unicode("", help="What the last action did.").tag(sync=True)
    notice = traitlets.Dict(
        {"id": 0, "text": ""}, help="A refused request: shown briefly, beside the status."
    ).tag(sync=True)
    devices = traitlets.List(help="Visible CUDA devices.").tag(sync=True)
    no_cuda_reason = traitlets.Unicode("").tag(sync=True)
    table_html = traitlets.Unicode("").tag(sync=True)
    plan = traitlets.Dict(
        help="The last plan (tree_widget/plan_actions.py: devices, per-node device), {} if none."
    ).tag(sync=True)
    values = traitlets.Dict(
        help="The last Values (tree_widget/values.py: per node and per tensor), {} if none."
    ).tag(sync=True)
    comparison = traitlets.Dict(
        help="The last Compare with… (tree_widget/comparing.py: per node and tensor), {} if none."
    ).tag(sync=True)
    var_name = traitlets.Unicode(
        "model", help="The model's name in the notebook, for paths usable in the magics."
    ).tag(sync=True)
    # page-writable: the selection and the options of the next action
    selected = traitlets.List(traitlets.Unicode(), help="Selected subtrees (qualified names).").tag(
        sync=True
    )
    rng = traitlets.Enum(["exact", "fast"], "exact").tag(sync=True)
    dtype = traitlets.Enum(list(_DTYPE_CHOICES), "", help="'' keeps each tensor's dtype.").tag(
        sync=True
    )
    show_table = traitlets.Bool(False, help="Show the memory table of the selection.").tag(
        sync=True
    )
    table_full = traitlets.Bool(False, help="All columns of the memory table.").tag(sync=True)

    def __init__(
        self, module: nn.Module, *, depth: int = 2, name: str = "model", **kwargs: Any
    ) -> None:
        _check_module(module, "ModuleTreeWidget")
        # Held weakly (see ModuleTree): the widget outlives its output in ipywidgets' registry.
        self._module_ref = weakref.ref(module, _on_model_freed(weakref.ref(self)))
        self._model_type = type(module).__name__
        self._tree = ModuleTree.build(module)
        # what each Values / Compare result measured (tree_widget/stale_results.py)
        self._measured: dict[str, tuple] = {}
        # the save asked once to replace a checkpoint (tree_widget/save_action.py)
        self._replace_confirmed: tuple[str, str] | None = None
        # its parts (what each needs back from the widget: tree_widget/host.WidgetHost)
        self._follower = ModelFollower(self, self._tree, module)
        self._plans = PlanState(self)
        self._actions = ActionRunner(
            self, self._follower, functools.partial(prepare_job, self, self._plans)
        )
        devices, reason = visible_cuda_devices()
        super().__init__(
            tree=self._tree.to_json(self._follower.stats),
            expand_depth=depth,
            var_name=name,
            devices=devices,
            no_cuda_reason=reason,
            **kwargs,
        )
        self.selection = self._selection_summary()
        self.on_msg(self._on_msg)
        watch_cells()
        cells.followers.add(self._follower)
        events.subscribe(self._follower.on_core_change)
        _live_widgets.add(self)

    @property
    def module(self) -> nn.Module:
        """The model shown; :class:`ModelGoneError` once nothing else refers to it."""
        module = self._module_ref()
        if module is None:
            raise ModelGoneError(MODEL_GONE)
        return module

    def __repr__(self) -> str:
        # What plain-text front ends (terminals, nbconvert to text) show instead of the tree.
        root = self._follower.stats[0]
        gone = "" if self._tree.alive else ", model gone"
        return (
            f"ModuleTreeWidget({self._model_type}: {format_count(root.params)} params, "
            f"{format_bytes(root.bytes)}, {root.state}{gone})"
        )

    def _summary_line(self) -> str:
        root = self._follower.stats[0]
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
        data["text/plain"] = f"Model tree of {line}.\n{SAVED_ADVICE}"
        data["text/html"] = (
            f"<div class='jmi-saved'><b>Model tree</b> of {escape(line)}.<br>"
            f"<small>{escape(SAVED_ADVICE)}</small></div>"
        )
        return data, metadata

    def _ipython_display_(self, **kwargs: Any) -> None:
        """Two outputs: a note in words, then the live tree. JupyterLab and Notebook 7 never
        show a widget output's own fallback: a notebook reopened without this widget's kernel
        gets "Error displaying widget: model not found" (ipywidgets saves no widget state by
        default) instead. The note says what the output was and how to get a live tree, and
        its own style rules (:data:`SAVED_NOTE_STYLE`) show either the note or the tree: the
        note, and not the output after it, while that output holds no tree."""
        from IPython.display import display

        line = escape(self._summary_line())
        display(
            {
                "text/html": f"<style>{SAVED_NOTE_STYLE}</style>"
                f"<div class='jmi-saved-note'><b>Model tree</b> of {line}. "
                f"<small>{escape(SAVED_ADVICE)}</small></div>"
            },
            raw=True,
        )
        bundle = self._repr_mimebundle_(**kwargs)
        if bundle is not None:
            data, metadata = bundle
            display(data, metadata=metadata, raw=True)

    # ------------------------------------------------------------------ the page's writes
    def set_state(self, sync_data: dict) -> None:
        """Apply the page's writes of page-writable traits; refuse the rest, visibly.

        What ipywidgets calls for each update from the page. The page may write the selection
        and the options of the next action; a refused or invalid write is undone on the page
        (the kernel's value is sent back) and said in a notice, and nothing in the kernel
        changes (``tree_widget/page_trust.py``).

        Args:
            sync_data: the traits the page wrote, by name.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> w.set_state({"selected": ["0"], "busy": "materialize cpu"})
            >>> w.selected, w.busy, w.notice["text"]
            (['0'], '', 'Ignored a change of busy from the page: the kernel owns it.')
        """
        apply_page_state(self, sync_data, super().set_state)

    def _handle_msg(self, msg: dict) -> None:
        # A page message of an unexpected shape is a notice, never a traceback in the kernel.
        handle_page_message(self, msg, super()._handle_msg)

    def _notify(self, text: str) -> None:
        self.notice = {"id": int(self.notice.get("id", 0)) + 1, "text": text}

    # ------------------------------------------------------------------ actions
    def _on_msg(self, _widget: object, content: object, _buffers: object) -> None:
        self._actions.on_message(content)

    def handle_action(self, content: Any) -> None:
        """Carry out one action message from the front end (also usable from Python).

        ``{"action": "materialize", "device": "cpu" | "cuda:N" | None, "names": [...]}``,
        ``{"action": "free", "names": [...]}``, ``{"action": "cancel"}``,
        ``{"action": "refresh"}`` or ``{"action": "ping"}``; the plan and save actions
        (``plan``, ``pin``, ``unpin``, ``materialize_plan``, ``save``, ``values``) are described in
        ``plan_actions.py``, ``save_action.py`` and ``values.py``.  Anything invalid is refused
        with a brief notice and changes nothing; it never replaces the message of the
        running or last action.

        Args:
            content: the message, as the page sends it.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> w.handle_action({"action": "exec", "code": "print(1)"})
            >>> w.notice["text"]
            "Unknown action 'exec'; nothing was done."
        """
        self._actions.handle(content)

    def _progress(self, done: int, total: int, phase: str = "") -> None:
        # The one progress hook every job reports to (the core's callback, save's, values',
        # compare's): raises ActionCancelled once Cancel was clicked.
        self._actions.progress(done, total, phase)

    def _request(self, content: dict, wait: bool) -> None:
        """What a button sends, from code: the action, then (``wait``) its end."""
        self.handle_action(content)
        if wait:
            self.wait()

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
        return self._actions.wait(timeout)

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
        self._request({"action": "materialize", "device": device, "names": self.selected}, wait)

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
        self._request({"action": "free", "names": self.selected}, wait)

    def place(
        self,
        devices: str,
        *,
        batch: int = 1,
        seq_len: int | None = None,
        training: bool = False,
        inputs: str | None = None,
        precision: str | None = None,
        wait: bool = True,
    ) -> None:
        """Plan where each part goes, as *Plan…* does: :func:`~jupyter_metainit.place` on the
        worker thread; the tree then shows a device per part and a bar per device.

        Args:
            devices: as typed in the plan bar: ``"cuda:0=80GiB, cuda:1=80GiB"`` or ``"auto"``.
            batch: samples per step.
            seq_len: tokens per sample.
            training: plan a training step.
            inputs: as the Inputs field, ``"(8, 3, 224, 224)"``, instead of ``seq_len``.
            precision: as the Precision field (``None``: as built, ``"bf16"``, ``"fp32"``,
                ``"bf16-mixed"``); *Materialize plan* then materializes the weights in it.
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
            >>> w = explore(model)
            >>> w.place("cuda:0=6MiB, cuda:1=6MiB", inputs="(8, 1024)")
            >>> w.status
            'Planned in ... It fits: cuda:0 4.10 MiB of 6.00 MiB, cuda:1 4.10 MiB of 6.00 MiB.'
            >>> w.plan["device_map"]
            {'0': 'cuda:0', '1': 'cuda:0', '2': 'cuda:1'}
        """
        self._request(
            {
                "action": "plan",
                "devices": devices,
                "batch": batch,
                "seq_len": seq_len,
                "training": training,
                "inputs": inputs,
                "precision": precision,
            },
            wait,
        )

    def pin(self, device: str, *, wait: bool = True) -> None:
        """Pin the selected subtrees to ``device`` and plan the rest around them, as a row's
        *Pin* does (after :meth:`place`).

        Args:
            device: one of the plan's devices.
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
            >>> w = explore(model)
            >>> w.place("cuda:0=6MiB, cuda:1=6MiB", inputs="(8, 1024)")
            >>> w.selected = ["0"]
            >>> w.pin("cuda:1")
            >>> w.status
            'Planned in ... Pinned: model[0] → cuda:1.'
        """
        self._request({"action": "pin", "names": self.selected, "device": device}, wait)

    def materialize_plan(self, *, wait: bool = True) -> None:
        """Materialize every part on the device the plan gives it, as *Materialize plan* does
        (after :meth:`place`).

        Args:
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> w.place("cpu=1GiB", inputs="(8, 64)")
            >>> w.materialize_plan()
            >>> is_deferred(model), model[1].weight.device
            (False, device(type='cpu'))
        """
        self._request({"action": "materialize_plan"}, wait)

    def save(self, path: str, *, format: str = "safetensors", wait: bool = True) -> None:
        """Save the selected subtree (the whole model if none is selected) to ``path`` with
        :func:`~jupyter_metainit.save`, as *Save…* does, on the worker thread with progress.

        Args:
            path: the directory to write (``~`` expands).
            format: ``"safetensors"`` or ``"dcp"``.
            wait: block until it is done.

        Examples:
            >>> import os, tempfile
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     w.save(directory)
            ...     os.listdir(directory)
            ['model.safetensors']
            >>> is_deferred(model)  # saved without materializing
            True
        """
        self._request(
            {"action": "save", "path": path, "format": format, "names": self.selected}, wait
        )

    def measure_values(self, *, wait: bool = True) -> None:
        """Compute the statistics of the selected subtrees' values (the whole model if none is
        selected) with :func:`jupyter_metainit.stats`, as *Values* does; the model is not
        changed. The tree then shows them (``w.values`` holds them).

        Args:
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> w.measure_values()
            >>> w.status
            'Measured the values of model (the whole model): 4 tensors in ... the model unchanged.'
            >>> is_deferred(model)
            True
        """
        self._request({"action": "values", "names": self.selected}, wait)

    def compare_with(self, other: str, *, wait: bool = True) -> None:
        """Compare the selected subtrees (the whole model if none is selected) with ``other``,
        a checkpoint path or the name of a model or state dict in the notebook, as
        *Compare with…* does (``w.comparison`` holds the result); neither side changes.

        Args:
            other: a checkpoint path, or the name of a model or state dict in the notebook.
            wait: block until it is done.

        Examples:
            >>> import tempfile
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     w.save(directory)
            ...     w.compare_with(directory)
            >>> w.status
            'Compared model (the whole model) with ... in ...: 4 equal.'
        """
        self._request({"action": "compare", "other": other, "names": self.selected}, wait)

    # ------------------------------------------------------------------ following the model
    def refresh(self) -> bool:
        """Recompute every node's totals and state; send the page only the rows that changed.

        The widget refreshes by itself after each change the core publishes and each action;
        call it after changing the model in a way the core does not see.

        Returns:
            True if any row changed.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> w.refresh()  # nothing changed since the tree was drawn
            False
        """
        return self._follower.refresh()

    def model_changed(self) -> bool:
        """Whether the model was freed, or a module of it added, removed or replaced since the
        tree was drawn; if so the actions are turned off, saying which (``w.error``).

        Returns:
            True if the tree no longer shows the model (every action is then off for good).

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> del model[1]
            >>> w.model_changed(), w.model_gone
            (True, True)
            >>> w.error
            'The model changed since this tree was drawn (`model[1]` was added, removed or ...'
        """
        return self._follower.model_changed()

    def mark_model_gone(self, why: str = MODEL_GONE) -> None:
        """The model was freed, or changed under the tree (``why``): say so, and turn every
        action off for good (the page greys its buttons, as when the kernel is gone).

        Args:
            why: what ``w.error`` says (by default: the model was freed).

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore
            >>> w = explore(nn.Linear(2, 2))
            >>> w.mark_model_gone("The model was replaced.")
            >>> w.model_gone, w.error
            (True, 'The model was replaced.')
        """
        self._follower.mark_model_gone(why)

    def after_cell(self) -> None:
        """After each cell: a cell that deleted, replaced or added a module turns the actions
        off now, not at the next click; Values and Compare results whose tensors changed are
        cleared. ``cell_watch`` does it for every widget; this does it for this one.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
            >>> w = explore(model)
            >>> del model[1]  # what a cell does
            >>> w.after_cell()
            >>> w.model_gone
            True
        """
        self._follower.after_cell()

    def close(self) -> None:
        """Close the widget: the page's view goes, and the widget stops following the model.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore
            >>> w = explore(nn.Linear(2, 2))
            >>> w.close()
            >>> w.comm is None
            True
        """
        follower = getattr(self, "_follower", None)  # None if __init__ failed
        if follower is not None:
            follower.close()
        super().close()

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

    @traitlets.observe("selected", "dtype")
    def _on_selection(self, _change: dict) -> None:
        self.selection = self._selection_summary()
        if self.show_table:
            self._update_table()

    def _selection_summary(self) -> dict:
        if not self._tree.alive:
            return {}
        nodes = [self._tree.index[n] for n in self.selected]
        summary = self._tree.selection_stats(nodes, parse_dtype(self.dtype or None))
        summary["fit"] = fit_per_device(summary, self.devices) if nodes else {}
        return summary

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
                self.module.get_submodule(name), depth=depth, dtype=parse_dtype(self.dtype or None)
            )
            # always say which module the table shows (the selection, or the whole model)
            title = code_path(self.var_name, name) if name else f"{self.var_name} (whole model)"
            parts.append(f"<h4 class='jmi-table-title'>Memory table of {escape(title)}</h4>")
            parts.append(table.to_html_view(compact=not self.table_full))
        return "\n".join(parts)


def explore(module: nn.Module, *, depth: int = 2, name: str = "model") -> ModuleTreeWidget:
    """Show ``module`` as an interactive tree (what ``%%meta_init`` displays under the cell).

    Use it for a model built elsewhere (a script, ``from_pretrained``, a plain ``with
    meta_init():`` block) to browse its parts, see what each costs, and materialize, free,
    plan or save them by clicking. Works on deferred, real and partly materialized models
    alike.

    Args:
        module: the model to show.
        depth: how many levels of the tree are open at first.
        name: the model's name in the notebook, used to offer each row's path as code
            (``model.model.layers[5]``).

    Returns:
        The widget (the last expression of a cell displays it); its ``selected`` lists the
        ticked subtrees.

    Raises:
        ArgumentTypeError: ``module`` is not an ``nn.Module``.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import explore, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        >>> w = explore(model, depth=1)
        >>> w.selected = ["", "1"]  # the whole model, and model[1]
        >>> w.selection["modules"], w.selection["params"]  # model[1] is inside the model
        (1, 90)
    """
    _check_module(module, "explore")
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise ArgumentTypeError(f"depth takes an int, the levels open at first, not {depth!r}")
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name takes a str, the model's name in the notebook, not {name!r}")
    return ModuleTreeWidget(module, depth=depth, name=name)


def _check_module(module: Any, func: str) -> None:
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"{func}() takes an nn.Module (a model or a part of it), not {type(module).__name__}"
        )
