"""``compare``: which tensors of two models (or checkpoints) differ, and by how much."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from jupyter_metainit.core import dtype_name
from jupyter_metainit.inspection.compared_sides import Layout, check_modules, file_layout, under
from jupyter_metainit.inspection.moments import bit_patterns, scratch
from jupyter_metainit.inspection.pipeline import Chunks, Progress, batches, run_batches
from jupyter_metainit.inspection.sources import Entry, Source, open_source
from jupyter_metainit.inspection.statistics import flat_values

__all__ = ["compare"]


@dataclass
class PairSums:
    """Sums over the elements of a pair of tensors, in float64; merged by adding."""

    equal: bool = True  # bitwise
    max_abs_diff: float = 0.0
    dd: float = 0.0  # sum of (a - b)**2
    aa: float = 0.0
    bb: float = 0.0
    ab: float = 0.0

    def merged(self, other: PairSums) -> PairSums:
        return PairSums(
            self.equal and other.equal,
            _nan_max(self.max_abs_diff, other.max_abs_diff),
            self.dd + other.dd,
            self.aa + other.aa,
            self.bb + other.bb,
            self.ab + other.ab,
        )


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and the same bits (``-0.0`` is not ``0.0``, a NaN equals the same NaN)."""
    return a.dtype == b.dtype and torch.equal(bit_patterns(a), bit_patterns(b))


def chunk_pair(a: torch.Tensor, b: torch.Tensor) -> PairSums:
    """The sums of one chunk of a pair (1-D CPU, equal lengths), in float64."""
    x = scratch.f64[0][: a.numel()]
    x.copy_(a)
    aa = float(torch.dot(x, x))
    if _bitwise_equal(a, b):
        return PairSums(True, 0.0, 0.0, aa, aa, aa)
    y = scratch.f64[1][: b.numel()]
    y.copy_(b)
    bb, ab = float(torch.dot(y, y)), float(torch.dot(x, y))
    d = torch.sub(x, y, out=scratch.f64[2][: a.numel()])
    lo, hi = torch.aminmax(d) if d.numel() else (torch.tensor(0.0), torch.tensor(0.0))
    return PairSums(False, max(-float(lo), float(hi)), float(torch.dot(d, d)), aa, bb, ab)


_COLUMNS = ["status", "equal", "max_abs_diff", "rel_l2", "cosine", "shape_a", "shape_b",
            "dtype_a", "dtype_b", "numel"]  # fmt: skip


def compare(
    a: torch.nn.Module | Mapping[str, torch.Tensor] | str | os.PathLike[str],
    b: torch.nn.Module | Mapping[str, torch.Tensor] | str | os.PathLike[str],
    *,
    modules: str | Sequence[str] | None = None,
    progress: bool | Callable[[int, int], None] | Callable[[int, int, str], None] | None = None,
) -> pd.DataFrame:
    """Compare two models, state dicts or checkpoints tensor by tensor, in bounded memory.

    Use it to see which layers fine-tuning moved and how far, whether a converted checkpoint is
    identical to its source, or whether a deferred model's init equals a saved one. Each side's
    tensors are read as :func:`~jupyter_metainit.stats` reads them (deferred ones computed as
    ``materialize`` would give them, checkpoint files read on demand), a batch of pairs at a
    time, measured on every core and freed: at most two batches of pairs alive (each up to the
    largest pair, or 64 MiB a side). Neither side is changed.

    Args:
        a: a module (deferred, opened from a checkpoint, partly or fully real), a dict of
            tensors, or a checkpoint path (a safetensors file, a sharded checkpoint's index or
            directory, a ``torch.distributed.checkpoint`` directory).
        b: the same kinds, compared with ``a``. A transformers model compared with a path is
            seen as ``save_pretrained`` writes it (the file's names and layout, where
            transformers renames or fuses weights in memory); a tied weight the file keeps once
            is compared under each of its names.
        modules: only the tensors of these subtrees of ``a`` (a qualified module name, as
            ``a.named_modules()`` gives it, or a list of them; ``None`` or ``""``: all), and
            the tensors of ``b`` that pair with them or lie under the same names. A
            transformers model against a path is still seen in the file's layout, its part
            of it: ``compare(model, path, modules="model.layers.0")``.
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)`` (or
            ``callable(done, total, phase)``); raising from it cancels.

    Returns:
        A pandas DataFrame indexed by tensor name (``a``'s names in order, then those only in
        ``b``): ``status`` (``"equal"``, ``"differ"``, ``"only in a"``, ``"only in b"``,
        ``"shape differs"``, ``"dtype differs"``), ``equal`` (bitwise: same dtype, same
        shape, same bits), ``max_abs_diff``, ``rel_l2`` (‖a-b‖ / ‖a‖), ``cosine`` (a·b /
        ‖a‖‖b‖), all computed in float64 (also across dtypes, for a conversion against its
        source; NaN where the shapes differ or one side is missing), and each side's shape and
        dtype.

    Raises:
        ArgumentError: a path that is no checkpoint, or a name in ``modules`` that is no
            submodule of ``a``.
        ArgumentTypeError: ``a`` or ``b`` is not a module, a dict of tensors or a path, or
            ``modules`` is not a name or a list of names.
        KeyboardInterrupt: Ctrl-C, or the exception a ``progress`` callable raised to cancel;
            nothing changed.

    Examples:
        Is a bfloat16 copy of a model (never allocated) its values, rounded?

        >>> import os, tempfile
        >>> from torch import nn
        >>> from jupyter_metainit import compare, meta_init, save
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     _ = save(model, directory, dtype="bf16")
        ...     diff = compare(model, directory)  # the model against the files
        >>> diff[["status", "dtype_a", "dtype_b"]]
                         status  dtype_a   dtype_b
        tensor
        0.weight  dtype differs  float32  bfloat16
        0.bias    dtype differs  float32  bfloat16
        2.weight  dtype differs  float32  bfloat16
        2.bias    dtype differs  float32  bfloat16
        >>> bool((diff["rel_l2"] < 2**-8).all())  # within bfloat16's rounding
        True

        Which layers did fine-tuning move, and how far:
        ``diff = compare("base/", "finetuned/")``, then
        ``diff[diff.status != "equal"].sort_values("rel_l2", ascending=False)``.
    """
    return compare_layouts(a, b, check_modules(a, modules), progress)[0]


def compare_layouts(
    a: Any, b: Any, scope: list[str], progress: Any, *, origins: bool = False
) -> tuple[pd.DataFrame, Layout]:
    """:func:`compare` of the subtrees ``scope`` of ``a`` (checked; ``[]``: all), and ``a``'s
    layout as read (with ``origins``: which model tensor each row comes from)."""
    side_a = file_layout(a, b, scope, origins=origins)
    side_b = file_layout(b, a, [])
    left = open_source(side_a.tensors, "compare(): a")
    right = open_source(side_b.tensors, "compare(): b")
    _tie_across(left, right)
    _tie_across(right, left)
    if scope:  # b's tensors that pair with a's, or lie in the same subtrees
        left.names = {n: e for n, e in left.names.items() if _kept(n, scope, a)}
        right.names = {n: e for n, e in right.names.items() if n in left.names or under(n, scope)}
    pairs = [
        (left.entries[left.names[n]], right.entries[right.names[n]])
        for n in left.names
        if n in right.names
    ]
    if left.names and right.names and not pairs:
        _say_no_common_name(left, right)
    pairs = [(x, y) for x, y in pairs if x.shape == y.shape]
    unique = list({(x.name, y.name): (x, y) for x, y in pairs}.values())
    bar = Progress(progress, sum(x.nbytes + y.nbytes for x, y in unique), "compare")
    try:
        sums = _measure_pairs(left, right, unique, bar)
    finally:
        bar.close()
    rows, index = [], []
    for name in [*left.names, *(n for n in right.names if n not in left.names)]:
        rows.append(_row(name, left, right, sums))
        index.append(name)
    named = {**side_b.renamed, **side_a.renamed}
    index = [named.get(n, n) for n in index]
    table = pd.DataFrame(rows, index=pd.Index(index, name="tensor"), columns=_COLUMNS)
    return table, side_a


def _say_no_common_name(left: Source, right: Source) -> None:
    """Warn that every row will be "only in a" or "only in b": the sides' names differ
    (often by a prefix: a base model against its task model's checkpoint)."""
    a, b = next(iter(left.names)), next(iter(right.names))
    warnings.warn(
        f"compare(): no tensor name is in both a and b (a's begin like {a!r}, b's like "
        f"{b!r}), so every row is 'only in a' or 'only in b'; compare the parts that match, "
        "e.g. a submodule, or a state dict with the names made the same",
        stacklevel=4,
    )


def _kept(name: str, scope: list[str], a: Any) -> bool:
    """A name of ``a`` in the subtrees asked about: a path's are filtered here (a module's
    and a dict's were left out before their conversion)."""
    return not isinstance(a, (str, os.PathLike)) or under(name, scope)


def _measure_pairs(
    left: Source, right: Source, pairs: list[tuple[Entry, Entry]], bar: Progress
) -> dict[tuple[str, str], PairSums]:
    def size(pair: tuple[Entry, Entry]) -> int:
        return pair[0].nbytes + pair[1].nbytes

    def read(batch: list[tuple[Entry, Entry]], memory: Any) -> list[tuple]:
        xs = left.read([x for x, _ in batch], memory)
        ys = right.read([y for _, y in batch], memory)
        return list(zip(xs, ys, strict=True))

    def measure(batch: list, values: list[tuple], chunks: Chunks) -> Any:
        flats = [[flat_values(x), flat_values(y)] for x, y in values]
        parts = chunks.map(lambda _j, x, y: chunk_pair(x, y), flats)
        if parts is None:
            return None
        out = []
        for p in parts:
            total = PairSums()
            for one in p:
                total = total.merged(one)
            out.append(total)
        return out

    groups = batches(pairs, size)
    results = run_batches(groups, read, measure, size, bar)
    out: dict[tuple[str, str], PairSums] = {}
    for batch, measured in zip(groups, results, strict=True):
        for (x, y), one in zip(batch, measured, strict=True):
            out[(x.name, y.name)] = one
    return out


def _tie_across(side: Source, other: Source) -> None:
    """A tied name ``side`` has that ``other`` lacks is read there as the tensor it is tied to:
    a checkpoint keeps a tied weight once (``lm_head.weight`` is ``embed_tokens``'), so the
    model's second name is the same values, not a tensor missing from the file."""
    for name, first in side.names.items():
        if name not in other.names and first != name and first in other.names:
            other.names[name] = other.names[first]


def _row(name: str, left: Source, right: Source, sums: dict) -> dict[str, Any]:
    x = left.entries[left.names[name]] if name in left.names else None
    y = right.entries[right.names[name]] if name in right.names else None
    row: dict[str, Any] = {
        "shape_a": x.shape if x else None,
        "shape_b": y.shape if y else None,
        "dtype_a": dtype_name(x.dtype) if x else None,
        "dtype_b": dtype_name(y.dtype) if y else None,
        "numel": _numel(x, y),
        "equal": False,
        "max_abs_diff": math.nan,
        "rel_l2": math.nan,
        "cosine": math.nan,
    }
    if x is None or y is None:
        row["status"] = "only in b" if x is None else "only in a"
        return row
    if x.shape != y.shape:
        row["status"] = "shape differs"
        return row
    s = sums[(x.name, y.name)]
    row["equal"] = s.equal and x.dtype == y.dtype
    row["status"] = "dtype differs" if x.dtype != y.dtype else "equal" if s.equal else "differ"
    row["max_abs_diff"] = s.max_abs_diff
    norm_a, norm_b = math.sqrt(s.aa), math.sqrt(s.bb)
    row["rel_l2"] = 0.0 if s.dd == 0 else math.sqrt(s.dd) / norm_a if norm_a else math.inf
    if s.dd == 0 and norm_a:  # the same values (perhaps in two dtypes): exactly 1
        row["cosine"] = 1.0
    else:
        row["cosine"] = s.ab / (norm_a * norm_b) if norm_a and norm_b else math.nan
    return row


def _numel(x: Entry | None, y: Entry | None) -> int | None:
    """The elements of the one side there is, or of both when their shapes agree."""
    if x is None or y is None:
        return (x or y).numel  # type: ignore[union-attr]
    return x.numel if x.shape == y.shape else None
