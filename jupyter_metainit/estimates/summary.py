"""One-line summary of a model: parameters, bytes per dtype, largest leaf, training estimate."""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from jupyter_metainit.estimates._arguments import require_module
from jupyter_metainit.estimates.headline import table_headline
from jupyter_metainit.estimates.memory import memory_table

__all__ = ["summary"]


def summary(
    module_or_table: nn.Module | pd.DataFrame,
    *,
    dtype: torch.dtype | str | None = None,
    optimizer: str | float | None = "adamw",
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
    return table_headline(table, optimizer)
