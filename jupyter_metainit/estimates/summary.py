"""One-line summary of a model: parameters, bytes per dtype, largest leaf, training estimate."""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from jupyter_metainit.core.runtime.format import format_bytes
from jupyter_metainit.estimates._arguments import require_module
from jupyter_metainit.estimates.memory import memory_table

__all__ = ["summary"]


def summary(
    module_or_table: nn.Module | pd.DataFrame,
    *,
    dtype: torch.dtype | str | None = None,
    optimizer: str | float | None = "adam",
) -> str:
    """Return a one-line summary like the figures ``accelerate estimate-memory`` prints.

    When to use: a quick answer to "how big is this model and what would training need",
    for any model object (deferred, partially materialized or real), not only hub names.
    Accepts a module or a table from :func:`memory_table` (the table's ``dtype``/``optimizer``
    then apply). Training figures are the ``train_fp32_bytes``/``train_mixed_bytes`` of the
    root (see :func:`memory_table` for the formulas).
    """
    if isinstance(module_or_table, pd.DataFrame) and "" in module_or_table.index:
        table = module_or_table
    else:
        module = require_module(module_or_table, "summary", also=" or a table from memory_table")
        table = memory_table(module, depth=0, dtype=dtype, optimizer=optimizer)
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
