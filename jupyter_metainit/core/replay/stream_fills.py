"""A plan's fills of one random stream run as one long fill cut across cores (exact mode).

When a plan is a batch of whole tensors each made by one ``normal_``/``uniform_`` (a model's
weights, saved a batch at a time), the fills are consecutive ops of one generator's stream:
``rng.stream_fill`` cuts them into one equal part per core with a single jump-ahead per part,
instead of a jump per tensor and per chunk. :func:`run_stream_fills` picks those fills out of
the plan and runs them, in steps counted as the tensors they make (``steps.counting_ops``); the
other ops (``fill_(1.0)`` of a norm, ``zero_`` of a bias) replay as usual. Where the plan is
anything else it does nothing and the engine replays it op by op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.record.graph import OpRecord, TensorRecord
from jupyter_metainit.core.replay.random_modes import call_with_generator
from jupyter_metainit.core.replay.steps import counting_ops
from jupyter_metainit.core.rng.draws import draws_per_element, known_draws
from jupyter_metainit.core.rng.positions import state_before
from jupyter_metainit.core.rng.split_fill import (
    ALIGN,
    FILLS,
    fill_seconds,
    split_is_exact,
    worth_cutting,
)
from jupyter_metainit.core.rng.stream_fill import StreamFill, fill_stream
from jupyter_metainit.core.runtime.interrupts import check
from jupyter_metainit.core.runtime.plain import map_args

__all__ = ["MIN_STREAM_ELEMENTS", "Filled", "run_stream_fills"]

# Below this many elements in all, one thread (with ``split_fill`` for a large fill) is as fast:
# a jump-ahead per extra thread costs a few milliseconds, about a million elements' fill.
MIN_STREAM_ELEMENTS = 1 << 23


def _whole_fill(op: OpRecord, touched: dict[int, int]) -> TensorRecord | None:
    """The record ``op`` fills, when it is a CPU ``normal_``/``uniform_`` with a known draw
    count over a whole contiguous storage that no other op of the plan touches."""
    if op.rng is None or op.func not in FILLS or not op.args:
        return None
    target = op.args[0]
    seg = op.rng.segment
    if not isinstance(target, TensorRecord) or seg.device.type != "cpu":
        return None
    if draws_per_element(target.dtype) is None or touched.get(id(target.storage)) != 1:
        return None
    n = 1
    for s in target.size:
        n *= s
    contiguous = target.stride == tuple(_contiguous_strides(target.size))
    if target.offset or not contiguous or n * target.dtype.itemsize != target.storage.nbytes:
        return None
    if known_draws(seg.specs[op.rng.index], seg.device) is None:
        return None
    return target


def _contiguous_strides(size: tuple) -> list[int]:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= max(s, 1)
    return strides[::-1]


def _touches(ops: list[OpRecord]) -> dict[int, int]:
    """Storage id -> how many of ``ops`` read, write or create it."""
    count: dict[int, int] = {}
    for op in ops:
        ids = {id(s) for s in op.reads} | {id(s) for s in op.mutates}
        ids |= {id(r.storage) for r in op.outputs if r is not None}
        for sid in ids:
            count[sid] = count.get(sid, 0) + 1
    return count


Filled = Callable[[TensorRecord, int, int, torch.Tensor], None]


def run_stream_fills(
    run: Any, ops: list[OpRecord], workers: int, on_filled: Filled | None = None
) -> set[int]:
    """Run the fills of ``ops`` (a plan's, exact mode, on the CPU) as one stream cut across
    ``workers`` threads, when they are all the plan's random ops, of one stream, and worth it.
    Returns the indices of the ops it ran (empty: nothing done). ``on_filled(record, a, b,
    flat)``, called from those threads: elements ``[a, b)`` of ``flat`` (the whole storage of
    the fill's ``record``) are final."""
    touched = _touches(ops)
    picked: list[tuple[int, OpRecord, TensorRecord]] = []
    for i, op in enumerate(ops):
        if op.rng is None:
            continue
        target = _whole_fill(op, touched)
        if target is None:
            return set()
        picked.append((i, op, target))
    if workers < 2 or not picked or len({id(op.rng.segment) for _, op, _ in picked}) != 1:
        return set()
    if sum(r.storage.nbytes // r.dtype.itemsize for *_, r in picked) < MIN_STREAM_ELEMENTS:
        return set()
    picked.sort(key=lambda item: item[1].rng.index)
    seg = picked[0][1].rng.segment
    cpu = torch.device("cpu")
    fills, offset, index = [], 0, picked[0][1].rng.index
    for _, op, target in picked:
        for k in range(index, op.rng.index):  # ops of the stream between two fills: skipped
            draws = known_draws(seg.specs[k], seg.device)
            if draws is None:
                return set()
            offset += draws
        args, kwargs = map_args(lambda x: run.arg(x, cpu), op.args, op.kwargs)
        fill = _filler(op, args[1:], kwargs)
        if not split_is_exact(op.func, target.dtype, fill):
            return set()
        draws = known_draws(seg.specs[op.rng.index], seg.device)
        per = draws_per_element(target.dtype)
        fills.append(StreamFill(args[0].view(-1), fill, offset, draws, per, ALIGN[op.func]))
        offset += draws
        index = op.rng.index + 1
    start = state_before(seg, picked[0][1].rng.index, run.burn_progress)
    run.phase("generating random values")
    on_piece = None
    if on_filled is not None:
        targets = [target for *_, target in picked]

        def on_piece(i: int, a: int, b: int) -> None:
            on_filled(targets[i], a, b, fills[i].target)

    with counting_ops(run, [i for i, *_ in picked], sum(f.target.nbytes for f in fills)):
        seconds = sum(fill_seconds(op.func, t.dtype, t.storage.nbytes // t.dtype.itemsize)
                      for _, op, t in picked)  # fmt: skip
        end = fill_stream(fills, start, worth_cutting(seconds, workers), on_piece)
    check()  # a Ctrl-C held back in the last step; nothing is kept
    seg.add_checkpoint(index, end)
    for i, *_ in picked:
        run.finished(i)
    return {i for i, *_ in picked}


def _filler(op: OpRecord, rest: tuple, kwargs: dict) -> Any:
    def fill(t: torch.Tensor, g: torch.Generator) -> Any:
        return call_with_generator(op, (t, *rest), kwargs, g)

    return fill
