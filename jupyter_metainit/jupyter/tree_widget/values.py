"""The widget's *Values*: :func:`jupyter_metainit.stats` of the ticked subtrees (or the whole
model) on the worker thread, with progress and Cancel as for Materialize and Save.

Nothing in the model changes: deferred tensors stay deferred, their values are computed a few
at a time as ``materialize`` would give them and freed. The result is published as the
kernel-owned ``values`` trait: one row per tree node holding tensors (its tensors together, as
``stats(per="module")``) and one per tensor (with a histogram), which the page shows as
optional columns, a chart along the depth and the focused tensor's histogram.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jupyter_metainit.inspection import stat_tables
from jupyter_metainit.jupyter.tree_widget.stale_results import (
    remember_measured,
    scoped_state,
    under,
)
from jupyter_metainit.jupyter.tree_widget.wording import modules_in_words

if TYPE_CHECKING:
    from jupyter_metainit.jupyter.tree_widget.host import WidgetHost

__all__ = ["HISTOGRAM_BINS", "MODULE_FIELDS", "TENSOR_FIELDS", "prepare_values"]

#: The statistics the page receives, per module row: ``[node, *these]``.
MODULE_FIELDS = ("mean", "std", "absmax", "l2", "nan", "inf")
#: Per tensor: ``[name, owner node, *MODULE_FIELDS, lo, hi, counts]``.
TENSOR_FIELDS = ("name", "node", *MODULE_FIELDS, "lo", "hi", "counts")
HISTOGRAM_BINS = 32


def prepare_values(widget: WidgetHost, content: dict) -> tuple[str, Callable[[], str]]:
    """Check a values message (a mistake raises ValueError, said as a notice); the busy label
    and the job. ``{"action": "values", "names": [...]}``: no name measures the whole model."""
    names = content.get("names") or []
    if names:
        names = widget._check_names(names)
    what = modules_in_words(names or [""], widget.var_name)

    def job() -> str:
        scope = [n for n in names if n]  # "" (the whole model) takes every tensor
        state = scoped_state(widget.module, scope)
        if not state:
            return f"{what} holds no tensors: nothing to measure."

        def progress(done: int, total: int, phase: str = "") -> None:
            widget._progress(done, total, "computing the statistics of the values")

        tensors, modules = stat_tables(state, bins=HISTOGRAM_BINS, progress=progress)
        next_id = int(widget.values.get("id", 0)) + 1
        widget.values = values_payload(widget, tensors, modules, scope, next_id)
        remember_measured(widget, "values", scope)
        bad = int(tensors["nan"].sum() + tensors["inf"].sum())
        flagged = f" {_count(bad, 'NaN or infinite value')} (flagged in red)." if bad else ""
        return (
            f"Measured the values of {what}: {_count(len(tensors), 'tensor')} in {{took}}, the "
            "model unchanged." + flagged
        )

    return "measure the values", job


def _count(n: int, noun: str) -> str:
    """``"1 tensor"``, ``"2 tensors"``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _number(value: Any) -> float | int | None:
    """JSON has no NaN or infinity: those are None (the nan/inf counts say why)."""
    value = float(value)
    if not math.isfinite(value):
        return None
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def values_payload(
    widget: WidgetHost, tensors: Any, modules: Any, scope: list[str], id_: int
) -> dict:
    """The ``values`` trait: per tree node and per tensor, the statistics the page shows."""
    index = widget._tree.index
    rows = []
    for module, row in modules.iterrows():
        if module in index and (not scope or module in scope or under(module, scope)):
            rows.append([index[module], *(_number(row[f]) for f in MODULE_FIELDS)])
    per_tensor = []
    for name, row in tensors.iterrows():
        owner = name.rpartition(".")[0]
        lo, hi = row["histogram_range"]
        per_tensor.append(
            [
                name,
                index.get(owner, -1),
                *(_number(row[f]) for f in MODULE_FIELDS),
                _number(lo),
                _number(hi),
                [int(c) for c in row["histogram"]],
            ]
        )
    return {
        "id": id_,
        "scope": scope,
        "fields": list(MODULE_FIELDS),
        "modules": rows,
        "tensors": per_tensor,
    }
