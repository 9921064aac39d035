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
    """A one-line summary of a model's size and training memory, like the figures
    ``accelerate estimate-memory`` prints.

    Use it for a quick answer to "how big is this model and what would training need", for
    any model object (deferred, partially materialized or real), not only hub names.

    Args:
        module_or_table: a module, or a table from :func:`memory_table` (the table's
            ``dtype`` and ``optimizer`` then apply).
        dtype: "what if" every floating-point tensor were this dtype (as in
            :func:`memory_table`).
        optimizer: the optimizer whose states the training figures count (as in
            :func:`memory_table`).

    Returns:
        One line: parameters, bytes per dtype, the largest leaf, and the root's
        ``train_fp32_bytes``/``train_mixed_bytes`` (see :func:`memory_table` for the formulas);
        after a :func:`dry_run`, the forward's FLOPs too.

    Raises:
        ArgumentTypeError: ``module_or_table`` is neither a module nor a table.
        ArgumentError: an unknown ``dtype`` or ``optimizer``.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import meta_init, summary
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
        >>> print(summary(model))
        Sequential: 8,393,728 params · 32.0 MiB float32 · largest leaf 0 (Linear, 16.0 MiB)
        · training (AdamW): fp32 128 MiB, mixed 160 MiB
    """
    if isinstance(module_or_table, pd.DataFrame) and "" in module_or_table.index:
        table = module_or_table
    else:
        module = require_module(module_or_table, "summary", also=" or a table from memory_table")
        table = memory_table(module, depth=0, dtype=dtype, optimizer=optimizer)
    return table_headline(table, optimizer)
