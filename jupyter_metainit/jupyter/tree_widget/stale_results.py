"""Values and Compare results about tensors that changed since they were measured: dropped.

A result describes the tensors as they were when it was measured. Once one of them is
materialized (``rng="fast"`` gives other values), freed, replaced or edited in place, the
columns, colours and charts would go on showing the old figures with nothing to say so. The
widget keeps a print of what each result measured (each tensor's identity, and for a real one
its device and version counter, which every in-place op bumps) and, after each cell and each
change the core publishes, drops a result whose print no longer holds, saying why.

A write that bypasses the version counter (``tensor.data.add_(1)``) is not seen.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from jupyter_metainit.core import is_deferred, local_tensor

__all__ = ["drop_stale_results", "remember_measured"]

# The widget's traits holding results, and how the notice names each.
_RESULTS = {"values": "Values", "comparison": "Compare"}


def _print(module: torch.nn.Module, scope: Iterable[str]) -> tuple:
    prefixes = tuple(s + "." for s in scope if s)
    out = []
    for name, t in module.state_dict(keep_vars=True).items():
        if prefixes and not name.startswith(prefixes):
            continue
        local = local_tensor(t)
        if is_deferred(local):
            out.append((name, id(t), "deferred"))
        else:
            out.append((name, id(t), str(local.device), local._version))
    return tuple(out)


def remember_measured(widget: Any, trait: str, scope: Iterable[str]) -> None:
    """After ``trait`` (``"values"`` or ``"comparison"``) was set: what it measured."""
    scope = list(scope)
    widget._measured[trait] = (scope, _print(widget.module, scope))


def drop_stale_results(widget: Any) -> str:
    """Clear each result whose tensors changed since; the notice to show, or ``""``."""
    dropped = []
    for trait, (scope, measured) in list(widget._measured.items()):
        if _print(widget.module, scope) == measured:
            continue
        del widget._measured[trait]
        setattr(widget, trait, {"id": int(getattr(widget, trait).get("id", 0)) + 1})
        dropped.append(_RESULTS[trait])
    if not dropped:
        return ""
    return (
        f"{' and '.join(dropped)} cleared: the model's tensors changed since they were measured "
        "(materialized, freed or edited). Measure again to see the new values."
    )
