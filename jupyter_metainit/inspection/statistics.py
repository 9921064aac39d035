"""``stats``: what a model holds, per tensor or per module, without materializing it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch

from jupyter_metainit.core import dtype_name
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.inspection.moments import (
    Moments,
    chunk_histogram,
    chunk_moments,
    finite_range,
    merge_all,
)
from jupyter_metainit.inspection.pipeline import Chunks, Progress, batches, run_batches
from jupyter_metainit.inspection.sources import Entry, Source, open_source

__all__ = ["STAT_COLUMNS", "flat_values", "stat_tables", "stats"]

#: The statistics of every row, per tensor and per module.
STAT_COLUMNS = ("mean", "std", "min", "max", "absmax", "l2", "zeros", "nan", "inf")
_PER = ("tensor", "module")
_MAX_BINS = 1 << 16


def stats(
    obj: torch.nn.Module | Mapping[str, torch.Tensor] | str | os.PathLike[str],
    *,
    per: Literal["tensor", "module"] = "tensor",
    bins: int | None = None,
    depth: int | None = None,
    progress: bool | Callable[[int, int], None] | Callable[[int, int, str], None] | None = None,
) -> pd.DataFrame:
    """Statistics of every tensor's values (or every module's), exact, in bounded memory.

    Use it to look at what a model holds, also one that was never allocated: is the init's
    standard deviation what depth scaling says at layer 60, where are the outliers that will
    hurt int8 quantization, where do NaN or infinities come from. Deferred tensors give the
    values ``materialize`` would give (exact mode), computed a few at a time on every core and
    freed; a model opened with ``from_pretrained`` under ``meta_init`` is read from its files;
    real tensors are read as they are. The model is not changed (deferred tensors stay
    deferred, the global random generator is not touched). Memory: at most two batches of
    tensors (each up to the largest tensor, or 64 MiB) and a few MiB per core.

    Every statistic is accumulated in float64: ``min``, ``max``, ``absmax`` and the counts
    ``zeros`` (+0.0 and -0.0), ``nan``, ``inf`` are exact; ``mean``, ``std`` and ``l2`` (the
    Euclidean norm) agree with float64 torch on the whole tensor to about 1e-12 (per-chunk
    two-pass sums merged with Chan's formulas). ``std`` is the *population* standard deviation
    (divided by ``numel``, ``correction=0``). ``min``/``max``/``absmax`` leave NaN out;
    ``mean``/``std``/``l2`` take every value, so a NaN or an infinity shows in them as it
    would in torch. A complex tensor is measured over its real and imaginary parts.

    Args:
        obj: a module (its ``state_dict()``: deferred, partly materialized, real, or opened
            from a checkpoint), a dict of tensors, or a checkpoint path (a safetensors file, a
            sharded checkpoint's index or directory, a ``torch.distributed.checkpoint``
            directory).
        per: ``"tensor"``: one row per tensor, indexed by its ``state_dict`` name (a tied
            tensor once, under its first name; column ``tied`` lists the others).
            ``"module"``: one row per module holding tensors (``""`` is the whole model),
            over all the tensors under it, each tied tensor once: ``numel`` summed, ``l2`` the
            norm of them all, ``absmax`` the largest, ``mean``/``std`` of all their values.
        bins: with ``per="tensor"``, add a histogram per tensor: column ``histogram`` (``bins``
            counts, numpy int64) over column ``histogram_range`` (lo, hi): equal bins from the
            smallest to the largest finite value (NaN and infinities left out).
        depth: with ``per="module"``, only modules at most this deep (0: the whole model).
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)`` (or
            ``callable(done, total, phase)``); raising from it cancels (the exception
            propagates, nothing changed).

    Returns:
        A pandas DataFrame: columns ``numel, dtype, mean, std, min, max, absmax, l2, zeros,
        nan, inf`` (per tensor also ``shape`` and ``tied``; per module ``depth`` and
        ``tensors``).

    Raises:
        ArgumentError: an unknown ``per``, ``bins`` out of range or without ``per="tensor"``,
            ``depth`` negative or without ``per="module"``, a path that is no checkpoint.
        ArgumentTypeError: ``obj`` is not a module, a dict of tensors or a path.
        KeyboardInterrupt: Ctrl-C, or the exception a ``progress`` callable raised to cancel;
            nothing changed.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import is_deferred, meta_init, stats
        >>> _ = torch.manual_seed(0)
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> table = stats(model)  # the values materialize would give; nothing kept
        >>> table[["shape", "numel", "nan"]]
                       shape  numel  nan
        tensor
        0.weight  (256, 256)  65536    0
        0.bias        (256,)    256    0
        2.weight   (10, 256)   2560    0
        2.bias         (10,)     10    0
        >>> round(float(table.loc["0.weight", "std"]), 3)  # U(-1/16, 1/16): 1/16/sqrt(3)
        0.036
        >>> stats(model, per="module")[["numel", "tensors"]]
                numel  tensors
        module
                68362        4
        0       65792        2
        2        2570        2
        >>> is_deferred(model)
        True
    """
    if not isinstance(per, str):
        raise ArgumentTypeError(f"per= takes 'tensor' or 'module', not {per!r}")
    if per not in _PER:
        raise ArgumentError(f"per= takes 'tensor' or 'module', not {per!r}")
    _check_options(per, bins, depth)
    source = open_source(obj, "stats()")
    entries = list(source.entries.values())
    bar = Progress(progress, sum(e.nbytes for e in entries), "stats")
    try:
        measured = measure_all(source, entries, bins, bar)
    finally:
        bar.close()
    if per == "tensor":
        return _tensor_table(source, measured, bins is not None)
    return _module_table(source, measured, depth)


def _check_options(per: str, bins: Any, depth: Any) -> None:
    if bins is not None:
        if isinstance(bins, bool) or not isinstance(bins, int):
            raise ArgumentTypeError(
                f"bins= takes a whole number from 1 to {_MAX_BINS}, not {bins!r}"
            )
        if per != "tensor":
            raise ArgumentError("bins= gives a histogram per tensor: use it with per='tensor'")
        if not 1 <= bins <= _MAX_BINS:
            raise ArgumentError(f"bins= takes a whole number from 1 to {_MAX_BINS}, not {bins!r}")
    if depth is not None:
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise ArgumentTypeError(f"depth= takes a whole number, 0 or more, not {depth!r}")
        if per != "module":
            raise ArgumentError("depth= chooses module rows: use it with per='module'")
        if depth < 0:
            raise ArgumentError(f"depth= takes a whole number, 0 or more, not {depth!r}")


def flat_values(values: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's values as one real 1-D tensor (a complex one's real and imaginary
    parts side by side); no copy."""
    if values.is_complex():
        values = torch.view_as_real(values)
    return values.reshape(-1)


Measured = tuple[Moments, np.ndarray | None, tuple[float, float] | None]


def measure_all(
    source: Source, entries: list[Entry], bins: int | None, bar: Progress
) -> dict[str, Measured]:
    """Each entry's statistics (and histogram), read a batch at a time."""

    def read(batch: list[Entry], memory: Any) -> list[torch.Tensor]:
        return source.read(batch, memory)

    def measure(batch: list[Entry], values: list[torch.Tensor], chunks: Chunks) -> Any:
        flats = [[flat_values(v)] for v in values]
        parts = chunks.map(lambda _j, flat: chunk_moments(flat), flats)
        if parts is None:
            return None
        moments = [merge_all(p) for p in parts]
        if bins is None:
            return [(m, None, None) for m in moments]
        return _histograms(flats, moments, bins, chunks)

    groups = batches(entries, lambda e: e.nbytes)
    results = run_batches(groups, read, measure, lambda e: e.nbytes, bar)
    out: dict[str, Measured] = {}
    for batch, measured in zip(groups, results, strict=True):
        for entry, one in zip(batch, measured, strict=True):
            out[entry.name] = one
    return out


def _histograms(
    flats: list[list[torch.Tensor]], moments: list[Moments], bins: int, chunks: Chunks
) -> Any:
    """A second pass over a batch: each tensor's counts in ``bins`` bins over its finite
    range (known after the first pass; a third one finds it where NaN or inf are present)."""
    ranges = [(m.lo, m.hi) for m in moments]
    unclear = [j for j, m in enumerate(moments) if m.nan or m.inf]
    if unclear:
        found = chunks.map(
            lambda _j, flat: finite_range(flat), [flats[j] for j in unclear], count=False
        )
        if found is None:
            return None
        for j, parts in zip(unclear, found, strict=True):
            ranges[j] = (min(lo for lo, _ in parts), max(hi for _, hi in parts))

    def histogram(j: int, flat: torch.Tensor) -> np.ndarray:
        lo, hi = ranges[j]
        if not lo <= hi:  # no finite value
            return np.zeros(bins, dtype=np.int64)
        return chunk_histogram(flat, bins, lo, hi)

    counts = chunks.map(histogram, flats, count=False)
    if counts is None:
        return None
    out = []
    for m, parts, (lo, hi) in zip(moments, counts, ranges, strict=True):
        span = (lo, hi) if lo <= hi else (math.nan, math.nan)
        out.append((m, np.sum(parts, axis=0, dtype=np.int64), span))
    return out


def statistic_row(m: Moments) -> dict[str, Any]:
    """The statistics columns of one row."""
    return {
        "mean": m.mean if m.n else math.nan,
        "std": m.std,
        "min": m.lo if m.n else math.nan,
        "max": m.hi if m.n else math.nan,
        "absmax": m.absmax,
        "l2": math.sqrt(m.sumsq),
        "zeros": m.zeros,
        "nan": m.nan,
        "inf": m.inf,
    }


def _tensor_table(source: Source, measured: dict[str, Measured], hist: bool) -> pd.DataFrame:
    tied: dict[str, list[str]] = {}
    for name, first in source.names.items():
        if name != first:
            tied.setdefault(first, []).append(name)
    rows = []
    for name, entry in source.entries.items():
        moments, counts, span = measured[name]
        row = {"shape": entry.shape, "numel": entry.numel, "dtype": dtype_name(entry.dtype)}
        row.update(statistic_row(moments))
        row["tied"] = ", ".join(tied.get(name, []))
        if hist:
            row["histogram"], row["histogram_range"] = counts, span
        rows.append(row)
    columns = ["shape", "numel", "dtype", *STAT_COLUMNS, "tied"]
    columns += ["histogram", "histogram_range"] if hist else []
    return pd.DataFrame(rows, index=pd.Index(list(source.entries), name="tensor"), columns=columns)


def _module_table(source: Source, measured: dict[str, Measured], depth: int | None) -> pd.DataFrame:
    members: dict[str, dict[str, None]] = {}  # module -> its tensors' entries, each once
    for name, first in source.names.items():
        parts = name.split(".")
        for k in range(len(parts)):
            members.setdefault(".".join(parts[:k]), {})[first] = None
    rows, index = [], []
    for module, names in members.items():
        level = module.count(".") + 1 if module else 0
        if depth is not None and level > depth:
            continue
        dtypes = {source.entries[n].dtype for n in names}
        row = {
            "depth": level,
            "tensors": len(names),
            "numel": sum(source.entries[n].numel for n in names),
            "dtype": dtype_name(dtypes.pop()) if len(dtypes) == 1 else "mixed",
        }
        row.update(statistic_row(merge_all([measured[n][0] for n in names])))
        rows.append(row)
        index.append(module)
    columns = ["depth", "tensors", "numel", "dtype", *STAT_COLUMNS]
    return pd.DataFrame(rows, index=pd.Index(index, name="module"), columns=columns)


def stat_tables(
    obj: Any, *, bins: int | None = None, progress: Any = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``stats(obj, bins=bins)`` and ``stats(obj, per="module")`` from one reading of the
    values (half the time of two calls): for a view that shows both, as the widget's *Values*.

    Args:
        obj: as for :func:`stats`.
        bins: a histogram per tensor, as for :func:`stats`.
        progress: as for :func:`stats`.

    Returns:
        The per-tensor table and the per-module table.

    Example:
        >>> tensors, modules = stat_tables(model, bins=32)
    """
    _check_options("tensor", bins, None)
    source = open_source(obj, "stats()")
    entries = list(source.entries.values())
    bar = Progress(progress, sum(e.nbytes for e in entries), "stats")
    try:
        measured = measure_all(source, entries, bins, bar)
    finally:
        bar.close()
    return _tensor_table(source, measured, bins is not None), _module_table(source, measured, None)
