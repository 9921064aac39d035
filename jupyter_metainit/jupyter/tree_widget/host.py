"""What the widget's parts need back from the widget: one typed interface.

:class:`~jupyter_metainit.jupyter.widget.ModuleTreeWidget` is made of parts that each own their
state (``actions.ActionRunner``, ``plan_actions.PlanState``, ``following.ModelFollower``); what
they read or set on the widget itself (its traits, the model, the tree) is listed here, typed,
so that a part names what it touches instead of sharing untyped attributes with the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from jupyter_metainit.jupyter.module_tree import ModuleTree

__all__ = ["WidgetHost"]


class WidgetHost(Protocol):
    """The widget as its parts see it (``ModuleTreeWidget`` provides every member)."""

    # kernel-owned traits the parts set (the page shows them)
    busy: str
    phase: str
    progress: list[int]
    error: str
    status: str
    selection: dict
    tree: dict
    plan: dict
    values: dict
    comparison: dict
    model_gone: bool
    # the selection and the options of the next action (page-writable), and what the kernel has
    selected: list[str]
    rng: str
    dtype: str
    show_table: bool
    devices: list[dict[str, str]]
    var_name: str
    comm: object | None  # the ipywidgets comm, None once the widget is closed
    # the tree drawn once from the model (immutable), what each Values / Compare measured
    # (stale_results.py), and the save asked once to replace a checkpoint (save_action.py)
    _tree: ModuleTree
    _measured: dict[str, tuple]
    _replace_confirmed: tuple[str, str] | None

    @property
    def module(self) -> nn.Module:
        """The model shown (``ModelGoneError`` once it was freed)."""
        ...

    def send(self, content: dict, buffers: list[bytes] | None = None) -> None:
        """Send a custom message to the page."""
        ...

    def send_state(self, key: str | list[str] | None = None) -> None:
        """Send the kernel's value of these traits to the page (undoes a refused write)."""
        ...

    def has_trait(self, name: str) -> bool:
        """Whether the widget has a trait of this name."""
        ...

    def _notify(self, text: str) -> None:
        """Say a refused request briefly, beside the status (the ``notice`` trait)."""
        ...

    def _check_names(self, names: Any) -> list[str]:
        """The action's module names, canonical; ValueError (said as a notice) if not usable."""
        ...

    def _progress(self, done: int, total: int, phase: str = "") -> None:
        """The progress callback every job reports to; raises ``ActionCancelled`` on Cancel."""
        ...

    def _selection_summary(self) -> dict:
        """The totals of the selection (the ``selection`` trait)."""
        ...

    def _update_table(self) -> None:
        """Rebuild the memory table of the selection, if shown."""
        ...
