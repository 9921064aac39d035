"""Parallel scheduling: which ops of a plan may replay on threads of their own, and running them.

Groups of ops that touch disjoint storages are independent (:func:`components`). ``fast`` mode
runs any of them on any thread; ``exact`` mode cuts the plan into parts whose random ops are
contiguous runs of each stream (:func:`stream_parts`). :func:`run_parallel` runs groups on the
process's pool (``runtime.pool``), telling progress on the calling thread meanwhile and stopping
all of them within a step on a failure, Cancel or Ctrl-C.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from jupyter_metainit.core.record.graph import OpRecord
from jupyter_metainit.core.rng.draws import known_draws
from jupyter_metainit.core.runtime.interrupts import current_meter
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.pool import core_pool, on_core_pool

__all__ = ["SPLIT_STREAM_BYTES", "components", "run_parallel", "stream_parts"]


def _op_bytes(op: OpRecord) -> int:
    total = 0
    for rec in op.outputs:
        if rec is not None:
            total += rec.storage.nbytes
    if op.rng is not None and total == 0:
        total = op.rng.segment.specs[op.rng.index].nbytes
    return total


def components(ops: list[OpRecord]) -> list[list[tuple[int, OpRecord]]]:
    """Groups of ops that touch disjoint storages: each can replay on its own thread."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for op in ops:
        ids = [id(s) for s in op.reads] + [id(r.storage) for r in op.outputs if r is not None]
        ids += [id(s) for s in op.mutates]
        for other in ids[1:]:
            parent[find(other)] = find(ids[0])
    groups: dict[int, list[tuple[int, OpRecord]]] = {}
    for i, op in enumerate(ops):
        ids = [id(s) for s in op.reads] + [id(r.storage) for r in op.outputs if r is not None]
        ids += [id(s) for s in op.mutates]
        groups.setdefault(find(ids[0]), []).append((i, op))
    return list(groups.values())


# Exact mode splits a plan across threads only when its random work is worth a jump-ahead per
# thread (up to ~30 ms for a long one) many times over: ~4 ms per MiB of float32 normal_.
SPLIT_STREAM_BYTES = 64 << 20
# ... and when the parts come out even: the largest at most this much over an equal share.
_BALANCE = 1.05


def stream_parts(ops: list[OpRecord], workers: int) -> list[list[tuple[int, OpRecord]]] | None:
    """Exact mode on several cores: the plan cut into ``workers`` parts that each replay on a
    thread of their own, or None when it does not pay.

    A model's many small random fills are one sequential stream, too small each to split
    (``split_fill``). But groups of ops touching disjoint storages (each parameter and its
    initialisation) are independent, and recording order is stream order: cut at group
    boundaries into parts of equal bytes, each part's random ops are a contiguous run of the
    stream. Its thread jumps once to where the run starts (``streams.state_before``) and then draws
    on, so every value is the one the single stream gives. Parts are only made when every random
    op's draw count is known (the jump is exact), the parts' runs interleave at most a few
    times (each change of owner along a stream costs a thread a jump), and the parts are even
    (a plan of a few large fills, one decoder layer, is faster on one thread that splits each
    fill: ``split_fill``).
    """
    random_ops = [op for op in ops if op.rng is not None]
    if sum(_op_bytes(op) for op in random_ops) < SPLIT_STREAM_BYTES:
        return None
    for op in random_ops:
        seg = op.rng.segment
        if known_draws(seg.specs[op.rng.index], seg.device) is None:
            return None
    groups = components(ops)  # in the order of their first op
    if len(groups) < workers:
        return None
    costs = [sum(_op_bytes(op) for _, op in group) for group in groups]
    total = sum(costs)
    parts: list[list[tuple[int, OpRecord]]] = [[]]
    loads = [0]
    done = 0
    for group, cost in zip(groups, costs, strict=True):
        # A group goes to the next part when its middle is past this part's share.
        if parts[-1] and len(parts) < workers and done + cost / 2 > total * len(parts) / workers:
            parts.append([])
            loads.append(0)
        parts[-1].extend(group)
        loads[-1] += cost
        done += cost
    if len(parts) < 2 or max(loads) > _BALANCE * total / len(parts):
        return None  # a few large fills: split_fill divides each of them evenly instead
    owner: dict[int, list[tuple[int, int]]] = {}  # stream id -> (index, part) of its live ops
    for k, part in enumerate(parts):
        part.sort(key=lambda item: item[0])
        for _, op in part:
            if op.rng is not None:
                owner.setdefault(id(op.rng.segment), []).append((op.rng.index, k))
    changes = 0
    for runs in owner.values():
        runs.sort()
        changes += sum(1 for a, b in itertools.pairwise(runs) if a[1] != b[1])
    return parts if changes <= 2 * len(parts) else None


def run_parallel(
    run_op: Callable[[int, OpRecord], None], groups: list[list[tuple[int, OpRecord]]], workers: int
) -> None:
    """Replay independent groups on ``workers`` threads (``run_op(index, op)`` per op). The
    calling thread tells the replay's progress meanwhile (``interrupts.Steps``); any failure,
    Cancel or Ctrl-C stops them all within the step each is at (not after all remaining
    work)."""
    steps = current_meter().steps

    def replay_group(group: list[tuple[int, OpRecord]]) -> None:
        with plain(), torch.inference_mode(False):
            for i, op in group:
                steps.step()  # raises Stopped once the replay was stopped
                run_op(i, op)

    if on_core_pool():  # a replay inside a replay's thread: the pool's threads may all be busy
        for group in groups:
            replay_group(group)
        return
    pool = core_pool(workers)
    # Largest groups first keeps the threads evenly busy.
    groups.sort(key=lambda g: -sum(_op_bytes(o) for _, o in g))
    steps.wait([pool.submit(replay_group, g) for g in groups])
