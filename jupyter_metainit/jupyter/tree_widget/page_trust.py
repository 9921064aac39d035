"""What the page may change in a widget: the kernel owns the truth, the page only asks.

The page (any JavaScript in the notebook) may write the selection and the options of the next
action (``PAGE_WRITABLE``); every other trait describes the kernel, and a write of it is
refused and undone on the page, visibly (a notice), never silently applied. A message of an
unexpected shape is a notice too, never a traceback in the kernel. The widget's ``set_state``
and ``_handle_msg`` (what ipywidgets calls for the page) pass through the two gates here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import traitlets

from jupyter_metainit.jupyter.tree_widget.host import WidgetHost

__all__ = ["PAGE_WRITABLE", "apply_page_state", "handle_page_message"]

# What the page may write; everything else describes the kernel.
PAGE_WRITABLE = frozenset({"selected", "rng", "dtype", "show_table", "table_full"})


def apply_page_state(widget: WidgetHost, sync_data: Any, apply: Callable[[dict], None]) -> None:
    """Apply the page's writes of page-writable traits with ``apply`` (ipywidgets' own
    ``set_state``); refuse the rest, visibly.

    A refused or invalid write is undone on the page (the kernel's value is sent back)
    and said in a notice; nothing in the kernel changes.
    """
    if not isinstance(sync_data, dict):
        widget._notify(
            f"Ignored a malformed update from the page (a {type(sync_data).__name__}, "
            "not a set of traits); nothing changed."
        )
        return
    allowed = {k: v for k, v in sync_data.items() if k in PAGE_WRITABLE}
    refused = sorted(str(k) for k in set(sync_data) - set(allowed))
    unknown = [k for k in refused if not widget.has_trait(k)]
    owned = [k for k in refused if widget.has_trait(k)]
    if unknown:
        widget._notify(f"Ignored an update of {', '.join(unknown)} from the page: no such trait.")
    if owned:
        widget._notify(f"Ignored a change of {', '.join(owned)} from the page: the kernel owns it.")
        widget.send_state(owned)
    for key, value in allowed.items():
        try:
            apply({key: value})
        except (traitlets.TraitError, TypeError, ValueError) as exc:
            widget._notify(f"Refused from the page: {exc}")
            widget.send_state([key])


def handle_page_message(widget: WidgetHost, msg: Any, handle: Callable[[dict], None]) -> None:
    """Pass a comm message from the page to ``handle`` (ipywidgets' own ``_handle_msg``) if it
    has the expected shape; otherwise, or if ``handle`` fails on it, a notice, never a
    traceback in the kernel."""
    data = msg.get("content", {}).get("data") if isinstance(msg, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        widget._notify("Ignored a malformed message from the page.")
        return
    if (
        data["method"] == "update"
        and "buffer_paths" in data
        and not isinstance(data.get("state"), dict)
    ):
        widget._notify("Ignored a malformed update from the page.")
        return
    try:
        handle(msg)
    except Exception as exc:  # whatever the page sent, the kernel stays quiet and unchanged
        widget._notify(f"Ignored a message from the page that could not be read ({exc}).")
