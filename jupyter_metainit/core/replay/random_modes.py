"""Exact and fast random modes: the two strategies the run engine calls for random ops.

* :class:`ExactRandom` (``rng="exact"``) gives every random op the values eager code gives: each
  generator's stream is replayed in order, a generator moved to an op's position by jump-ahead
  or regeneration (``rng.streams.state_before``); the plan may split on threads only at runs of
  the stream (``parallel.stream_parts``).
* :class:`FastRandom` (``rng="fast"``) gives each random op a stream of its own
  (``rng.streams.fast_generator``): deterministic, not eager's values, and any independent
  groups of ops may run on threads of their own (``parallel.components``). Random ops whose
  values an op's recorded *shape* was computed from (``nonzero(rand(6) > 0.5)``) run exact:
  other values would give another shape (:func:`shape_fixing_random_ops`).

The engine (``run.Run``) picks one with :func:`random_mode` once per replay and calls only
``exact_ops``, ``run_random``, ``fill_end`` and ``parallel_groups``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map

from jupyter_metainit.core.record.graph import OpRecord
from jupyter_metainit.core.replay.parallel import components, stream_parts
from jupyter_metainit.core.rng.draws import known_draws
from jupyter_metainit.core.rng.native_fill import native_call
from jupyter_metainit.core.rng.positions import fast_generator, state_before
from jupyter_metainit.core.rng.scratch import run_random
from jupyter_metainit.core.rng.split_fill import FILLS, fill_region, split_fill

__all__ = [
    "ExactRandom",
    "FastRandom",
    "RandomMode",
    "call_with_generator",
    "random_mode",
    "shape_fixing_random_ops",
]

Groups = list[list[tuple[int, OpRecord]]]


class RandomRun(Protocol):
    """What a random mode uses of the replay it runs in (``run.Run``)."""

    # stream id -> (generator, index of the op it is right before), per thread
    generators: dict[int, tuple[torch.Generator, int]]
    # storage id -> a fill not run yet: its only reader copies a slice of it (a shard)
    pending_fills: dict[int, tuple[OpRecord, tuple, dict, torch.Generator]]

    def copied_once(self) -> set[int]: ...

    def region(self, op: OpRecord) -> tuple[int, int] | None: ...

    def burn_progress(self, nbytes: int) -> None: ...

    # ``seq`` of the random ops to run exact whatever the mode (``RandomMode.exact_ops``)
    exact_ops: frozenset[int]


class RandomMode:
    """The interface the run engine calls; :class:`ExactRandom` and :class:`FastRandom`."""

    name = ""
    # Whether a batch of whole-tensor fills may run as one generator stream cut across the
    # cores (``stream_fills``): exact mode's values are one stream, so cutting it is exact.
    fills_as_one_stream = False

    def exact_ops(self, ops: list[OpRecord]) -> frozenset[int]:
        """``seq`` of the plan's random ops that must give eager's values in this mode."""
        return frozenset()

    def run_random(
        self, run: RandomRun, op: OpRecord, args: tuple, kwargs: dict, device: torch.device
    ) -> tuple[Any, bool]:
        """Run a recorded random op; returns its output and whether only part of its output
        was generated (a shard's region, or a fill left for the copy that cuts the shard)."""
        raise NotImplementedError

    def fill_end(self, fill_op: OpRecord) -> Callable[[torch.Tensor], None] | None:
        """What to do with the generator state when a shard's fill runs to the fill's end."""
        return None

    def parallel_groups(self, ops: list[OpRecord], cores: int) -> tuple[Groups, int] | None:
        """The plan's ops in groups to replay on threads, and how many threads; None: serial."""
        return None


def _fill_facts(
    run: RandomRun, op: OpRecord, device: torch.device
) -> tuple[bool, tuple[int, int] | None, bool]:
    """Whether ``op`` takes a generator; the region of it later ops read (a shard), if small;
    and whether it is a CPU fill whose only read copies that region (fused into the copy)."""
    has_gen = "generator" in [a.name for a in op.func._schema.arguments]
    region = run.region(op)
    fusable = (
        has_gen
        and op.func in FILLS
        and device.type == "cpu"
        and region is not None
        and id(op.args[0].storage) in run.copied_once()
    )
    return has_gen, region, fusable


class FastRandom(RandomMode):
    """One stream per random op: deterministic, parallel by construction."""

    name = "fast"

    def exact_ops(self, ops: list[OpRecord]) -> frozenset[int]:
        return shape_fixing_random_ops(ops)

    def run_random(
        self, run: RandomRun, op: OpRecord, args: tuple, kwargs: dict, device: torch.device
    ) -> tuple[Any, bool]:
        if op.seq in run.exact_ops:
            return RANDOM_MODES["exact"].run_random(run, op, args, kwargs, device)
        has_gen, region, fusable = _fill_facts(run, op, device)
        gen = fast_generator(op.rng.segment, op.rng.index, device)
        if fusable:
            run.pending_fills[id(op.args[0].storage)] = (op, args[1:], kwargs, gen)
            return args[0], True
        if region is not None:
            out = run_from(op, args, kwargs, gen, has_gen, region)
            if out is not None:
                return out, True
        return run_from(op, args, kwargs, gen, has_gen, None), False  # a large CPU fill in steps

    def parallel_groups(self, ops: list[OpRecord], cores: int) -> tuple[Groups, int] | None:
        groups = components(ops)
        workers = min(cores, len(groups))
        return (groups, workers) if workers > 1 else None


class ExactRandom(RandomMode):
    """Eager's values: each generator's stream replayed in order, from exact positions."""

    name = "exact"
    fills_as_one_stream = True

    def run_random(
        self, run: RandomRun, op: OpRecord, args: tuple, kwargs: dict, device: torch.device
    ) -> tuple[Any, bool]:
        has_gen, region, fusable = _fill_facts(run, op, device)
        seg, index = op.rng.segment, op.rng.index
        gen_dev = seg.device
        current = run.generators.get(id(seg))
        if current is not None and current[1] == index:
            gen = current[0]
        else:
            gen = torch.Generator(device=gen_dev)
            gen.set_state(state_before(seg, index, run.burn_progress))
        if device != gen_dev:
            out = _run_on_generator_device(op, args, kwargs, gen, has_gen, gen_dev, device)
        else:
            if region is not None and known_draws(seg.specs[index], gen_dev) is None:
                region = None  # the next op could not jump past the rest of this one
            if region is not None and fusable:
                # Run later, by the copy that reads the shard's slice (_copy_from_pending_fill);
                # the next op of this stream jumps past it from the checkpoint before it.
                run.pending_fills[id(op.args[0].storage)] = (op, args[1:], kwargs, gen)
                run.generators.pop(id(seg), None)
                return args[0], True
            if region is not None:
                out = run_from(op, args, kwargs, gen, has_gen, region)
                if out is not None:
                    # Only the region was drawn: the generator is not at the op's end. The
                    # next op of this stream starts from the checkpoint before this one and
                    # jumps past it (and whatever it skips too): one jump instead of two.
                    run.generators.pop(id(seg), None)
                    return out, True
            out = run_from(op, args, kwargs, gen, has_gen, None)
        run.generators[id(seg)] = (gen, index + 1)
        seg.add_checkpoint(index + 1, gen.get_state())
        return out, False

    def fill_end(self, fill_op: OpRecord) -> Callable[[torch.Tensor], None] | None:
        if fill_op.rng is None:
            return None
        seg, index = fill_op.rng.segment, fill_op.rng.index

        def at_end(state: torch.Tensor) -> None:
            # The shard ran to the fill's end (the last rank's): the next fill of this
            # stream starts right here, without a jump.
            seg.add_checkpoint(index + 1, state)

        return at_end

    def parallel_groups(self, ops: list[OpRecord], cores: int) -> tuple[Groups, int] | None:
        parts = stream_parts(ops, cores)
        return (parts, len(parts)) if parts is not None else None


RANDOM_MODES: dict[str, RandomMode] = {"exact": ExactRandom(), "fast": FastRandom()}


def random_mode(name: str | None) -> RandomMode:
    """The strategy for ``rng=name`` (``"exact"`` or ``"fast"``; None: exact)."""
    try:
        return RANDOM_MODES["exact" if name is None else name]
    except KeyError:
        raise ValueError(f"rng must be 'exact' or 'fast', not {name!r}") from None


def shape_fixing_random_ops(ops: list[OpRecord]) -> frozenset[int]:
    """``seq`` of the random ops among ``ops`` (a plan, in recording order) whose values an op
    recorded with ``shape_from_values`` depends on, directly or through other ops.

    Such an op (``nonzero``, ``unique``, ``masked_select``) has the shape its inputs' exact
    values gave when it was recorded, and every deferred tensor after it was recorded with that
    shape: replayed from other random values it would give another one. Found by one pass
    backwards, following the storages each needed op reads to the ops that write them.
    """
    if not any(op.shape_from_values for op in ops):
        return frozenset()
    needed: set[int] = set()  # ids of storages whose values a shape depends on
    exact: set[int] = set()
    for op in reversed(ops):
        writes = (*(r.storage for r in op.outputs if r is not None), *op.mutates)
        if op.shape_from_values or any(id(s) in needed for s in writes):
            if op.rng is not None:
                exact.add(op.seq)
            needed.update(id(s) for s in op.reads)
    return frozenset(exact)


def _run_on_generator_device(
    op: OpRecord,
    args: tuple,
    kwargs: dict,
    gen: torch.Generator,
    has_gen: bool,
    gen_dev: torch.device,
    device: torch.device,
) -> Any:
    """Exact values come from the recorded generator's device; then they are copied over."""
    cpu_args = tree_map(lambda x: _to(x, gen_dev), args)
    cpu_kwargs = tree_map(lambda x: _to(x, gen_dev), kwargs)
    if "device" in cpu_kwargs:
        cpu_kwargs["device"] = gen_dev
    out = run_from(op, cpu_args, cpu_kwargs, gen, has_gen, None)
    for i, a in enumerate(op.func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write and i < len(args):
            args[i].copy_(cpu_args[i])
    out = tree_map(lambda x: _to(x, device), out)
    if op.func._schema.returns and op.func._schema.returns[0].alias_info is not None:
        out = args[0]
    return out


def run_from(
    op: OpRecord,
    args: tuple,
    kwargs: dict,
    gen: torch.Generator,
    has_gen: bool,
    region: tuple[int, int] | None,
) -> Any:
    """Run a random op drawing from ``gen``. With ``region``: only that part (a rank's
    shard), leaving ``gen`` unmoved, or None if that was not possible. Large CPU fills run
    on all cores."""
    target = args[0] if args else None
    fill = lambda t, g: call_with_generator(op, (t, *args[1:]), kwargs, g)  # noqa: E731
    if region is not None:
        return target if has_gen and fill_region(op.func, target, fill, gen, region) else None
    if has_gen and split_fill(op.func, target, fill, gen):
        return target
    return run_random(lambda g: call_with_generator(op, args, kwargs, g), gen, has_gen)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor) and x.device != device:
        return x.to(device)
    return x


def call_with_generator(
    op: OpRecord, args: tuple, kwargs: dict, gen: torch.Generator | None
) -> Any:
    """Call ``op.func`` with ``gen`` in its generator slot (positional or keyword). A CPU
    ``normal_`` or ``uniform_`` runs on the native kernels where they apply (the same bits,
    faster: see Note [the native fills are trusted only after they are checked])."""
    if gen is not None and native_call(op.func, args, kwargs, gen):
        return args[0]
    kw = dict(kwargs)
    names = [a.name for a in op.func._schema.arguments]
    if "generator" in names:
        gi = names.index("generator")
        if gi < len(args):
            args = tuple(gen if j == gi else a for j, a in enumerate(args))
        else:
            kw["generator"] = gen
    return op.func(*args, **kw)
