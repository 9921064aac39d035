"""Human-readable rendering of a memory table (HTML for Jupyter, text for printing).

The table itself keeps raw numbers; these functions only change how it looks.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import pandas as pd

from jupyter_metainit.core import format_bytes
from jupyter_metainit.estimates.headline import table_headline

__all__ = ["format_table", "render_html", "to_text"]


BYTE_COLUMNS = (
    "param_bytes",
    "buffer_bytes",
    "nonpersistent_bytes",
    "attribute_bytes",
    "total_bytes",
    "shared_bytes",
    "grad_fp32_bytes",
    "optim_fp32_bytes",
    "train_fp32_bytes",
    "grad_mixed_bytes",
    "optim_mixed_bytes",
    "train_mixed_bytes",
    "activation_bytes",
    "peak_forward_bytes",
    "headroom_bytes",
    "budget_bytes",
)
COUNT_COLUMNS = ("params_own", "params", "params_trainable", "flops", "children", "depth")
DEFAULT_COLUMNS = (
    "type",
    "params",
    "params_trainable",
    "param_bytes",
    "buffer_bytes",
    "nonpersistent_bytes",
    "total_bytes",
    "shared_bytes",
    "dtypes",
    "state",
    "source",
    "values",
    "train_fp32_bytes",
    "train_mixed_bytes",
    "output_shape",
    "activation_bytes",
    "flops",
    "peak_forward_bytes",
    "fits",
    "headroom_bytes",
)
HEADERS = {
    "type": "type",
    "params": "params",
    "params_own": "own params",
    "params_trainable": "trainable",
    "param_bytes": "param bytes",
    "buffer_bytes": "buffers",
    "nonpersistent_bytes": "non-persistent",
    "attribute_bytes": "attributes",
    "total_bytes": "total",
    "shared_bytes": "shared",
    "dtypes": "dtypes",
    "state": "state",
    "source": "source",
    "values": "values",
    "grad_fp32_bytes": "grads fp32",
    "optim_fp32_bytes": "optim fp32",
    "train_fp32_bytes": "train fp32",
    "grad_mixed_bytes": "grads mixed",
    "optim_mixed_bytes": "optim mixed",
    "train_mixed_bytes": "train mixed",
    "output_shape": "output shape",
    "activation_bytes": "activations",
    "flops": "FLOPs",
    "peak_forward_bytes": "peak forward",
    "fits": "fits",
    "headroom_bytes": "headroom",
}
_HIGHLIGHT = "background-color: rgba(255, 165, 0, 0.25); font-weight: bold"
_BAR_COLOR = "rgba(100, 149, 237, 0.35)"


def _bytes_cell(n: Any) -> str:
    return "" if n is None or pd.isna(n) else format_bytes(n)


def _count_cell(n: Any) -> str:
    # exact counts in a table (the widget and summaries use the short format_count)
    return "" if n is None or pd.isna(n) else f"{int(n):,}"


def format_shape(shape: Any) -> str:
    """``(1, 4096, 8192)`` -> ``"1x4096x8192"`` (multiplication sign); outputs comma-separated."""
    if shape is None or (isinstance(shape, float) and pd.isna(shape)):
        return ""
    if isinstance(shape, list):
        return ", ".join(format_shape(s) for s in shape)
    if len(shape) == 0:
        return "scalar"
    return "\u00d7".join(str(d) for d in shape)


def _format_cell(column: str, value: Any) -> str:
    if column in BYTE_COLUMNS:
        return _bytes_cell(value)
    if column in COUNT_COLUMNS:
        return _count_cell(value)
    if column == "output_shape":
        return format_shape(value)
    if column == "fits":
        return "" if value is None or pd.isna(value) else ("✓" if value else "✗")
    return "" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)


def _labels(table: pd.DataFrame) -> list[str]:
    """Index labels indented by depth, showing the last name component."""
    depths = table["depth"] if "depth" in table.columns else None
    labels = []
    for pos, name in enumerate(table.index):
        depth = int(depths.iloc[pos]) if depths is not None else str(name).count(".") + bool(name)
        if not name:
            labels.append("(root)")
            continue
        leaf = str(name).rsplit(".", 1)[-1]
        labels.append("\u00a0\u00a0" * (depth - 1) + "└\u00a0" + leaf)
    return labels


def _pick_rows(table: pd.DataFrame, max_rows: int | None) -> tuple[pd.DataFrame, str]:
    if max_rows is None or len(table) <= max_rows:
        return table, ""
    if "depth" in table.columns:
        depths = table["depth"]
        for d in range(int(depths.max()), -1, -1):
            shown = table[depths <= d]
            if len(shown) <= max_rows:
                note = (
                    f"showing depth ≤ {d}: {len(shown):,} of {len(table):,} rows "
                    "(pass depth= to memory_table, or max_rows=None)"
                )
                return shown, note
    return table.iloc[:max_rows], f"showing {max_rows:,} of {len(table):,} rows"


# What fits a 1000 px notebook: the columns people look at first (full view: table.full()).
COMPACT_COLUMNS = (
    "type",
    "params",
    "total_bytes",
    "dtypes",
    "state",
    "source",
    "values",
    "output_shape",
    "activation_bytes",
    "peak_forward_bytes",
    "fits",
    "headroom_bytes",
)


def _columns(table: pd.DataFrame, columns: Sequence[str] | str | None) -> list[str]:
    if columns == "all":
        return list(table.columns)
    if columns == "compact":
        informative = [
            c
            for c in COMPACT_COLUMNS
            if c in table.columns
            and not (c == "source" and not table[c].astype(bool).any())
            # "values" only when some are not eager's (after rng="fast")
            and not (c == "values" and not table[c].isin(["fast", "mixed"]).any())
        ]
        return informative
    wanted = DEFAULT_COLUMNS if columns is None else columns
    return [c for c in wanted if c in table.columns]


def format_table(
    table: pd.DataFrame, *, columns: Sequence[str] | str | None = None
) -> pd.DataFrame:
    """A copy of ``table`` with every cell formatted as text (units, separators, shapes).

    Use it to print a table (e.g. from the ``%%meta_init`` magic); keep the original for sums.
    """
    cols = _columns(table, columns)
    out = pd.DataFrame(
        {HEADERS.get(c, c): [_format_cell(c, v) for v in table[c]] for c in cols},
    )
    out.index = pd.Index(_labels(table), name="module")
    return out


def _summary_line(table: pd.DataFrame) -> str:
    """The model's one-line summary, when the table still has the root row and its columns
    (a selection of columns, ``table[["type", "params"]]``, displays without it)."""
    if "" not in table.index:
        return ""
    try:
        return table_headline(table)
    except KeyError:
        return ""


def to_text(
    table: pd.DataFrame,
    *,
    columns: Sequence[str] | str | None = None,
    max_rows: int | None = 60,
) -> str:
    """Plain-text rendering with units and a summary line, for terminals and magics."""
    shown, note = _pick_rows(table, max_rows)
    text = format_table(shown, columns=columns).to_string()
    lines = [line] if (line := _summary_line(table)) else []
    lines.append(text)
    if note:
        lines.append(note)
    return "\n".join(lines)


def render_html(
    table: pd.DataFrame,
    *,
    columns: Sequence[str] | str | None = None,
    max_rows: int | None = 200,
    highlight: int = 3,
) -> str:
    """HTML for Jupyter: units, indentation by depth, bars and the largest leaves highlighted.

    ``highlight``: how many of the largest leaf modules (by ``total_bytes``) to highlight.
    ``max_rows``: past this many rows, only the deepest levels that fit are shown.
    """
    if table.empty:
        return "<p><em>empty memory table</em></p>"
    shown, note = _pick_rows(table, max_rows)
    cols = _columns(shown, columns)
    display = pd.DataFrame({c: shown[c].to_numpy() for c in cols}, index=pd.RangeIndex(len(shown)))
    labels = _labels(shown)

    top: set[int] = set()
    deepest_shown = False  # some highlighted row has children the table leaves out
    if highlight and "total_bytes" in shown.columns:
        # The rows with nothing below them *in this table*: in a depth-limited table those are
        # the deepest shown (a layer's mlp), not the few true leaves that happen to be shallow
        # (its two norms), which would be highlighted as the "largest" while being the smallest.
        names = [str(n) for n in shown.index]
        parents = {n.rpartition(".")[0] for n in names if n}
        bottom = [n not in parents for n in names]
        sizes = shown["total_bytes"].to_numpy()
        order = [i for i in sizes.argsort()[::-1] if bottom[i]]
        top = {int(i) for i in order[:highlight] if sizes[i] > 0}
        if "children" in shown.columns:
            children = shown["children"].to_numpy()
            deepest_shown = any(children[i] > 0 for i in top)

    styler = display.style
    styler.format({c: (lambda v, c=c: html.escape(_format_cell(c, v))) for c in cols})
    styler.format_index(lambda i: html.escape(labels[i]), axis=0)
    styler.relabel_index([HEADERS.get(c, c) for c in cols], axis=1)
    if "total_bytes" in cols and "" in shown.index:
        root_total = float(shown.loc["", "total_bytes"])
        if root_total > 0:
            styler.bar(subset=["total_bytes"], color=_BAR_COLOR, vmin=0, vmax=root_total)
    text_columns = [c for c in ("type", "dtypes", "state", "source", "values") if c in cols]
    if text_columns:
        styler.set_properties(subset=text_columns, **{"text-align": "left"})
    if top:
        styler.apply(lambda row: [_HIGHLIGHT if row.name in top else "" for _ in row], axis=1)
    styler.set_table_styles(
        [
            {"selector": "th.row_heading", "props": "text-align: left; font-family: monospace;"},
            {"selector": "td", "props": "text-align: right; white-space: nowrap;"},
        ]
    )
    caption = _summary_line(table)
    if top:  # say what the highlight means
        legend = (
            f"highlighted: the {len(top)} largest of the deepest rows shown"
            if deepest_shown
            else f"highlighted: the {len(top)} largest lea{'f' if len(top) == 1 else 'ves'}"
        )
        caption = f"{caption} — {legend}" if caption else legend
    if note:
        caption = f"{caption} — {note}" if caption else note
    # The summary line above the table, outside the box that scrolls: it wraps at the output's
    # width (a caption is as wide as the table, so it was cut mid-word in a narrow output).
    summary = (
        '<p class="jmi-table-summary" style="margin: 0 0 4px; white-space: normal; '
        f'overflow-wrap: anywhere; text-align: left;">{html.escape(caption)}</p>'
        if caption
        else ""
    )
    # A wide table scrolls sideways inside its own box instead of being cut off by a narrow
    # output area (700 px): every column stays reachable.
    box = '<div class="jmi-table-scroll" style="overflow-x: auto; max-width: 100%;">'
    return f"<div>{summary}{box}{styler.to_html()}</div></div>"
