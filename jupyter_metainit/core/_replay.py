"""Replay: run the recorded ops a set of tensors depends on, and nothing else.

``plan`` walks backwards from the requested storages through the ops that wrote them and the
storages those ops read *before* they ran, so the work is proportional to the requested subtree.
``execute`` runs the plan on real memory in recording order (``fast`` mode: independent groups in
parallel threads), freeing intermediates as soon as nothing later needs them.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from jupyter_metainit.core import _rng
from jupyter_metainit.core._graph import (
    Constant,
    External,
    OpRecord,
    StorageRecord,
    TensorRecord,
    constant_op,
)
from jupyter_metainit.core._plain import plain
from jupyter_metainit.core.errors import DeferredDataError, MaterializationError

__all__ = ["Plan", "compute_values", "execute", "plan"]

Progress = Callable[[int, int], None]


class Plan:
    """The ops to replay (in recording order) and the storages that must come out."""

    def __init__(self, ops: list[OpRecord], targets: list[StorageRecord]) -> None:
        self.ops = ops
        self.targets = targets

    def __len__(self) -> int:
        return len(self.ops)


def plan(records: Iterable[TensorRecord]) -> Plan:
    targets: dict[int, StorageRecord] = {}
    for r in records:
        targets.setdefault(id(r.storage), r.storage)
    processed: dict[int, int] = {}  # storage id -> ops with seq below this are included
    included: dict[int, OpRecord] = {}
    inf = 1 << 62
    work: list[tuple[StorageRecord, int]] = [(s, inf) for s in targets.values()]
    while work:
        storage, upto = work.pop()
        done = processed.get(id(storage), -1)
        if upto <= done:
            continue
        processed[id(storage)] = upto
        if not storage.writes:
            raise DeferredDataError(
                "a deferred tensor has no recorded origin; it cannot be replayed"
            )
        for op in storage.writes:
            if op.seq >= upto:
                break
            if op.seq < done or op.seq in included:
                continue
            included[op.seq] = op
            for s in op.reads:
                work.append((s, op.seq))
    return Plan(sorted(included.values(), key=lambda o: o.seq), list(targets.values()))


def _geometry_matches(t: torch.Tensor, r: TensorRecord) -> bool:
    return (
        t.dtype == r.dtype
        and tuple(t.shape) == r.size
        and tuple(t.stride()) == r.stride
        and t.storage_offset() == r.offset
    )


class _Run:
    """State of one replay: real storages, generator positions, progress."""

    def __init__(self, p: Plan, device: torch.device | None, rng: str,
                 progress: Progress | None) -> None:  # fmt: skip
        self.plan = p
        self.device = device
        self.rng = rng
        self.env: dict[int, torch.Tensor] = {}
        self.progress = progress
        self.done = 0
        self.total = sum(_op_bytes(op) for op in p.ops)
        self.generators: dict[int, tuple[torch.Generator, int]] = {}
        target_ids = {id(s) for s in p.targets}
        self.last_use: dict[int, int] = {}
        for i, op in enumerate(p.ops):
            for s in op.reads:
                self.last_use[id(s)] = i
        for sid in target_ids:
            self.last_use[sid] = len(p.ops)
        if rng == "exact":
            self.total += _burn_estimate(p)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None and nbytes:
            self.progress(self.done, max(self.total, self.done))

    # tensors -----------------------------------------------------------------------------
    def real(self, r: TensorRecord) -> torch.Tensor:
        base = self.env.get(id(r.storage))
        if base is None:
            raise MaterializationError("internal error: a storage was needed before it was made")
        if _geometry_matches(base, r):
            return base
        if base.dtype != r.dtype:
            base = base.view(r.dtype) if base.element_size() == r.dtype.itemsize else base
        return base.as_strided(r.size, r.stride, r.offset)

    def op_device(self, op: OpRecord) -> torch.device:
        if self.device is not None:
            return self.device
        for out in op.outputs:
            if out is not None:
                return out.storage.device
        for s in op.reads:
            return s.device
        return torch.device("cpu")

    def arg(self, x: Any, device: torch.device) -> Any:
        if isinstance(x, TensorRecord):
            return self.real(x)
        if isinstance(x, External):
            if x.tensor._version != x.version:
                raise MaterializationError(
                    f"a real tensor used at {x.where} was changed in place after it was recorded "
                    "(its values at that time are gone); recreate the deferred tensors that use it"
                )
            return x.tensor.to(device) if x.tensor.device != device else x.tensor
        if isinstance(x, Constant):
            return x.tensor.to(device) if x.tensor.device != device else x.tensor
        if isinstance(x, torch.device):
            return device
        return x

    # one op --------------------------------------------------------------------------------
    def run(self, index: int, op: OpRecord) -> None:
        device = self.op_device(op)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise MaterializationError(
                f"this tensor was recorded for {device} but CUDA is not available here; "
                "pass device='cpu' (or another available device) to materialize"
            )
        if op.func is constant_op:
            out = op.args[0].tensor
            out = out.to(device) if out.device != device else out
            self._store(op, (out,), device)
            self.advance(_op_bytes(op))
            return
        args = tree_map(lambda x: self.arg(x, device), op.args)
        kwargs = tree_map(lambda x: self.arg(x, device), op.kwargs)
        if "device" in kwargs:
            kwargs["device"] = device
        if op.rng is not None:
            out = self._run_random(op, args, kwargs, device)
        else:
            out = op.func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self._store(op, outs, device)
        self.advance(_op_bytes(op))

    def _store(self, op: OpRecord, outs: Any, device: torch.device) -> None:
        for rec, o in zip(op.outputs, outs, strict=True):
            if rec is None:
                continue
            if not _geometry_matches(o, rec):
                # Keep the layout the deferred tensor reported, so views over it stay right.
                fixed = torch.empty_strided(rec.size, rec.stride, dtype=rec.dtype, device=o.device)
                fixed.copy_(o)
                o = fixed
            self.env[id(rec.storage)] = o

    def _run_random(self, op: OpRecord, args: tuple, kwargs: dict, device: torch.device) -> Any:
        seg, index = op.rng.segment, op.rng.index
        info_has_gen = "generator" in [a.name for a in op.func._schema.arguments]
        if self.rng == "fast":
            gen = _rng.fast_generator(seg, index, device if info_has_gen else torch.device("cpu"))
            return _rng.run_random(lambda g: _call(op, args, kwargs, g), gen, info_has_gen)
        gen_dev = seg.device
        current = self.generators.get(id(seg))
        if current is not None and current[1] == index:
            gen = current[0]
        else:
            gen = torch.Generator(device=gen_dev)
            gen.set_state(_rng.state_before(seg, index, self._burn_progress))
        if device == gen_dev:
            out = _rng.run_random(lambda g: _call(op, args, kwargs, g), gen, info_has_gen)
        else:
            # Exact values come from the recorded generator's device; then they are copied over.
            cpu_args = tree_map(lambda x: _to(x, gen_dev), args)
            cpu_kwargs = tree_map(lambda x: _to(x, gen_dev), kwargs)
            if "device" in cpu_kwargs:
                cpu_kwargs["device"] = gen_dev
            out = _rng.run_random(lambda g: _call(op, cpu_args, cpu_kwargs, g), gen, info_has_gen)
            for i, a in enumerate(op.func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write and i < len(args):
                    args[i].copy_(cpu_args[i])
            out = tree_map(lambda x: _to(x, device), out)
            if op.func._schema.returns and op.func._schema.returns[0].alias_info is not None:
                out = args[0]
        self.generators[id(seg)] = (gen, index + 1)
        seg.add_checkpoint(index + 1, gen.get_state())
        return out

    def _burn_progress(self, nbytes: int) -> None:
        self.advance(nbytes)

    def release(self, index: int, op: OpRecord) -> None:
        for s in op.reads:
            if self.last_use.get(id(s)) == index:
                self.env.pop(id(s), None)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor) and x.device != device:
        return x.to(device)
    return x


def _call(op: OpRecord, args: tuple, kwargs: dict, gen: torch.Generator | None) -> Any:
    kw = dict(kwargs)
    names = [a.name for a in op.func._schema.arguments]
    if "generator" in names:
        gi = names.index("generator")
        if gi < len(args):
            args = tuple(gen if j == gi else a for j, a in enumerate(args))
        else:
            kw["generator"] = gen
    return op.func(*args, **kw)


def _op_bytes(op: OpRecord) -> int:
    total = 0
    for rec in op.outputs:
        if rec is not None:
            total += rec.storage.nbytes
    if op.rng is not None and total == 0:
        total = op.rng.segment.specs[op.rng.index].nbytes
    return total


def _burn_estimate(p: Plan) -> int:
    first: dict[int, tuple[Any, int]] = {}
    for op in p.ops:
        if op.rng is not None and id(op.rng.segment) not in first:
            first[id(op.rng.segment)] = (op.rng.segment, op.rng.index)
    return sum(_rng.burn_bytes(seg, idx) for seg, idx in first.values())


def _components(ops: list[OpRecord]) -> list[list[tuple[int, OpRecord]]]:
    """Groups of ops that touch disjoint storages: each can replay on its own thread."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for op in ops:
        ids = [id(s) for s in op.reads] + [id(r.storage) for r in op.outputs if r is not None]
        for other in ids[1:]:
            parent[find(other)] = find(ids[0])
    groups: dict[int, list[tuple[int, OpRecord]]] = {}
    for i, op in enumerate(ops):
        key = op.reads[0] if op.reads else next(r.storage for r in op.outputs if r is not None)
        groups.setdefault(find(id(key)), []).append((i, op))
    return list(groups.values())


def execute(
    p: Plan, device: torch.device | None = None, rng: str = "exact",
    progress: Progress | None = None, threads: int | None = None,
) -> dict[int, torch.Tensor]:  # fmt: skip
    """Run ``p`` and return the real storages of its targets, keyed by ``id(StorageRecord)``."""
    run = _Run(p, device, rng, progress)
    with plain():
        if rng == "fast" and len(p.ops) > 1 and (threads or os.cpu_count() or 1) > 1:
            groups = _components(p.ops)
            workers = min(threads or os.cpu_count() or 1, len(groups))
            if workers > 1:

                def replay_group(group: list[tuple[int, OpRecord]]) -> None:
                    with plain():
                        for i, op in group:
                            run.run(i, op)
                            run.release(i, op)

                with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                    # Largest groups first keeps the threads evenly busy.
                    groups.sort(key=lambda g: -sum(_op_bytes(o) for _, o in g))
                    for f in [pool.submit(replay_group, g) for g in groups]:
                        f.result()
                return {id(s): run.env[id(s)] for s in p.targets}
        for i, op in enumerate(p.ops):
            run.run(i, op)
            run.release(i, op)
    return {id(s): run.env[id(s)] for s in p.targets}


def real_view(base: torch.Tensor, r: TensorRecord) -> torch.Tensor:
    if _geometry_matches(base, r):
        return base
    return base.as_strided(r.size, r.stride, r.offset)


def compute_values(records: list[TensorRecord]) -> list[torch.Tensor]:
    """Exact current values of deferred tensors on the CPU, without changing them."""
    p = plan(records)
    env = execute(p, torch.device("cpu"), "exact")
    with plain():
        return [real_view(env[id(r.storage)], r) for r in records]
