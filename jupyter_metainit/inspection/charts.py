"""A statistic along a model's depth, and a small SVG chart of it (no plotting library needed).

:func:`along_depth` picks one tensor (or module) of every repeated block out of a ``stats`` or
``compare`` table, ``q_proj.weight`` of every layer, and orders it by layer number;
:func:`svg_chart` draws such series as lines or bars. The chart is a self-contained SVG on a
white background (readable in light and dark pages) that notebooks display inline.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence

import pandas as pd

from jupyter_metainit.core.errors import ArgumentError

__all__ = ["Chart", "along_depth", "svg_chart"]

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def along_depth(table: pd.DataFrame, name: str, column: str = "std") -> pd.Series:
    """One statistic of one tensor of every repeated block, by layer number: ``column`` of the
    rows named ``<blocks>.<layer>.[...].<name>`` (the layer is the last number before
    ``name``).

    Use it to follow one tensor through the repeated blocks of a model: the std of
    ``attn.c_proj.weight`` in every GPT-2 block (is the depth-scaled init there?), the
    ``rel_l2`` of ``mlp.down_proj.weight`` in every fine-tuned Llama layer.

    Args:
        table: a table of :func:`~jupyter_metainit.stats` or :func:`~jupyter_metainit.compare`.
        name: the name inside each block, e.g. ``"self_attn.q_proj.weight"`` (a module's name
            for a per-module table).
        column: the statistic to take.

    Returns:
        A pandas Series, layer number -> value, in layer order (several rows of one layer,
        as in a model of two stacks, give their mean).

    Raises:
        ArgumentError: the table has no such column, or no row is ``name`` inside a numbered
            block.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import meta_init, stats
        >>> from jupyter_metainit.inspection import along_depth
        >>> _ = torch.manual_seed(0)
        >>> with meta_init():
        ...     layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        ...     model = nn.ModuleDict({"layers": layers})
        >>> along_depth(stats(model), "weight").round(3)  # U(-1/8, 1/8): std 0.072
        layer
        0    0.072
        1    0.072
        2    0.073
        3    0.073
        Name: std, dtype: float64
    """
    if column not in table.columns:
        numeric = [c for c in table.columns if pd.api.types.is_numeric_dtype(table[c])]
        raise ArgumentError(
            f"along_depth(): the table has no column {column!r}; take one of "
            f"{', '.join(map(repr, numeric))}"
        )
    pattern = re.compile(rf"(?:.*\.)?(\d+)\.(?:.*\.)?{re.escape(name)}")
    layers, values = [], []
    for index, value in zip(table.index, table[column], strict=True):
        match = pattern.fullmatch(str(index))
        if match is not None:
            layers.append(int(match.group(1)))
            values.append(value)
    if not layers:
        raise ArgumentError(
            f"along_depth(): no row is {name!r} inside a numbered block (rows look like "
            f"{str(table.index[0])!r}); give the name inside each block, e.g. "
            "'self_attn.q_proj.weight'"
            if len(table.index)
            else f"along_depth(): the table has no rows to find {name!r} in"
        )
    series = pd.Series(values, index=layers, name=column, dtype=float)
    return series.groupby(level=0).mean().rename_axis("layer")


class Chart:
    """An SVG image that notebooks show inline (``_repr_svg_``); ``str()`` is the SVG text."""

    def __init__(self, svg: str, title: str = "") -> None:
        self.svg = svg
        self.title = title

    def __repr__(self) -> str:
        return f"<chart: {self.title}>" if self.title else "<chart>"

    def _repr_svg_(self) -> str:
        return self.svg

    def __str__(self) -> str:
        return self.svg


def svg_chart(
    series: Mapping[str, Sequence[float]],
    *,
    title: str = "",
    ylabel: str = "",
    xlabel: str = "layer",
    bars: bool = False,
    dashed: Sequence[str] = (),
    width: int = 640,
    height: int = 300,
) -> Chart:
    """Draw ``{label: values by layer}`` as lines (or grouped bars) from 0 up, with a legend.

    Use it to see a statistic along the depth in a notebook without a plotting library:
    the result is a self-contained SVG image, on a white background readable in light and
    dark pages.

    Args:
        series: each label's values, the i-th value drawn at x = i (layer i).
        title: drawn above the plot.
        ylabel: the y axis' name.
        xlabel: the x axis' name.
        bars: bars instead of lines.
        dashed: the labels drawn as dashed lines (a reference, an expected value).
        width: the image's size in pixels.
        height: the image's size in pixels.

    Returns:
        A :class:`Chart`, shown as an image by Jupyter.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import meta_init, stats
        >>> from jupyter_metainit.inspection import along_depth, svg_chart
        >>> with meta_init():
        ...     layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        ...     model = nn.ModuleDict({"layers": layers})
        >>> table = stats(model)
        >>> chart = svg_chart({"weight": along_depth(table, "weight")}, ylabel="std")
        >>> chart  # a notebook shows the image
        <chart>
        >>> str(chart)[:40]
        '<svg xmlns="http://www.w3.org/2000/svg" '
    """
    left, right, top, bottom = 70, 170, 30, 40
    count = max([len(v) for v in series.values()] + [1])
    finite = [float(v) for vs in series.values() for v in vs if v == v and abs(v) != float("inf")]
    top_value = _nice_ceiling(max([*finite, 0.0]) * 1.05)
    step = (width - left - right) / count

    def x(i: float) -> float:
        return left + (i + 0.5) * step

    def y(v: float) -> float:
        v = min(max(v, 0.0), top_value) if v == v else 0.0
        return top + (1 - v / top_value) * (height - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18" font-weight="bold">{html.escape(title)}</text>',
        f'<path d="M{left} {top}V{y(0)}H{width - right}" fill="none" stroke="#444"/>',
        f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">'
        f"{html.escape(xlabel)}</text>",
        f'<text transform="translate(14 {(top + height - bottom) / 2}) rotate(-90)" '
        f'text-anchor="middle">{html.escape(ylabel)}</text>',
    ]
    for k in range(5):
        v = top_value * k / 4
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for i in range(0, count, max(1, count // 8)):
        out.append(f'<text x="{x(i):.1f}" y="{y(0) + 16}" text-anchor="middle">{i}</text>')
    for k, (label, values) in enumerate(series.items()):
        color = _PALETTE[k % len(_PALETTE)]
        out.extend(
            _bars(values, k, len(series), color, x, y, step)
            if bars
            else [_line(values, color, x, y, label in dashed)]
        )
        out.append(
            f'<rect x="{width - right + 10}" y="{top + 16 * k}" width="12" height="12" '
            f'fill="{color}"/>'
        )
        out.append(
            f'<text x="{width - right + 28}" y="{top + 16 * k + 10}">{html.escape(label)}</text>'
        )
    out.append("</svg>")
    return Chart("".join(out), title)


Scale = Callable[[float], float]


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 4, 8 x 10**k at least ``value`` (1 for nothing to show): the
    axis' top, so that its quarter ticks are round numbers."""
    if not value > 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    return next(m * scale for m in (1, 2, 4, 8, 10) if m * scale >= value)


def _line(values: Sequence[float], color: str, x: Scale, y: Scale, dashed: bool) -> str:
    points = " ".join(f"{x(i):.1f},{y(float(v)):.1f}" for i, v in enumerate(values))
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    return f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'


def _bars(
    values: Sequence[float], k: int, groups: int, color: str, x: Scale, y: Scale, step: float
) -> list[str]:
    """Bar ``k`` of ``groups`` side by side at each layer."""
    width = step * 0.8 / groups
    out = []
    for i, v in enumerate(values):
        x0 = x(i) - step * 0.4 + k * width
        top, base = y(float(v)), y(0.0)
        out.append(
            f'<rect x="{x0:.1f}" y="{top:.1f}" width="{width:.1f}" '
            f'height="{base - top:.1f}" fill="{color}"/>'
        )
    return out
