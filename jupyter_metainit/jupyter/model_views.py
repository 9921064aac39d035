"""How ``%%meta_init`` shows a model it made: the summary line, then the tree widget (or the
memory table), falling back to the next view when one cannot be shown.
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.display import display
from torch import nn

from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.estimates import memory_table
from jupyter_metainit.jupyter.cell_models import summary_line
from jupyter_metainit.jupyter.widget import explore

__all__ = ["memory_table_usage", "show_model"]


def memory_table_usage(module: nn.Module, depth: int | None, dtype: str | None) -> Any:
    """``memory_table(module, depth=, dtype=)``; an unknown ``dtype`` is a one-line UsageError."""
    kwargs: dict[str, Any] = {}
    if depth is not None:
        kwargs["depth"] = depth
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        return memory_table(module, **kwargs)
    except ArgumentError as exc:  # the core's dtype parser names the argument first
        if dtype is not None and str(exc).startswith("dtype="):
            raise UsageError(f"--dtype: {str(exc).splitlines()[0]}") from None
        raise


def show_model(name: str, module: nn.Module, *, table: bool, depth: int | None) -> None:
    """Print the summary line, then display the tree widget, else (or with ``table``) the table.

    The cell itself has run fine by now, so a failure to display is reported in one line on
    stderr (and the next view is tried) instead of failing the cell.
    """
    views = [_summary] if table else [_summary, _widget]
    views.append(_table)
    for view in views:
        try:
            shown = view(name, module, depth)
        except Exception as exc:
            message = (str(exc).splitlines() or [""])[0][:120]
            print(
                f"jupyter_metainit: could not show {name} as a {view.__name__.strip('_')} "
                f"({type(exc).__name__}: {message})",
                file=sys.stderr,
            )
            continue
        if shown is not None:
            display(shown)
            return


def _summary(name: str, module: nn.Module, depth: int | None) -> None:
    print(summary_line(name, module))


def _widget(name: str, module: nn.Module, depth: int | None) -> Any:
    return explore(module, name=name) if depth is None else explore(module, depth=depth, name=name)


def _table(name: str, module: nn.Module, depth: int | None) -> Any:
    return memory_table_usage(module, depth, None)
