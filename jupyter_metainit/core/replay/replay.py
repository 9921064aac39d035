"""Replay: run the recorded ops a set of tensors depends on, and nothing else.

``plan`` walks backwards from the requested storages through the ops that wrote them and the
storages those ops read *before* they ran, so the work is proportional to the requested subtree.
``execute`` runs the plan on real memory in recording order (independent groups in parallel
threads: any of them in ``fast`` mode, runs of the random stream in ``exact`` mode), freeing
intermediates as soon as nothing later needs them.
``compute_values`` is the read path used while recording (``.item()``, ``bool(t)``, ops without
a meta kernel): exact, on the CPU, continuing from values computed by earlier reads.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from jupyter_metainit.core.errors import DeferredDataError, MaterializationError
from jupyter_metainit.core.materialize.digest import digest
from jupyter_metainit.core.record.graph import (
    Constant,
    External,
    OpRecord,
    StorageRecord,
    TensorRecord,
    constant_op,
)
from jupyter_metainit.core.record.state import default_dtype_as
from jupyter_metainit.core.replay.values import ValueCache, value_cache
from jupyter_metainit.core.rng import streams as _rng
from jupyter_metainit.core.rng.split_fill import (
    FILLS,
    MIN_SKIP,
    fill_region,
    fill_region_into,
    split_fill,
)
from jupyter_metainit.core.runtime.interrupts import (
    check,
    handling_interrupts,
    interrupted,
)
from jupyter_metainit.core.runtime.lock import exclusive
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain
from jupyter_metainit.core.runtime.pool import available_cores, core_pool, on_core_pool

__all__ = ["Plan", "compute_values", "execute", "plan", "real_view"]

aten = torch.ops.aten


class Progress:
    """What a replay tells about its progress (``materialize`` turns it into bytes of memory).

    ``storage_done`` is called once per requested storage, when its last write has run: its
    memory is final. ``phase`` describes work that is not memory, in words.
    """

    def storage_done(self, storage: StorageRecord) -> None:  # pragma: no cover - interface
        pass

    def phase(self, text: str) -> None:  # pragma: no cover - interface
        pass


class Plan:
    """The ops to replay (in recording order), the storages that must come out, the storages
    that start from a value already computed (``seeds``: id -> (record, value)), and the
    storages whose creating op is skipped because a later op overwrites them completely
    (``allocate``: id -> the creating op's output record, allocated empty instead)."""

    def __init__(
        self,
        ops: list[OpRecord],
        targets: list[StorageRecord],
        seeds: dict[int, tuple[StorageRecord, torch.Tensor]],
        versions: dict[int, tuple[StorageRecord, int]],
        allocate: dict[int, TensorRecord],
    ) -> None:
        self.ops = ops
        self.targets = targets
        self.seeds = seeds
        self.versions = versions  # id -> (record, writes applied once the plan has run)
        self.allocate = allocate

    def __len__(self) -> int:
        return len(self.ops)


def _writes_before(storage: StorageRecord, seq: int) -> int:
    """How many of ``storage``'s writes were recorded before op number ``seq``."""
    return bisect.bisect_left(storage.writes, seq, key=lambda op: op.seq)


def _last_overwrite(storage: StorageRecord, lo: int, hi: int) -> int:
    """Index of the last write in ``writes[lo:hi]`` that overwrites ``storage`` completely
    without reading it (everything before it is dead), else ``lo``."""
    writes = storage.writes
    for i in range(hi - 1, lo, -1):
        if storage in writes[i].overwrites:
            return i
    return lo


class _CacheConflict(Exception):
    def __init__(self, storage: StorageRecord) -> None:
        self.storage = storage


def plan(records: Iterable[TensorRecord], cache: ValueCache | None = None) -> Plan:
    """The ops that produce the current values of ``records``' storages.

    The rules it relies on, which the recorder (``_record.handle_op``) guarantees:

    * **Storages, not tensors, have histories.** Every op that creates or writes memory is
      appended to ``writes`` of each storage it creates or writes, in recording order; views
      are not ops but geometries (``TensorRecord``) over a storage, so a write through any view
      is a write of the storage.
    * **Reads are as of the op.** An op's ``reads`` are the storages of its tensor inputs; it
      saw each one after exactly the writes recorded before it (``seq`` order). So the value of
      storage ``S`` "as op ``o`` read it" needs ``S``'s writes with ``seq < o.seq``, and,
      recursively, what those writes read.
    * **Dead writes are skipped.** Of those writes, only the ones from the last write that
      ``overwrites`` ``S`` completely without reading it (``normal_`` after the constructor's
      ``kaiming_uniform_``) are needed; such an op does not list ``S`` in its ``reads``. A
      skipped random op costs nothing in ``fast`` mode, and in ``exact`` mode the generator is
      moved past it by ``_rng.state_before`` (jump-ahead or regeneration) without filling memory.
    * **Recording order is a valid execution order** for any subset closed this way.

    With ``cache`` (reads during recording), a storage whose value after its first ``k`` writes
    is cached starts from it, unless some op of the plan reads it at an earlier version.
    """
    targets: dict[int, StorageRecord] = {}
    for r in records:
        targets.setdefault(id(r.storage), r.storage)
    disabled: set[int] = set()
    while True:
        try:
            return _closure(targets, cache, disabled)
        except _CacheConflict as conflict:
            disabled.add(id(conflict.storage))


def _closure(
    targets: dict[int, StorageRecord], cache: ValueCache | None, disabled: set[int]
) -> Plan:
    inf = 1 << 62
    starts: dict[int, int] = {}  # storage id -> writes already in a cached value (0: none)
    final: dict[int, int] = {}  # storage id -> writes applied once the plan has run
    seeds: dict[int, tuple[StorageRecord, torch.Tensor]] = {}
    storages: dict[int, StorageRecord] = {}
    requested: set[tuple[int, int]] = set()
    included: dict[int, OpRecord] = {}
    work: list[tuple[StorageRecord, int]] = [(s, inf) for s in targets.values()]
    while work:
        storage, upto = work.pop()
        sid = id(storage)
        if not storage.writes:
            raise DeferredDataError(
                "a deferred tensor has no recorded origin; it cannot be replayed"
            )
        need = len(storage.writes) if upto == inf else _writes_before(storage, upto)
        if (sid, need) in requested:
            continue
        requested.add((sid, need))
        if sid not in starts:
            start = 0
            cached = cache.get(storage) if cache is not None and sid not in disabled else None
            if cached is not None and 0 < cached[0] <= need:
                start = cached[0]
                seeds[sid] = (storage, cached[1])
            starts[sid] = start
            storages[sid] = storage
        start = starts[sid]
        if need < start:
            raise _CacheConflict(storage)
        final[sid] = max(final.get(sid, 0), need)
        for op in storage.writes[_last_overwrite(storage, start, need) : need]:
            if op.seq in included:
                continue
            included[op.seq] = op
            for s in op.reads:
                work.append((s, op.seq))
    ops = sorted(included.values(), key=lambda o: o.seq)
    for op in ops:
        # An op that writes several storages (``_foreach_add_`` over a list, batch norm's
        # running statistics) runs whole: the storages it writes besides the one asked for
        # come out with its write applied too, and are cached as such.
        for s in op.mutates:
            if id(s) in final:
                final[id(s)] = max(final[id(s)], _writes_before(s, op.seq) + 1)
    allocate: dict[int, TensorRecord] = {}
    for sid, storage in storages.items():
        creator = storage.writes[0]
        if sid not in seeds and creator.seq not in included:
            out = next(r for r in creator.outputs if r is not None and r.storage is storage)
            allocate[sid] = out
    versions = {sid: (storages[sid], n) for sid, n in final.items()}
    return Plan(ops, list(targets.values()), seeds, versions, allocate)


def _geometry_matches(t: torch.Tensor, r: TensorRecord) -> bool:
    return (
        t.dtype == r.dtype
        and tuple(t.shape) == r.size
        and tuple(t.stride()) == r.stride
        and t.storage_offset() == r.offset
        and not r.conj
        and not r.neg
    )


def real_view(base: torch.Tensor, r: TensorRecord) -> torch.Tensor:
    """``r``'s view of the real storage ``base``: any geometry, any dtype (dtype views are views
    too), with the lazy conjugate/negative bits the deferred view had."""
    if _geometry_matches(base, r):
        return base
    if base.dtype == r.dtype:
        view = base.as_strided(r.size, r.stride, r.offset)
    else:
        view = torch.empty(0, dtype=r.dtype, device=base.device)
        view.set_(base.untyped_storage(), r.offset, r.size, r.stride)
    if r.conj:
        view = view.conj()
    if r.neg:
        view = view._neg_view()
    return view


class _ShapeMismatch:
    """Stands in for an output whose real shape is not the one its meta kernel reported."""

    def __init__(self, op: OpRecord, real: tuple, recorded: tuple) -> None:
        self.op, self.real_shape, self.recorded = op, real, recorded

    def error(self) -> MaterializationError:
        return MaterializationError(
            f"{self.op.func} (called at {self.op.where}) returns a tensor of shape "
            f"{self.real_shape} here, but PyTorch's meta kernel reported {self.recorded} when it "
            "was recorded; this output cannot be materialized (its other outputs can)"
        )


class _Noted(threading.local):
    whole: list[StorageRecord] | None = None


_noted = _Noted()


@contextlib.contextmanager
def noting_whole_intermediates() -> Iterator[list[StorageRecord]]:
    """Collect the large storages that replays on this thread compute whole although only part
    of them is needed: a parameter a shard is cut from, when its last write cannot be generated
    for the shard's rows alone (``materialize_sharded`` reports them)."""
    found: list[StorageRecord] = []
    saved, _noted.whole = _noted.whole, found
    try:
        yield found
    finally:
        _noted.whole = saved


class _Run:
    """State of one replay: real storages, generator positions, progress."""

    def __init__(self, p: Plan, device: torch.device | None, rng: str,
                 progress: Progress | None, retain: Callable[[StorageRecord], bool] | None,
                 ) -> None:  # fmt: skip
        self.plan = p
        self.device = device
        self.rng = rng
        self.env: dict[int, torch.Tensor] = {}
        self.progress = progress
        self.last_phase = ""
        # op index -> targets whose memory is final once that op has run
        self.finishing: dict[int, list[StorageRecord]] = {}
        if progress is not None:
            last_write = _last_writes(p)
            for s in p.targets:
                i = last_write.get(id(s))
                if i is None:
                    progress.storage_done(s)  # nothing to run: cached, or made before
                else:
                    self.finishing.setdefault(i, []).append(s)
        self._thread = threading.local()
        self.checked: set[int] = set()  # External inputs verified unchanged
        mutated = {id(s) for op in p.ops for s in op.mutates}
        written = mutated | {id(r.storage) for op in p.ops for r in op.outputs if r is not None}
        target_ids = {id(s) for s in p.targets}
        for sid, (_storage, value) in p.seeds.items():
            # A cached value is shared: copy it before anything writes it or hands it out.
            if sid in written or sid in target_ids:
                value = value.clone()
            if device is not None and value.device != device:
                value = value.to(device)
            self.env[sid] = value
        self.last_use: dict[int, int] = {}
        for i, op in enumerate(p.ops):
            for s in op.reads:
                self.last_use[id(s)] = i
        keep = set(target_ids)
        if retain is not None:
            keep |= {sid for sid, (s, _n) in p.versions.items() if retain(s)}
        for sid in keep:
            self.last_use[sid] = len(p.ops)
        self._keep = keep
        self._targets = target_ids
        # Storages whose memory this replay writes in place or hands out: a constant (the
        # user's ``torch.tensor`` data, kept in the recording) must be copied before it lands
        # there, or the recording itself is changed and the next replay starts from written data.
        self._not_shared = mutated | keep
        self._noted = _noted.whole  # captured here: fast mode replays in worker threads
        self._extents: dict[int, tuple[int, int]] | None = None  # computed on first need
        self._copied_once: set[int] | None = None
        # storage id -> a fill not run yet: its only reader copies a slice of it (a shard)
        self.pending_fills: dict[int, tuple[OpRecord, tuple, dict, torch.Generator]] = {}

    @property
    def generators(self) -> dict[int, tuple[torch.Generator, int]]:
        """Stream id -> (generator, index of the op it is right before), per thread: exact
        mode may run one stream's ops on several threads, each from its own position."""
        try:
            return self._thread.generators
        except AttributeError:
            self._thread.generators = {}
            return self._thread.generators

    def phase(self, text: str) -> None:
        if self.progress is not None and text != self.last_phase:
            self.last_phase = text
            self.progress.phase(text)

    def finished(self, index: int) -> None:
        if self.progress is not None:
            for s in self.finishing.get(index, ()):
                self.progress.storage_done(s)

    # tensors -----------------------------------------------------------------------------
    def real(self, r: TensorRecord, device: torch.device) -> torch.Tensor:
        base = self.env.get(id(r.storage))
        if isinstance(base, _ShapeMismatch):
            raise base.error()
        if base is None:
            created = self.plan.allocate.get(id(r.storage))
            if created is None:
                raise MaterializationError(
                    "internal error: a storage was needed before it was made"
                )
            # Its creating op was dead: a later op overwrites it completely.
            base = torch.empty_strided(created.size, created.stride, dtype=created.dtype,
                                       device=device)  # fmt: skip
            self.env[id(r.storage)] = base
        return real_view(base, r)

    def op_device(self, op: OpRecord) -> torch.device:
        if self.device is not None:
            return self.device
        for out in op.outputs:
            if out is not None:
                return out.storage.device
        # An in-place op (`uniform_` on a tensor recorded for cuda:1) runs where the tensor it
        # writes was recorded; only an op that writes nothing follows what it reads.
        for s in (*op.mutates, *op.reads):
            return s.device
        return torch.device("cpu")

    def arg(self, x: Any, device: torch.device) -> Any:
        if isinstance(x, TensorRecord):
            return self.real(x, device)
        if isinstance(x, External):
            if id(x) not in self.checked:
                if x.tensor._version != x.version or (x.digest and digest(x.tensor) != x.digest):
                    raise MaterializationError(
                        f"a real tensor used at {x.where} was written after it was recorded "
                        "(its values at that time are gone); recreate the deferred tensors "
                        "that use it"
                    )
                self.checked.add(id(x))
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
        if getattr(op.func, "host_op", False):
            # Constants and file reads: produced on the CPU, then moved.
            if op.func is not constant_op:
                self.phase("reading checkpoint files")
            out = op.func(*op.args)
            if out.device != device:
                out = out.to(device)
            elif op.func is constant_op and id(op.outputs[0].storage) in self._not_shared:
                out = _copy_storage(out)
            self._store(op, (out,))
            if self._noted is not None:
                self._note_whole(op)
            self.finished(index)
            return
        if op.func is aten.copy_.default and self._copy_from_pending_fill(op, device):
            self.finished(index)
            return
        # ATen arguments nest one list deep at most: map_args, not pytree (per op, it shows)
        args, kwargs = map_args(lambda x: self.arg(x, device), op.args, op.kwargs)
        if "device" in kwargs:
            kwargs["device"] = device
        partial = False
        with default_dtype_as(op.default_dtype):
            if op.rng is not None:
                self.phase("generating random values")
                out, partial = self._run_random(op, args, kwargs, device)
            else:
                self.phase("computing")
                out = op.func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self._store(op, outs)
        if self._noted is not None and not partial:
            self._note_whole(op)
        self.finished(index)

    def _store(self, op: OpRecord, outs: Any) -> None:
        for rec, o in zip(op.outputs, outs, strict=False):
            if rec is None:
                continue
            if o.is_conj() or o.is_neg():
                o = o.resolve_conj().resolve_neg()
            if tuple(o.shape) != rec.size:
                # PyTorch's meta kernel promised another shape than the real kernel returns
                # (an unused statistic of batch_norm in eval mode): fine unless it is needed.
                self.env[id(rec.storage)] = _ShapeMismatch(op, tuple(o.shape), rec.size)
                continue
            if not _geometry_matches(o, rec):
                # Keep the layout the deferred tensor reported, so views over it stay right.
                fixed = torch.empty_strided(rec.size, rec.stride, dtype=rec.dtype, device=o.device)
                fixed.copy_(o)
                o = fixed
            self.env[id(rec.storage)] = o

    def _note_whole(self, op: OpRecord) -> None:
        """``op`` ran over whole storages: note the large ones nothing asked for whole."""
        written = [r.storage for r in op.outputs if r is not None] + list(op.mutates)
        for storage in written:
            if (
                id(storage) not in self._targets
                and storage.nbytes // storage.dtype.itemsize >= MIN_SKIP
                and storage not in self._noted
            ):
                self._noted.append(storage)

    def _run_random(
        self, op: OpRecord, args: tuple, kwargs: dict, device: torch.device
    ) -> tuple[Any, bool]:
        """Run a recorded random op; returns its output and whether only part of its output
        was generated (a shard's region, or a fill left for the copy that cuts the shard)."""
        seg, index = op.rng.segment, op.rng.index
        has_gen = "generator" in [a.name for a in op.func._schema.arguments]
        region = self._region(op)
        fusable = (
            has_gen
            and op.func in FILLS
            and device.type == "cpu"
            and region is not None
            and id(op.args[0].storage) in self.copied_once()
        )
        if fusable and self.rng == "fast":
            gen = _rng.fast_generator(seg, index, device)
            self.pending_fills[id(op.args[0].storage)] = (op, args[1:], kwargs, gen)
            return args[0], True
        if self.rng == "fast":
            gen = _rng.fast_generator(seg, index, device)
            if region is not None:
                out = self._run_from(op, args, kwargs, gen, has_gen, region)
                if out is not None:
                    return out, True
            return _rng.run_random(lambda g: _call(op, args, kwargs, g), gen, has_gen), False
        gen_dev = seg.device
        current = self.generators.get(id(seg))
        if current is not None and current[1] == index:
            gen = current[0]
        else:
            gen = torch.Generator(device=gen_dev)
            gen.set_state(_rng.state_before(seg, index, self._burn_progress))
        if device == gen_dev:
            if region is not None and _rng.known_draws(seg.specs[index], gen_dev) is None:
                region = None  # the next op could not jump past the rest of this one
            if region is not None and fusable:
                # Run later, by the copy that reads the shard's slice (_copy_from_pending_fill);
                # the next op of this stream jumps past it from the checkpoint before it.
                self.pending_fills[id(op.args[0].storage)] = (op, args[1:], kwargs, gen)
                self.generators.pop(id(seg), None)
                return args[0], True
            if region is not None:
                out = self._run_from(op, args, kwargs, gen, has_gen, region)
                if out is not None:
                    # Only the region was drawn: the generator is not at the op's end. The
                    # next op of this stream starts from the checkpoint before this one and
                    # jumps past it (and whatever it skips too): one jump instead of two.
                    self.generators.pop(id(seg), None)
                    return out, True
            out = self._run_from(op, args, kwargs, gen, has_gen, None)
        else:
            # Exact values come from the recorded generator's device; then they are copied over.
            cpu_args = tree_map(lambda x: _to(x, gen_dev), args)
            cpu_kwargs = tree_map(lambda x: _to(x, gen_dev), kwargs)
            if "device" in cpu_kwargs:
                cpu_kwargs["device"] = gen_dev
            out = self._run_from(op, cpu_args, cpu_kwargs, gen, has_gen, None)
            for i, a in enumerate(op.func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write and i < len(args):
                    args[i].copy_(cpu_args[i])
            out = tree_map(lambda x: _to(x, device), out)
            if op.func._schema.returns and op.func._schema.returns[0].alias_info is not None:
                out = args[0]
        self.generators[id(seg)] = (gen, index + 1)
        seg.add_checkpoint(index + 1, gen.get_state())
        return out, False

    @staticmethod
    def _run_from(
        op: OpRecord, args: tuple, kwargs: dict, gen: torch.Generator, has_gen: bool,
        region: tuple[int, int] | None,
    ) -> Any:  # fmt: skip
        """Run a random op drawing from ``gen``. With ``region``: only that part (a rank's
        shard), leaving ``gen`` unmoved, or None if that was not possible. Large CPU fills run
        on all cores."""
        target = args[0] if args else None
        fill = lambda t, g: _call(op, (t, *args[1:]), kwargs, g)  # noqa: E731
        if region is not None:
            return target if has_gen and fill_region(op.func, target, fill, gen, region) else None
        if has_gen and split_fill(op.func, target, fill, gen):
            return target
        return _rng.run_random(lambda g: _call(op, args, kwargs, g), gen, has_gen)

    def _copy_from_pending_fill(self, op: OpRecord, device: torch.device) -> bool:
        """``dst.copy_(src)`` where ``src`` is a slice of a fill not run yet: write the slice's
        values straight into ``dst`` through a small buffer (the shard, never the whole)."""
        src = op.args[1] if len(op.args) > 1 else None
        if not isinstance(src, TensorRecord):
            return False
        pending = self.pending_fills.pop(id(src.storage), None)
        if pending is None:
            return False
        fill_op, rest, kwargs, gen = pending
        dst = self.arg(op.args[0], device)
        whole = fill_op.args[0]
        numel = whole.storage.nbytes // whole.dtype.itemsize
        at_end = None
        if self.rng == "exact" and fill_op.rng is not None:
            seg, index = fill_op.rng.segment, fill_op.rng.index

            def at_end(state: torch.Tensor) -> None:
                # The shard ran to the fill's end (the last rank's): the next fill of this
                # stream starts right here, without a jump.
                seg.add_checkpoint(index + 1, state)

        done = fill_region_into(
            fill_op.func, numel, dst, src.offset,
            lambda t, g: _call(fill_op, (t, *rest), kwargs, g), gen, at_end=at_end,
        )  # fmt: skip
        if not done:  # not expected (checked when deferred): run the whole fill, then copy
            target = self.real(whole, device)
            _call(fill_op, (target, *rest), kwargs, gen)
            dst.copy_(self.real(src, device))
        return True

    def copied_once(self) -> set[int]:
        if self._copied_once is None:
            self._copied_once = _copied_once(self.plan, self._keep)
        return self._copied_once

    def _region(self, op: OpRecord) -> tuple[int, int] | None:
        """The elements of a whole-storage fill that later ops read, when that is a small part
        of it (a shard), else None."""
        x = op.args[0] if op.args else None
        if op.func not in FILLS or not isinstance(x, TensorRecord):
            return None
        storage = x.storage
        if x.offset != 0 or x.nbytes != storage.nbytes or x.dtype != storage.dtype:
            return None
        if storage.nbytes // x.dtype.itemsize < MIN_SKIP:
            return None  # too small for a part to be worth a jump (value reads, small layers)
        if self._extents is None:
            self._extents = _read_extents(self.plan, self._keep)
        extent = self._extents.get(id(storage))
        if extent is None:
            return None
        size = x.dtype.itemsize
        lo, hi = extent[0] // size, -(-extent[1] // size)
        n = storage.nbytes // size
        return (lo, hi) if hi - lo <= 0.75 * n else None

    def _burn_progress(self, nbytes: int) -> None:
        self.phase("regenerating the random stream up to this part (no memory)")

    def release(self, index: int, op: OpRecord) -> None:
        for s in op.reads:
            if self.last_use.get(id(s)) == index:
                self.env.pop(id(s), None)


def _copy_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a copy of its whole storage (same geometry, offset included)."""
    copy = torch.empty(0, dtype=t.dtype, device=t.device)
    copy.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())
    return copy


def _byte_range(r: TensorRecord) -> tuple[int, int]:
    if any(n == 0 for n in r.size):
        return (0, 0)
    last = r.offset + sum((n - 1) * st for n, st in zip(r.size, r.stride, strict=True))
    size = r.dtype.itemsize
    return (r.offset * size, (last + 1) * size)


def _last_writes(p: Plan) -> dict[int, int]:
    """Per storage id, the index of the plan's last op that creates or writes it."""
    last_write: dict[int, int] = {}
    for i, op in enumerate(p.ops):
        for r in op.outputs:
            if r is not None:
                last_write[id(r.storage)] = i
        for s in op.mutates:
            last_write[id(s)] = i
    return last_write


def _read_extents(p: Plan, keep: set[int]) -> dict[int, tuple[int, int]]:
    """Per storage, the byte range that the plan's ops read after its last write (the kept
    storages are read whole). Used to fill only the part of a parameter a shard is cut from.
    Storages written after being read, or read in ways not seen here, get their whole range."""
    last_write = _last_writes(p)
    extents: dict[int, tuple[int, int]] = {}
    whole: set[int] = set(keep)
    for i, op in enumerate(p.ops):
        for x in iter_args(op.args, op.kwargs):
            if not isinstance(x, TensorRecord):
                continue
            sid = id(x.storage)
            written = last_write.get(sid, -1)
            if written == i and x.storage in op.overwrites:
                continue  # the last write itself, which does not read what it overwrites
            if written >= i:  # read before (or by) its last write
                whole.add(sid)
                continue
            lo, hi = _byte_range(x)
            cur = extents.get(sid)
            extents[sid] = (lo, hi) if cur is None else (min(cur[0], lo), max(cur[1], hi))
    for op in p.ops:
        for s in op.reads:
            if id(s) not in extents:
                whole.add(id(s))  # read without a visible geometry: all of it
    for sid in whole:
        extents.pop(sid, None)
    return extents


def _copied_once(p: Plan, keep: set[int]) -> set[int]:
    """Storages whose last write is followed by exactly one read: a ``copy_`` of a contiguous
    slice of them into a contiguous tensor of the same dtype and size (how FSDP2 and DTensor cut
    a rank's shard out of a parameter)."""
    last_write = _last_writes(p)
    readers: dict[int, list[tuple[int, OpRecord]]] = {}
    for i, op in enumerate(p.ops):
        for s in op.reads:
            readers.setdefault(id(s), []).append((i, op))
    out = set()
    for sid, ops in readers.items():
        if sid in keep or len(ops) != 1:
            continue
        i, op = ops[0]
        if op.func is not aten.copy_.default or last_write.get(sid, -1) >= i:
            continue
        dst, src = op.args[0], op.args[1]
        if (
            isinstance(dst, TensorRecord)
            and isinstance(src, TensorRecord)
            and id(src.storage) == sid
            and id(dst.storage) != sid
            and dst.dtype == src.dtype == src.storage.dtype
            and dst.size == src.size
            and _rng.is_contiguous(dst.size, dst.stride)
            and _rng.is_contiguous(src.size, src.stride)
            and not (src.conj or src.neg or dst.conj or dst.neg)
        ):
            out.add(sid)
    return out


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
    stream. Its thread jumps once to where the run starts (``_rng.state_before``) and then draws
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
        if _rng.known_draws(seg.specs[op.rng.index], seg.device) is None:
            return None
    groups = _components(ops)  # in the order of their first op
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


def execute(
    p: Plan, device: torch.device | None = None, rng: str = "exact",
    progress: Progress | None = None, threads: int | None = None,
    retain: Callable[[StorageRecord], bool] | None = None,
) -> dict[int, torch.Tensor]:  # fmt: skip
    """Run ``p``; return the real storages of its targets (and of the storages ``retain``
    accepts), keyed by ``id(StorageRecord)``.

    Runs with every interception off (``plain``), outside inference mode, and with each op's
    recorded default dtype, so the result does not depend on what is in force at the time.
    """
    with plain(), torch.inference_mode(False):
        run = _Run(p, device, rng, progress, retain)
        if rng == "fast" and len(p.ops) > 1 and (threads or available_cores()) > 1:
            groups = _components(p.ops)
            workers = min(threads or available_cores(), len(groups))
            if workers > 1:
                _run_parallel(run, groups, workers)
                return _results(run, p)
        cores = (threads or available_cores()) if rng == "exact" and len(p.ops) > 1 else 1
        if cores > 1:
            parts = stream_parts(p.ops, cores)
            if parts is not None:
                _run_parallel(run, parts, len(parts))
                return _results(run, p)
        for i, op in enumerate(p.ops):
            check()  # a held-back Ctrl-C stops here, between two ops
            run.run(i, op)
            run.release(i, op)
    return _results(run, p)


def _run_parallel(run: _Run, groups: list[list[tuple[int, OpRecord]]], workers: int) -> None:
    """Replay independent groups on ``workers`` threads; any failure or Ctrl-C stops them all
    after the op each is running (not after all remaining work)."""
    stop = threading.Event()

    def replay_group(group: list[tuple[int, OpRecord]]) -> None:
        with plain(), torch.inference_mode(False):
            for i, op in group:
                if stop.is_set() or interrupted():
                    return
                run.run(i, op)
                run.release(i, op)

    if on_core_pool():  # a replay inside a replay's thread: the pool's threads may all be busy
        for group in groups:
            replay_group(group)
        return
    pool = core_pool(workers)
    futures = []
    try:
        # Largest groups first keeps the threads evenly busy.
        groups.sort(key=lambda g: -sum(_op_bytes(o) for _, o in g))
        futures = [pool.submit(replay_group, g) for g in groups]
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=0.1, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            for f in done:
                f.result()
            check()
    except BaseException:
        stop.set()
        for f in futures:
            f.cancel()
        raise
    finally:
        # The pool is the process's: wait for this replay's tasks, not for the pool to end.
        concurrent.futures.wait(futures)


def _results(run: _Run, p: Plan) -> dict[int, torch.Tensor]:
    for s in p.targets:
        if isinstance(run.env[id(s)], _ShapeMismatch):
            raise run.env[id(s)].error()
    out = {id(s): run.env[id(s)] for s in p.targets}
    for sid in run.last_use:
        if sid in run.env and run.last_use[sid] == len(p.ops):
            out.setdefault(sid, run.env[sid])
    return out


def _constant_value(r: TensorRecord) -> torch.Tensor | None:
    """The kept data of a storage that is a constant never written since (the user's
    ``torch.tensor(...)`` inside ``meta_init``), laid out as the whole storage; else None."""
    writes = r.storage.writes
    if len(writes) != 1 or writes[0].func is not constant_op:
        return None
    data = writes[0].args[0].tensor
    whole = data.is_contiguous() and data.storage_offset() == 0
    if not whole or data.numel() * data.element_size() != r.storage.nbytes:
        return None
    return data


def compute_values(records: list[TensorRecord]) -> list[torch.Tensor]:
    """Exact current values of deferred tensors on the CPU, without changing them.

    Continues from values earlier reads computed (``_values``) and keeps what it computes for
    the next read, within the cache's budget.
    """
    constants = [_constant_value(r) for r in records]
    if all(c is not None for c in constants):  # ``torch.tensor(0.5).item()``: nothing to run
        with plain():
            return [real_view(c, r).clone() for c, r in zip(constants, records, strict=True)]
    with handling_interrupts(), exclusive("reading values of deferred tensors"):
        p = plan(records, value_cache)
        env = execute(
            p, torch.device("cpu"), "exact", retain=lambda s: s.nbytes <= value_cache.max_entry
        )
        for sid, (storage, writes) in p.versions.items():
            value = env.get(sid)
            if isinstance(value, torch.Tensor) and writes > 0:  # not a _ShapeMismatch
                value_cache.put(storage, writes, value)
        with plain():
            return [real_view(env[id(r.storage)], r).clone() for r in records]


class ReplayValueReader:
    """Recording's value reads (see ``core.record.value_reader``), answered by exact replay on
    the CPU with the shared :data:`value_cache`."""

    def values(self, records: list[TensorRecord]) -> list[torch.Tensor]:
        return compute_values(records)

    def keep(self, storage: StorageRecord, writes: int, value: torch.Tensor) -> None:
        value_cache.put(storage, writes, value)

    def forget_all(self) -> None:
        value_cache.clear()
