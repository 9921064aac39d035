"""What the page may change in a widget: the kernel owns the truth, the page only asks.

The page (any JavaScript in the notebook) may write the selection and the options of the next
action (``PAGE_WRITABLE``); every other trait describes the kernel, and a write of it is
refused and undone on the page, visibly (a notice), never silently applied. A message of an
unexpected shape is a notice too, never a traceback in the kernel.
"""

from __future__ import annotations

from typing import Any

import traitlets

__all__ = ["PAGE_WRITABLE", "PageTrust"]

# What the page may write; everything else describes the kernel.
PAGE_WRITABLE = frozenset({"selected", "rng", "dtype", "show_table", "table_full"})


class PageTrust:
    """Mixin for an ``anywidget.AnyWidget`` with a ``notice`` trait: applies the page's writes
    of page-writable traits only, and turns malformed messages into notices."""

    notice: Any

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
        allowed = {k: v for k, v in sync_data.items() if k in PAGE_WRITABLE}
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
