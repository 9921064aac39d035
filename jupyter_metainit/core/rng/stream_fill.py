"""Exact fills of a run of one stream's ops, cut across cores as if they were one long fill.

``split_fill`` cuts one large ``normal_``/``uniform_`` at its stream offsets, at the price of a
jump-ahead per chunk; a model's many mid-sized fills (a decoder layer's projections) are each
too small for that to pay. But consecutive fills of one generator are one sequence of draws:
laid end to end (with the draws of any ops between them skipped), that sequence can be cut into
one equal part per core wherever a fill may be cut (a multiple of the kernel's block, leaving at
least 16 elements on each side: ``split_fill.cut_point``). Each part's thread jumps once, to
where its first piece starts, then fills its pieces in order, the generator running on from one
fill into the next, as the single stream does. Saving a model goes through this
(``replay.reads.values_to_write`` of a batch of tensors): one jump per core per batch instead of
one per tensor and chunk, and every core busy whatever the tensors' sizes. The cut rests on the
same facts as ``split_fill``, checked once per op and dtype in each process
(``split_fill.split_is_exact``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from jupyter_metainit.core.rng.positions import advance_state
from jupyter_metainit.core.rng.split_fill import cut_point
from jupyter_metainit.core.runtime.interrupts import interrupted
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.pool import core_pool, on_core_pool

__all__ = ["StreamFill", "fill_stream"]


@dataclass
class StreamFill:
    """One fill of the run: ``fill(target_part, generator)`` on the flat contiguous
    ``target``, starting ``start`` draws after the run's start and consuming ``draws`` in all;
    ``per`` draws per element and ``align`` the kernel's block (``split_fill``'s tables)."""

    target: torch.Tensor
    fill: Callable[[torch.Tensor, torch.Generator], Any]
    start: int
    draws: int
    per: int
    align: int


Piece = tuple[int, int, int]  # (fill number, first element, end element)


def _cut_point(f: StreamFill, e: int) -> int:
    """Where fill ``f`` may be cut near element ``e`` (``split_fill.cut_point``)."""
    return cut_point(f.target.numel(), e, f.align)


def _parts(fills: list[StreamFill], workers: int) -> list[list[Piece]]:
    """The fills' elements in up to ``workers`` runs of about equal size, each a list of
    pieces: the cuts at equal shares of all elements, moved to where a fill may be cut."""
    starts = [0]
    for f in fills:
        starts.append(starts[-1] + f.target.numel())
    total = starts[-1]
    cuts = {0, total}
    i = 0
    for k in range(1, workers):
        at = total * k // workers
        while starts[i + 1] <= at:
            i += 1
        cuts.add(starts[i] + _cut_point(fills[i], at - starts[i]))
    bounds = sorted(cuts)
    parts: list[list[Piece]] = []
    for lo, hi in itertools.pairwise(bounds):
        pieces = []
        for i in range(len(fills)):
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a < b:
                pieces.append((i, a - starts[i], b - starts[i]))
        parts.append(pieces)
    return parts


# With ``on_piece``, pieces are filled (and reported) this many elements at most at a time: the
# caller (``save``'s writer) starts on the first ones while the rest are being generated.
REPORT_ELEMENTS = 1 << 23


def _steps(f: StreamFill, a: int, b: int, step: int) -> list[tuple[int, int]]:
    """``[a, b)`` of fill ``f`` in consecutive steps of about ``step`` elements, each ending
    where the fill may be cut (the same generator runs on through them)."""
    out = []
    while a < b:
        stop = b if b - a <= step else max(a, min(b, _cut_point(f, a + step)))
        if stop <= a or b - stop < 16:
            stop = b
        out.append((a, stop))
        a = stop
    return out


def _run_part(
    fills: list[StreamFill], pieces: list[Piece], start_state: torch.Tensor,
    on_piece: Callable[[int, int, int], None] | None,
) -> torch.Generator:  # fmt: skip
    """Fill ``pieces`` in order from their stream position; returns the generator after them."""
    gen = torch.Generator()
    i, a, _ = pieces[0]
    gen.set_state(advance_state(start_state, fills[i].start + a * fills[i].per))
    at = None  # draws after the run's start where ``gen`` stands, when known without a jump
    step = REPORT_ELEMENTS if on_piece is not None else None
    for i, a, b in pieces:
        f = fills[i]
        if at is not None and f.start > at:  # the draws of ops between two fills
            gen.set_state(advance_state(gen.get_state(), f.start - at))
        for x, y in _steps(f, a, b, step) if step else [(a, b)]:
            if interrupted():
                return gen
            with plain():
                f.fill(f.target[x:y], gen)
            if on_piece is not None:
                on_piece(i, x, y)
        at = f.start + f.draws if b == f.target.numel() else None
    return gen


def fill_stream(
    fills: list[StreamFill], start_state: torch.Tensor, workers: int,
    on_piece: Callable[[int, int, int], None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Run ``fills`` (in stream order, from the generator state ``start_state``) on up to
    ``workers`` threads, with the values the single stream gives; returns the generator state
    after the last fill. ``on_piece(i, a, b)``, called from those threads, says that elements
    ``[a, b)`` of fill ``i`` are final (a few million at a time). The caller checks each (op,
    dtype) with ``split_is_exact`` first."""
    parts = _parts(fills, max(1, workers))

    def run(p: list[Piece]) -> torch.Generator:
        return _run_part(fills, p, start_state, on_piece)

    if len(parts) > 1 and not on_core_pool():
        gens = list(core_pool(len(parts)).map(run, parts))
    else:
        gens = [run(p) for p in parts]
    return gens[-1].get_state()
