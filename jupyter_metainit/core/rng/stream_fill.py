"""Exact fills of a run of one stream's ops, cut across cores as if they were one long fill.

``split_fill`` cuts one large ``normal_``/``uniform_`` at its stream offsets, at the price of a
jump-ahead per chunk; a model's many mid-sized fills (a decoder layer's projections) are each
too small for that to pay. But consecutive fills of one generator are one sequence of draws:
laid end to end (with the draws of any ops between them skipped), that sequence can be cut into
one equal part per core wherever a fill may be cut (a multiple of the kernel's block, leaving at
least 16 elements on each side: ``split_fill.cut_point``). Each part's thread jumps once, to
where its first piece starts, then fills its pieces in order, the generator running on from one
fill into the next, as the single stream does. Saving a model goes through this
(the core's ``values_to_write`` of a batch of tensors): one jump per core per batch instead of
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
from jupyter_metainit.core.rng.split_fill import STEP_ELEMENTS, cut_point, steps
from jupyter_metainit.core.runtime.interrupts import Meter, current_meter
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


# Pieces are filled this many elements at most at a time: between two, the progress is counted
# (and a Cancel or Ctrl-C stops the fill), and ``on_piece`` lets the caller (``save``'s writer)
# start on the first ones while the rest are being generated.
REPORT_ELEMENTS = STEP_ELEMENTS


def _run_part(
    fills: list[StreamFill],
    pieces: list[Piece],
    start_state: torch.Tensor,
    on_piece: Callable[[int, int, int], None] | None,
    meter: Meter,
) -> torch.Generator:
    """Fill ``pieces`` in order from their stream position, in steps counted by ``meter``
    (which stops it when the work is stopped); returns the generator after them."""
    gen = torch.Generator()
    i, a, _ = pieces[0]
    gen.set_state(advance_state(start_state, fills[i].start + a * fills[i].per))
    at = None  # draws after the run's start where ``gen`` stands, when known without a jump
    for i, a, b in pieces:
        f = fills[i]
        if at is not None and f.start > at:  # the draws of ops between two fills
            gen.set_state(advance_state(gen.get_state(), f.start - at))
        for x, y in steps(f.target.numel(), a, b, f.align, REPORT_ELEMENTS):
            meter.step()
            with plain():
                f.fill(f.target[x:y], gen)
            if on_piece is not None:
                on_piece(i, x, y)
            meter.step((y - x) * f.target.element_size())
        at = f.start + f.draws if b == f.target.numel() else None
    return gen


def fill_stream(
    fills: list[StreamFill],
    start_state: torch.Tensor,
    workers: int,
    on_piece: Callable[[int, int, int], None] | None = None,
) -> torch.Tensor:
    """Run ``fills`` (in stream order, from the generator state ``start_state``) on up to
    ``workers`` threads, with the values the single stream gives; returns the generator state
    after the last fill. ``on_piece(i, a, b)``, called from those threads, says that elements
    ``[a, b)`` of fill ``i`` are final (a few million at a time). Each step is counted into
    the caller's progress (``interrupts.current_meter``); a Cancel or Ctrl-C stops every thread
    at its next step and is raised here. The caller checks each (op, dtype) with
    ``split_is_exact`` first."""
    parts = _parts(fills, max(1, workers))
    meter = current_meter()

    def run(p: list[Piece]) -> torch.Generator:
        return _run_part(fills, p, start_state, on_piece, meter)

    if len(parts) > 1 and not on_core_pool():
        gens = meter.wait([core_pool(len(parts)).submit(run, p) for p in parts])
    else:
        gens = [run(p) for p in parts]
    return gens[-1].get_state()
