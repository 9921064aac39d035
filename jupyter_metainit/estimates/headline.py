"""The one-line summary of a memory table: parameters, bytes per dtype, largest leaf, training.

Shared by :func:`~jupyter_metainit.estimates.summary` (which builds the table from a module)
and the table's own rendering (its caption and first printed line); it reads a finished table
only, so rendering never has to build one.
"""

from __future__ import annotations

import pandas as pd

from jupyter_metainit.core import format_bytes

__all__ = ["table_headline"]


def table_headline(table: pd.DataFrame, optimizer: str | float | None = "adamw") -> str:
    """The summary line of ``table``, which must hold the root row (``""``) and its columns;
    ``optimizer`` names the optimizer when the table does not say."""
    root = table.loc[""]
    attrs = table.attrs
    parts = [f"{attrs.get('model_type', root['type'])}: {int(root['params']):,} params"]
    if int(root["params_trainable"]) != int(root["params"]):
        parts[0] += f" ({int(root['params_trainable']):,} trainable)"
    by_dtype = attrs.get("bytes_by_dtype") or {}
    sizes = ", ".join(f"{format_bytes(b)} {d}" for d, b in by_dtype.items())
    parts.append(
        f"{format_bytes(root['total_bytes'])}"
        + (f" ({sizes})" if len(by_dtype) > 1 else f" {next(iter(by_dtype), '')}")
    )
    leaf = attrs.get("largest_leaf")
    if leaf is not None and leaf[2] > 0:
        parts.append(f"largest leaf {leaf[0] or '(root)'} ({leaf[1]}, {format_bytes(leaf[2])})")
    opt = attrs.get("optimizer", optimizer)
    opt_name = (
        "no optimizer"
        if opt is None
        else str(opt).replace("adamw", "AdamW").replace("adam", "Adam")
    )
    parts.append(
        f"training ({opt_name}): fp32 {format_bytes(root['train_fp32_bytes'])}, "
        f"mixed {format_bytes(root['train_mixed_bytes'])}"
    )
    if "flops" in table.columns and not pd.isna(root["flops"]):
        parts.append(f"forward {int(root['flops']):,} FLOPs")
    return " · ".join(parts)
