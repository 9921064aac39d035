"""The memory table's type: a ``pandas.DataFrame`` of raw numbers shown with units in Jupyter.

:func:`~jupyter_metainit.estimates.memory_table` and ``dry_run`` return it; everything a
DataFrame does works on it (sort, sum, plot), only its Jupyter display differs.
"""

from __future__ import annotations

import pandas as pd

from jupyter_metainit.estimates.render import render_html

__all__ = ["MemoryTable"]


class MemoryTable(pd.DataFrame):
    """A ``pandas.DataFrame`` of raw numbers that displays itself with human-readable units.

    Everything a DataFrame does works (sort, sum, plot); only the Jupyter display differs.
    """

    @property
    def _constructor(self) -> type[MemoryTable]:
        return MemoryTable

    def _repr_html_(self) -> str | None:
        return self.to_html_view(compact=self.attrs.get("view") != "full")

    def full(self) -> MemoryTable:
        """The same table, displayed with all its columns (the default view is compact)."""
        out = self.copy()
        out.attrs["view"] = "full"
        return out

    def to_html_view(self, *, compact: bool = True) -> str:
        """The HTML Jupyter shows: compact (fits a 1000 px notebook) or with every column."""
        html = render_html(self, columns="compact" if compact else None)
        if compact:
            html += (
                "<p style='font-size: smaller; opacity: 0.7'>Compact view; "
                "<code>table.full()</code> (or <code>%meta_table ... --full</code>) shows "
                "every column.</p>"
            )
        return html
