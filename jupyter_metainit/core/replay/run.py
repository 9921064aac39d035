"""The run engine: executing a plan on real memory, op by op, in recording order.

:func:`execute` runs a ``planning.Plan`` with every interception off, each op on the device it was
recorded for (or the one asked for), freeing intermediates as soon as nothing later reads them,
and independent groups on threads where the random mode allows (``parallel``). Random ops go to
the random mode chosen once per replay (``random_modes``: exact or fast); a shard's fill may be
cut to the part the shard needs (``shards``). :func:`real_view` gives a record's view of a real
storage (used by materialize too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.record.dispatch.metadata import made_pinned
from jupyter_metainit.core.record.graph import (
    Constant,
    External,
    GradCall,
    OpRecord,
    StorageRecord,
    TensorRecord,
    constant_op,
)
from jupyter_metainit.core.record.state import default_dtype_as
from jupyter_metainit.core.replay.grads import GradSpans, detached
from jupyter_metainit.core.replay.parallel import run_parallel
from jupyter_metainit.core.replay.planning import Plan, last_writes
from jupyter_metainit.core.replay.random_modes import random_mode
from jupyter_metainit.core.replay.realized import geometry_matches, real_view
from jupyter_metainit.core.replay.shards import (
    copied_once,
    copy_from_pending_fill,
    fill_region,
    noted_whole,
    read_extents,
)
from jupyter_metainit.core.replay.steps import Progress, bytes_written, counting_ops
from jupyter_metainit.core.replay.stream_fills import Filled, run_stream_fills
from jupyter_metainit.core.rng.split_fill import MIN_SKIP
from jupyter_metainit.core.runtime.digest import digest
from jupyter_metainit.core.runtime.interrupts import Steps, counting, current_meter
from jupyter_metainit.core.runtime.plain import map_args, plain
from jupyter_metainit.core.runtime.pool import available_cores

__all__ = ["Progress", "Run", "execute", "real_view"]

aten = torch.ops.aten
_CPU = torch.device("cpu")


class _ShapeMismatch:
    """Stands in for an output whose real shape is not the one its meta kernel reported."""

    def __init__(self, op: OpRecord, real: tuple, recorded: tuple) -> None:
        self.op, self.real_shape, self.recorded = op, real, recorded

    def error(self) -> MaterializationError:
        source = (
            "its inputs' values gave"
            if self.op.shape_from_values
            else "PyTorch's meta kernel reported"
        )
        return MaterializationError(
            f"{self.op.func} (called at {self.op.where}) returns a tensor of shape "
            f"{self.real_shape} here, but {source} {self.recorded} when it was recorded; this "
            "output cannot be materialized (its other outputs can)"
        )


class Run:
    """State of one replay: real storages, generator positions, progress."""

    def __init__(
        self,
        p: Plan,
        device: torch.device | None,
        rng: str,
        progress: Progress | None,
        retain: Callable[[StorageRecord], bool] | None,
    ) -> None:
        self.plan = p
        self.device = device
        self.random = random_mode(rng)  # exact or fast, chosen once
        self.exact_ops = self.random.exact_ops(p.ops)  # random ops a recorded shape fixes
        self.env: dict[int, torch.Tensor] = {}
        self.progress = progress
        # progress inside ops and their stop: this call's, or its caller's (``save``'s)
        self.steps = Steps(progress.inside) if progress is not None else current_meter().steps
        self.last_phase = ""
        # op index -> targets whose memory is final once that op has run
        self.finishing: dict[int, list[StorageRecord]] = {}
        if progress is not None:
            last_write = last_writes(p)
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
        self._noted = noted_whole()  # captured here: fast mode replays in worker threads
        self._extents: dict[int, tuple[int, int]] | None = None  # computed on first need
        self._copied_once: set[int] | None = None
        # storage id -> a fill not run yet: its only reader copies a slice of it (a shard)
        self.pending_fills: dict[int, tuple[OpRecord, tuple, dict, torch.Generator]] = {}
        # nbytes -> an untyped CPU storage to allocate into (``execute(memory=...)``)
        self.memory: Callable[[int], torch.UntypedStorage] | None = None
        self.grads = GradSpans.of(p.ops)  # gradients taken while recording (None: none)

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
            base = self.allocate(created, device)
            self.env[id(r.storage)] = base
        return real_view(base, r)

    def allocate(self, created: TensorRecord, device: torch.device) -> torch.Tensor:
        """Empty memory for a storage whose creating op was dead: from ``memory`` (the caller's
        recycled CPU buffers, ``execute(memory=...)``) where given, else new (page-locked where
        that op made it so, ``empty(..., pin_memory=True)``, as eager)."""
        if self.memory is not None and device.type == "cpu" and created.offset == 0:
            t = torch.empty(0, dtype=created.dtype)
            t.set_(self.memory(created.storage.nbytes), 0, created.size, created.stride)
            return t
        return torch.empty_strided(
            created.size,
            created.stride,
            dtype=created.dtype,
            device=device,
            pin_memory=made_pinned(created.storage, device),
        )

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
        if self.grads is None:
            partial = self._run_op(index, op, device, None)
        else:  # a gradient taken later: the nodes of its graph in grad mode (``grads``)
            with self.grads.mode(op):
                in_span = op.seq in self.grads.span
                partial = self._run_op(index, op, device, self.grads if in_span else None)
        if self._noted is not None and not partial:
            self._note_whole(op)
        self.finished(index)

    def _run_op(
        self, index: int, op: OpRecord, device: torch.device, grads: GradSpans | None
    ) -> bool:
        """Run op number ``index`` (an ATen op, or a gradient call), store its outputs; whether
        only part of them was generated (``random_modes``)."""
        if isinstance(op, GradCall) and grads is not None:
            self._store(op, grads.gradients(self, op, device))
            return False
        if grads is None:
            # ATen arguments nest one list deep at most: map_args, not pytree (per op, it shows)
            args, kwargs = map_args(lambda x: self.arg(x, device), op.args, op.kwargs)
        else:
            args, kwargs = grads.arguments(self, op, device)
        if "device" in kwargs:
            kwargs["device"] = device
        partial = False
        with default_dtype_as(op.default_dtype):
            if op.rng is not None:
                self.phase("generating random values")
                with counting_ops(self, [index], bytes_written(op, args)):
                    out, partial = self.random.run_random(self, op, args, kwargs, device)
            else:
                self.phase("computing")
                out = op.func(*args, **kwargs)
        self._store(op, out if isinstance(out, (tuple, list)) else (out,))
        return partial

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
            if not geometry_matches(o, rec):
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

    def _copy_from_pending_fill(self, op: OpRecord, device: torch.device) -> bool:
        return copy_from_pending_fill(self, op, device)

    def copied_once(self) -> set[int]:
        """Storages whose only read is a ``copy_`` of a shard (``shards.copied_once``)."""
        if self._copied_once is None:
            self._copied_once = copied_once(self.plan, self._keep)
        return self._copied_once

    def region(self, op: OpRecord) -> tuple[int, int] | None:
        """The part of ``op``'s fill later ops read, when it is a small part (``shards``)."""
        return fill_region(op, self.read_extents)

    def read_extents(self) -> dict[int, tuple[int, int]]:
        """``shards.read_extents`` of this plan, computed on first need."""
        if self._extents is None:
            self._extents = read_extents(self.plan, self._keep)
        return self._extents

    def burn_progress(self, nbytes: int) -> None:
        self.phase("regenerating the random stream up to this part (no memory)")

    def run_and_release(self, index: int, op: OpRecord) -> None:
        """Run op number ``index``, then free what nothing later reads."""
        self.run(index, op)
        self.release(index, op)

    def release(self, index: int, op: OpRecord) -> None:
        for s in op.reads:
            if self.last_use.get(id(s)) == index:
                self.env.pop(id(s), None)


def _copy_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` over a copy of its whole storage (same geometry, offset included)."""
    copy = torch.empty(0, dtype=t.dtype, device=t.device)
    copy.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())
    return copy


def execute(
    p: Plan,
    device: torch.device | None = None,
    rng: str = "exact",
    progress: Progress | None = None,
    threads: int | None = None,
    retain: Callable[[StorageRecord], bool] | None = None,
    one_stream: bool = False,
    memory: Callable[[int], torch.UntypedStorage] | None = None,
    on_filled: Filled | None = None,
) -> dict[int, torch.Tensor]:
    """Run ``p``; return the real storages of its targets (and of the storages ``retain``
    accepts), keyed by ``id(StorageRecord)``.

    Runs with every interception off (``plain``), outside inference mode, and with each op's
    recorded default dtype, so the result does not depend on what is in force at the time.
    ``one_stream`` (exact mode on the CPU, a batch of whole tensors each made by one fill):
    the fills run as one stream cut across the cores (``stream_fills``) where they can.
    ``memory(nbytes)``: an untyped CPU storage of that size for each storage the plan
    allocates empty (recycled buffers: no page faults of new memory); ``on_filled``: told of
    each part of those fills as it is final (``stream_fills``).
    """
    with plain(), torch.inference_mode(False):
        run = Run(p, device, rng, progress, retain)
        run.memory = memory
        # work outside any op's own count: only a caller without progress counts its bytes
        with counting(run.steps, 0.0 if progress is not None else 1.0):
            _run_plan(run, p, threads, one_stream, on_filled)
    return _results(run, p)


def _run_plan(
    run: Run, p: Plan, threads: int | None, one_stream: bool, on_filled: Filled | None
) -> None:
    """``execute``'s work: the fills as one stream, the parallel groups, or op after op."""
    workers, done = threads or (available_cores() if one_stream or len(p.ops) > 1 else 1), set()
    workers = workers if run.grads is None else 1  # a graph is built in order, on one thread
    if one_stream and run.random.fills_as_one_stream and workers > 1 and run.device == _CPU:
        done = run_stream_fills(run, p.ops, workers, on_filled)  # a lone fill's too
    cores = workers if len(p.ops) > 1 else 1
    split = run.random.parallel_groups(p.ops, cores) if cores > 1 and not done else None
    if split is not None:
        groups, workers = split
        run_parallel(run.run_and_release, groups, workers)
        return
    for i, op in enumerate(p.ops):
        run.steps.step()  # a Cancel or a held-back Ctrl-C stops here, between two ops
        if i not in done:
            run.run_and_release(i, op)


def _results(run: Run, p: Plan) -> dict[int, torch.Tensor]:
    for s in p.targets:
        if isinstance(run.env[id(s)], _ShapeMismatch):
            raise run.env[id(s)].error()
    out = {id(s): run.env[id(s)] for s in p.targets}
    for sid in run.last_use:
        if sid in run.env and run.last_use[sid] == len(p.ops):
            out.setdefault(sid, run.env[sid])
    return out if run.grads is None else detached(out)
