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
"""

from __future__ import annotations

import atexit
import contextlib
import pathlib
import threading
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
from jupyter_metainit.jupyter.tree_widget.actions import TreeActions
from jupyter_metainit.jupyter.tree_widget.calls import PlanningCalls
from jupyter_metainit.jupyter.tree_widget.device_fit import fit_per_device, visible_cuda_devices
from jupyter_metainit.jupyter.tree_widget.following import FollowsModel
from jupyter_metainit.jupyter.tree_widget.page_trust import PageTrust
from jupyter_metainit.jupyter.tree_widget.plan_actions import TreePlanning
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


class ModuleTreeWidget(
    PageTrust, TreePlanning, PlanningCalls, TreeActions, FollowsModel, anywidget.AnyWidget
):
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
        self._stats = self._tree.stats()
        self._ids = self._tensor_ids()
        devices, reason = visible_cuda_devices()
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        self._action_lock = threading.Lock()  # check-and-set of `busy`, from any thread
        self._refresh_lock = threading.Lock()
        # what each Values / Compare result measured (tree_widget/stale_results.py)
        self._measured: dict[str, tuple] = {}
        self._sync_timer: threading.Timer | None = None
        self._last_progress = 0.0
        self._queued: dict | None = None  # a page action waiting for the running cell to end
        self._placement = None  # the last plan, what *Materialize plan* materializes
        self._plan_request: dict | None = None  # its options, re-used by pins
        self._pins: dict[str, str] = {}
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
        cells.followers.add(self)
        events.subscribe(self._on_core_change)
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
