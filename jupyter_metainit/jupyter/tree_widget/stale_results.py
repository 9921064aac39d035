"""Which tensors a Values or Compare result is about, and results whose tensors changed since
they were measured: dropped.

A result describes the tensors as they were when it was measured. Once one of them is
materialized (``rng="fast"`` gives other values), freed, replaced or edited in place, the
columns, colours and charts would go on showing the old figures with nothing to say so. The
widget keeps a print of what each result measured (each tensor's identity, and for a real one
its device and version counter, which every in-place op bumps) and, after each cell and each
change the core publishes, drops a result whose print no longer holds, saying why.

A write that bypasses the version counter (``tensor.data.add_(1)``) is not seen.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core import is_deferred, local_tensor

__all__ = ["drop_stale_results", "remember_measured", "scoped_state", "under"]

# The widget's traits holding results, and how the notice names each.
_RESULTS = {"values": "Values", "comparison": "Compare"}


def under(name: str, scope: list[str]) -> bool:
    """Whether tensor or module ``name`` lies inside one of the subtrees ``scope``."""
    return any(name.startswith(s + ".") for s in scope)


def scoped_state(module: torch.nn.Module, scope: list[str]) -> dict[str, torch.Tensor]:
    """The tensors a Values or Compare of ``scope`` (ticked subtrees; none: the whole model)
    is about, by ``state_dict`` name: the tensors themselves (no detach recorded per tensor)."""
    state = module.state_dict(keep_vars=True)
    return {k: v for k, v in state.items() if under(k, scope)} if scope else dict(state)


def _print(module: torch.nn.Module, scope: list[str]) -> tuple:
    out = []
    for name, t in scoped_state(module, scope).items():
        local = local_tensor(t)
        if is_deferred(local):
            out.append((name, id(t), "deferred"))
        else:
            out.append((name, id(t), str(local.device), local._version))
    return tuple(out)


def remember_measured(widget: Any, trait: str, scope: list[str]) -> None:
    """After ``trait`` (``"values"`` or ``"comparison"``) was set: what it measured."""
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
