"""One tensor's statistics in float64, a chunk at a time, merged in a fixed order.

A chunk (:data:`CHUNK_ELEMENTS` values, small enough to stay in the shared cache) is copied into
a float64 buffer once; its sum and sum of squares come from that copy. The squared deviations
from the mean (``m2``, for the standard deviation) come from ``sumsq - sum**2 / n`` only where
that cannot cancel (the mean small against the spread, as in a weight matrix); elsewhere (a norm
weight of ones, an offset buffer) a second pass over the copy subtracts the mean first. Chunks
are merged pairwise with Chan's formulas, always in the tensor's order, so the result does not
depend on which thread finished first. Minimum, maximum and the counts are exact: the minimum
and maximum are read in the tensor's own dtype (every float8/16/32 value is a float64), zeros
are counted on the bit patterns (``+0.0`` and ``-0.0``) where the extremes allow any, NaN and
infinities are counted only where a chunk's sum says there are any.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "Moments",
    "bit_patterns",
    "chunk_histogram",
    "chunk_moments",
    "finite_range",
    "merge_all",
    "scratch",
]

# 2 MiB of float64: a chunk's copy stays in the shared cache for the passes over it (the
# passes are bound by their arithmetic, not by memory), and each chunk's few Python calls
# (about 30 us) cost 0.1 ns an element, half of what 1 MiB chunks cost.
CHUNK_ELEMENTS = 1 << 18

# Below this ratio of ``m2`` to the sum of squares, ``sumsq - sum**2 / n`` could lose more
# than a few digits: the chunk is measured again around its mean.
_ONE_PASS_RATIO = 1 / 16

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The smallest signed pattern of each width: the sign bit alone, -0.0 in every float format.
_SIGN_ONLY = {size: -(1 << (8 * size - 1)) for size in _SIGNED}


@dataclass
class Moments:
    """Statistics of ``n`` values: enough to merge with another part's and to report.

    ``lo``/``hi`` ignore NaN (NaN only when every value is NaN); ``mean``, ``m2`` and ``sumsq``
    take every value, so a NaN or an infinity shows in them as in torch.
    """

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations from the mean
    sumsq: float = 0.0  # sum of squares (the L2 norm squared)
    lo: float = math.inf
    hi: float = -math.inf
    zeros: int = 0
    nan: int = 0
    inf: int = 0

    def merged(self, other: Moments) -> Moments:
        """The statistics of both parts together (Chan et al.'s pairwise update)."""
        if not self.n or not other.n:
            return other if not self.n else self
        n = self.n + other.n
        if math.isfinite(self.mean) and math.isfinite(other.mean):
            delta = other.mean - self.mean
            mean = self.mean + delta * (other.n / n)
            m2 = self.m2 + other.m2 + delta * delta * (self.n * other.n / n)
        else:  # an infinity or NaN: what torch's sum gives, and no spread
            mean = (self.mean * self.n + other.mean * other.n) / n
            m2 = math.nan
        return Moments(
            n,
            mean,
            m2,
            self.sumsq + other.sumsq,
            _nan_min(self.lo, other.lo),
            _nan_max(self.hi, other.hi),
            self.zeros + other.zeros,
            self.nan + other.nan,
            self.inf + other.inf,
        )

    @property
    def std(self) -> float:
        """Population standard deviation (divided by ``n``)."""
        return math.sqrt(self.m2 / self.n) if self.n and self.m2 >= 0 else math.nan

    @property
    def absmax(self) -> float:
        return max(abs(self.lo), abs(self.hi)) if self.n else math.nan


def merge_all(parts: Sequence[Moments]) -> Moments:
    """Merge in order, pairwise (a balanced tree: rounding grows with log of the parts)."""
    if not parts:
        return Moments()
    level = list(parts)
    while len(level) > 1:
        level = [
            level[i].merged(level[i + 1]) if i + 1 < len(level) else level[i]
            for i in range(0, len(level), 2)
        ]
    return level[0]


def _nan_min(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def _nan_max(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


class _Scratch(threading.local):
    """Per-thread buffers: a chunk's float64 copies."""

    def __init__(self) -> None:
        self.f64 = [torch.empty(CHUNK_ELEMENTS, dtype=torch.float64) for _ in range(3)]


scratch = _Scratch()


def _as_float64(flat: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``flat``'s values as float64: itself if it is already, else copied into ``buffer``."""
    if flat.dtype == torch.float64:
        return flat
    out = buffer[: flat.numel()]
    out.copy_(flat)
    return out


def bit_patterns(flat: torch.Tensor) -> torch.Tensor:
    """The values' bit patterns as signed integers of the same width (no copy)."""
    return flat.view(_SIGNED[flat.element_size()])


def _bits(flat: torch.Tensor) -> np.ndarray:
    return bit_patterns(flat).numpy()


def _zeros(flat: torch.Tensor, lo: float, hi: float) -> int:
    """Exact count of zeros, for floating values +0.0 and -0.0, in the chunk whose (min, max)
    are ``lo``, ``hi``: none outside them, else counted on the bit patterns: all-zero bits
    (+0.0, or an integer 0), and where the smallest signed pattern is the sign bit alone, -0.0
    (one cheap pass each instead of a shift that drops the sign bit)."""
    if lo > 0 or hi < 0:
        return 0
    bits = _bits(flat)
    zeros = flat.numel() - int(np.count_nonzero(bits))
    if flat.is_floating_point():
        sign_only = _SIGN_ONLY[flat.element_size()]
        if int(bits.min()) == sign_only:
            zeros += int(np.count_nonzero(bits == sign_only))
    return zeros


def _range(flat: torch.Tensor) -> tuple[float, float]:
    """(min, max) exactly, NaN ignored (NaN, NaN when all are NaN): the rare path of a chunk
    holding NaN or an infinity."""
    if flat.is_floating_point():
        flat = flat[~torch.isnan(flat)]
        if not flat.numel():
            return math.nan, math.nan
    return _min_max(flat, flat.to(torch.float64))


def _min_max(flat: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of a chunk with no NaN: in its own dtype where torch can (exact, and
    cheaper than on the float64 copy), else on the copy (also exact)."""
    if flat.dtype == torch.bool:
        return float(flat.all()), float(flat.any())
    try:
        lo, hi = torch.aminmax(flat)
    except (RuntimeError, NotImplementedError):  # no kernel for this dtype (float8, uint64)
        lo, hi = torch.aminmax(x)
    return float(lo), float(hi)


def chunk_moments(flat: torch.Tensor) -> Moments:
    """The statistics of a 1-D CPU chunk of at most :data:`CHUNK_ELEMENTS` values (one thread,
    no allocation on the usual path: one float64 copy, its sum and sum of squares, the extremes
    in the chunk's dtype, the zeros counted on the bit patterns)."""
    n = flat.numel()
    if not n:
        return Moments()
    x = _as_float64(flat, scratch.f64[0])
    total = float(x.sum())
    sumsq = float(torch.dot(x, x))
    mean = total / n
    if not math.isfinite(total):  # a NaN or an infinity in the chunk (else the sum is finite)
        nan = int(torch.isnan(flat).sum()) if flat.is_floating_point() else 0
        inf = int(torch.isinf(flat).sum()) if flat.is_floating_point() else 0
        lo, hi = _range(flat)
        return Moments(n, mean, math.nan, sumsq, lo, hi, _zeros(flat, lo, hi), nan, inf)
    m2 = sumsq - total * mean
    if not m2 >= sumsq * _ONE_PASS_RATIO:  # could have cancelled: around the mean
        centred = torch.sub(x, mean, out=scratch.f64[1][:n])
        m2 = float(torch.dot(centred, centred))
    lo, hi = _min_max(flat, x)
    return Moments(n, mean, m2, sumsq, lo, hi, _zeros(flat, lo, hi))


def chunk_histogram(flat: torch.Tensor, bins: int, lo: float, hi: float) -> np.ndarray:
    """Counts of a chunk's values in ``bins`` equal bins over ``[lo, hi]`` (NaN, infinities and
    values outside left out; ``hi`` in the last bin; all in the first when ``lo == hi``)."""
    x = _as_float64(flat, scratch.f64[0])
    if lo == hi:
        counts = np.zeros(bins, dtype=np.int64)
        counts[0] = int((x == lo).sum())
        return counts
    return torch.histc(x, bins, lo, hi).numpy().astype(np.int64)


def finite_range(flat: torch.Tensor) -> tuple[float, float]:
    """(min, max) of the finite values of a chunk (inf, -inf when it has none)."""
    if flat.is_floating_point():
        flat = flat[torch.isfinite(flat)]
        if not flat.numel():
            return math.inf, -math.inf
    return _min_max(flat, flat.to(torch.float64))
