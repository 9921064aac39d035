"""Random-number policy: where each deferred random op sits in its generator's stream.

Eager construction draws from a generator (usually the default CPU one) in program order. An op
without an explicit generator draws from the default generator of its device: the CPU one, or,
for a tensor recorded for a GPU present at recording, that GPU's default CUDA generator
(``default_generator_for``; a GPU absent at recording, ``cuda:1`` on a CPU-only machine, gets the
CPU stream).
Recording draws nothing, so each random op is stored as ``(segment, index)``: a *segment* is a
run of deferred random ops that would have consumed one generator back to back, starting from
``start_state``.

* ``exact`` mode replays op ``index`` from the generator state it would have had eagerly. Reaching
  it means moving the generator past every earlier op of the segment: for ops whose consumption
  is a known number of 32-bit draws (``uniform_``, ``normal_``, ``random_``, ``randint``, ...;
  each formula is checked against the real kernel once per process), by MT19937 jump-ahead in
  milliseconds; for other random ops by re-running them on scratch memory. The state before
  every op reached that way is kept as a checkpoint, so later calls start from the nearest one.
* ``fast`` mode gives op ``index`` its own generator seeded from a hash of the segment's start
  state and ``index``: deterministic, independent of order, grouping and threads, and usable on
  any device. It never touches a global generator.

The real generator after a deferred build
    is where eager construction leaves it. Recording keeps, per generator, the exact state at
    the last op boundary it computed plus the draws of the known-count ops recorded since
    (``pending``), and *flushes* (one jump-ahead for all of them) whenever the real state can be
    observed: when the outermost ``meta_init`` block exits, before a real random op runs inside
    one, when ``torch.get_rng_state()``/``fork_rng``/``g.get_state()``/``g.clone_state()``/
    pickling reads it (``exact_state``), and after every op recorded outside a block. An op
    whose draw count is not known is run on scratch memory at recording time, from the exact
    state, so the stream stays exact; an op whose draw count depends on the
    values it reads (``poisson``, ``torch.distributions`` sampling) runs on its real inputs, and
    the state it ends in is kept for good (``RngSegment.fixed``). While draws are pending the
    real generator is left at a *mark* (``_marks``), a state no real generator holds, new for
    every op: reseeding (even with the same seed) or ``set_rng_state`` between two recorded ops
    is seen, and starts a new segment from the state the user set, exactly as eager code sees
    it; a mark that still reaches user code and is restored stands for the exact state.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from jupyter_metainit.core.errors import MetaInitError
from jupyter_metainit.core.rng.draws import known_draws
from jupyter_metainit.core.rng.positions import advance_state, run_on_scratch
from jupyter_metainit.core.rng.scratch import run_random
from jupyter_metainit.core.rng.segments import (
    BurnSpec,
    RngSegment,
    live_segments,
    raw_get_state,
    raw_set_state,
)
from jupyter_metainit.core.runtime.interrupts import critical
from jupyter_metainit.core.runtime.plain import plain

__all__ = [
    "before_real_draw",
    "exact_state",
    "flush_all",
    "flush_default",
    "forget_generators",
    "live_segments",
    "record_random",
    "settle",
    "true_state",
]


class _Tracker:
    """What recording knows about one real generator (see the module docstring).

    The segment is held weakly: the records of its ops (so the deferred tensors of one build)
    own it and its checkpoints, which go when the model goes; the next op recorded after that
    starts a new segment from the exact state (:meth:`current_segment`).
    """

    __slots__ = ("_segment", "exact", "generator", "marked", "pending")

    def __init__(self, generator: torch.Generator, state: torch.Tensor) -> None:
        self.generator = generator
        self.exact = state  # the stream's state after the ops recorded so far, minus `pending`
        self.pending = 0  # draws of known-count ops recorded after `exact`
        self.marked = state  # the state we left the real generator in
        self._segment: weakref.ref[RngSegment] | None = None

    @property
    def segment(self) -> RngSegment | None:
        """The segment new ops join, while anything (a record) still holds it."""
        return self._segment() if self._segment is not None else None

    def current_segment(self) -> RngSegment:
        """The segment the next op joins: a new one, from the exact state, once the last one's
        ops are all gone (nothing can replay them any more)."""
        segment = self.segment
        if segment is None:
            self.exact, self.pending = advance_state(self.exact, self.pending), 0
            segment = RngSegment(self.exact, self.generator.device)
            self._segment = weakref.ref(segment)
        return segment


# By the C++ generator (``_cdata``): an explicit generator reaches the recorder as a new Python
# object for every op, the same one the user holds only for default generators. A tracker keeps
# its generator alive, so the address is never reused while it is kept.
_trackers: dict[int, _Tracker] = {}


_lock = threading.RLock()


# Every state we left a real generator in while draws were pending (a *mark*), by digest, with
# what makes it the exact position it stands for: the ``left``/``next`` fields it replaced and
# the draws pending then (the exact state is the mark's words with those fields put back,
# advanced by those draws). Nothing of a build (its segment, its checkpoints) is kept here, so
# a mark outlives the model it was made for and still resolves. A mark is the
# exact state with its ``left``/``next`` fields (see ``mt19937``) set to a pair no generator
# ever holds (a draw keeps ``left + next == 625``, seeding sets ``(1, 0)``; marks take pairs with
# ``left + next < 625``), from a process-wide counter cycling through ~194,000 pairs: no
# ``manual_seed``/``set_state`` of a real state gives it, and each recorded op gets a new one.
# While a block is active, ``g.get_state()`` (and ``clone_state``, pickling) flush first and so
# never hand a mark out (``process_wrappers``); a mark that still reaches a generator (saved
# through a path not wrapped) is recognized when restored (``g.set_state(st)``, also on another
# generator) and stands for the exact state eager code would have saved; a restore is never
# mistaken for no change.
_marks: OrderedDict[bytes, tuple[bytes, bytes, int]] = OrderedDict()


_MARKS_KEPT = 1 << 16


_STATE_BYTES = 5056  # a CPU generator's state (see ``mt19937``); only CPU ones are marked


_MT_N = 624


_mark_count = 0


# A mark is told apart by its seed, left/next fields and first words: real states never share a
# mark's left/next pair, and two marks with the same pair differ in their words.
_KEY_BYTES = 24 + 8 * 16


def _state_key(state: torch.Tensor) -> bytes:
    return state[:_KEY_BYTES].numpy().tobytes()


def true_state(state: torch.Tensor) -> torch.Tensor | None:
    """The exact state a mark stands for, or None if ``state`` is not one of our marks."""
    if state.dtype != torch.uint8 or state.numel() != _STATE_BYTES:
        return None
    with _lock:
        found = _marks.get(_state_key(state))
    if found is None:
        return None
    left, position, pending = found
    exact = state.clone()
    data = exact.numpy()
    data[8:12] = np.frombuffer(left, dtype=np.uint8)
    data[16:24] = np.frombuffer(position, dtype=np.uint8)
    return advance_state(exact, pending)


def _next_mark_fields() -> tuple[int, int]:
    """The next (left, next) pair no real generator state has, cycling through all of them."""
    global _mark_count
    while True:
        _mark_count += 1
        left = 1 + _mark_count % _MT_N
        position = (_mark_count // _MT_N) % _MT_N
        # left + next < 625: drawing from a mark by mistake reads inside the block, no further
        if left + position <= _MT_N and (left, position) != (1, 0):
            return left, position


def _new_mark(tracker: _Tracker) -> torch.Tensor:
    mark = tracker.exact.clone()
    data = mark.numpy()  # bytes edited in numpy: tensor indexing would cost more than the record
    replaced = (data[8:12].tobytes(), data[16:24].tobytes(), tracker.pending)
    left, position = _next_mark_fields()
    data[8:12] = np.frombuffer(left.to_bytes(4, "little"), dtype=np.uint8)
    data[16:24] = np.frombuffer(position.to_bytes(8, "little"), dtype=np.uint8)
    _marks[data[:_KEY_BYTES].tobytes()] = replaced
    while len(_marks) > _MARKS_KEPT:
        _marks.popitem(last=False)
    return mark


def _mark(tracker: _Tracker) -> None:
    """Leave the real generator at the exact state, or, while draws are pending, at a fresh
    mark (see ``_marks``): reseeding or ``set_state`` between two recorded ops is then seen."""
    state = _new_mark(tracker) if tracker.pending else tracker.exact
    raw_set_state(tracker.generator, state)
    tracker.marked = state


def _forget_idle_trackers() -> None:
    """Drop the trackers of generators whose builds are gone: no op of theirs is left to replay
    and nothing is pending (the generator holds its exact state), so a new tracker made from
    its state, if it is used again, is the same. A tracker keeps its generator alive: without
    this, a notebook that makes a ``torch.Generator()`` in each rebuilt model keeps every one."""
    for key, tracker in list(_trackers.items()):
        if not tracker.pending and tracker.segment is None:
            del _trackers[key]


def record_random(
    generator: torch.Generator | None,
    spec: BurnSpec,
    *,
    flush_now: bool,
    run: Callable[[torch.Generator | None], Any] | None = None,
) -> tuple[RngSegment, int, Any]:
    """Place a new deferred random op in its generator's stream; returns (segment, index, the
    op's real outputs when ``run`` was given, else None).

    ``flush_now``: bring the real generator to its exact state right away (ops recorded outside
    ``meta_init``, where nothing tells us when the state is next observed). ``run``: the op on
    its real input values, for ops whose draw count depends on them (``draws_depend_on_values``):
    it runs from the exact state, and the state it ends in is kept (``RngSegment.add_fixed``).
    """
    gen = generator if generator is not None else torch.default_generator
    result = None
    with plain(), _lock:
        state = raw_get_state(gen)
        tracker = _trackers.get(gen._cdata)
        if (
            tracker is None
            or tracker.generator._cdata != gen._cdata
            or not torch.equal(tracker.marked, state)
        ):
            # A new stream: the user set the state (or this is the generator's first op). A
            # state saved from one of our marks stands for the exact state at that point.
            restored = true_state(state) if gen.device.type == "cpu" else None
            tracker = _Tracker(gen, restored if restored is not None else state)
            _forget_idle_trackers()
            _trackers[gen._cdata] = tracker
        segment = tracker.current_segment()
        index = len(segment.specs)
        segment.specs.append(spec)
        draws = known_draws(spec, gen.device)
        if draws is not None:
            tracker.pending += draws
        else:
            try:
                current = advance_state(tracker.exact, tracker.pending)
                if run is not None:
                    real = torch.Generator(device=gen.device)
                    real.set_state(current)
                    result = run_random(run, real, spec.has_generator)
                    after = raw_get_state(real)
                else:
                    after = run_on_scratch(spec, current, gen.device)
            except BaseException as e:
                segment.specs.pop()  # not recorded: the stream stays as it was
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    raise MetaInitError(
                        f"{spec.func} draws from {gen.device}'s generator: to follow that stream "
                        f"exactly it runs once at recording, on {spec.nbytes:,} bytes of scratch "
                        f"memory on {gen.device}, and they do not fit; free memory there, or "
                        "record for the CPU (meta_init(device='cpu'): the CPU stream's values) "
                        "and materialize(..., device='cuda')"
                    ) from e
                raise
            tracker.exact, tracker.pending = after, 0
            if run is not None:
                segment.add_fixed(index + 1, after)
            else:
                segment.add_checkpoint(index + 1, after)
        if flush_now:
            _flush(tracker)
        else:
            _mark(tracker)
    return segment, index, result


def _flush(tracker: _Tracker) -> None:
    gen = tracker.generator
    state = raw_get_state(gen)
    if not torch.equal(state, tracker.marked):
        # Someone set the generator since: their state stands, unless it is one of our marks
        # (saved with ``get_state()`` during the build), which stands for an exact state.
        restored = true_state(state) if gen.device.type == "cpu" else None
        if restored is not None:
            raw_set_state(gen, restored)
        return
    if tracker.pending:
        tracker.exact = advance_state(tracker.exact, tracker.pending)
        tracker.pending = 0
        segment = tracker.segment
        if segment is not None:
            segment.add_checkpoint(len(segment.specs), tracker.exact)
    _mark(tracker)


def flush_all() -> None:
    """Bring every followed generator to the state eager construction would have left."""
    with plain(), _lock:
        for tracker in list(_trackers.values()):
            _flush(tracker)


def before_real_draw(generator: torch.Generator | None) -> None:
    """Real random work is about to draw from ``generator`` (None: the default CPU one): every
    followed generator is brought to its exact state, and ``generator`` too if it holds a mark
    copied from another one (``other.set_state(g.get_state())``)."""
    gen = generator if generator is not None else torch.default_generator
    with plain(), _lock:
        flush_all()
        if gen.device.type == "cpu":
            restored = true_state(raw_get_state(gen))
            if restored is not None:
                raw_set_state(gen, restored)


def flush_default() -> None:
    """``flush_all`` for the default CPU generator only (``torch.get_rng_state`` reads it)."""
    _flush_generator(torch.default_generator)


def _flush_generator(generator: torch.Generator) -> None:
    with plain(), _lock:
        tracker = _trackers.get(generator._cdata)
        if tracker is not None:
            _flush(tracker)


def exact_state(generator: torch.Generator) -> torch.Tensor:
    """Flush ``generator`` and return its state: where eager code would have it now."""
    with plain(), _lock:
        _flush_generator(generator)
        return raw_get_state(generator)


def settle(segment: RngSegment, index: int, state: torch.Tensor) -> bool:
    """Op ``index`` of ``segment`` left its generator in ``state`` (known by running it on
    scratch memory): nothing stays pending to jump over at the next flush.

    Only taken while that op is the last recorded and the only one pending; returns whether it
    was (otherwise the stream stays exact the usual way, by a jump at the next flush)."""
    with plain(), _lock:
        for tracker in _trackers.values():
            if tracker.segment is not segment:
                continue
            gen = tracker.generator
            if (
                len(segment.specs) != index + 1
                or tracker.pending != known_draws(segment.specs[index], gen.device)
                or not torch.equal(raw_get_state(gen), tracker.marked)
            ):
                return False
            tracker.exact, tracker.pending = state, 0
            segment.add_checkpoint(index + 1, state)
            _mark(tracker)
            return True
        return False


def forget_generators() -> None:
    """Drop stream tracking (``clear_meta_init_cache``): the next random op starts a segment."""
    with critical(), _lock:
        flush_all()
        _trackers.clear()
        _marks.clear()
