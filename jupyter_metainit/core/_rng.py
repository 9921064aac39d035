"""Random-number policy: where each deferred random op sits in its generator's stream.

Eager construction draws from a generator (usually the default CPU one) in program order.
Recording draws nothing, so each random op is stored as ``(segment, index)``: a *segment* is a
run of deferred random ops that would have consumed one generator back to back, starting from
``start_state``.

* ``exact`` mode replays op ``index`` from the generator state it would have had eagerly. Reaching
  it means moving the generator past every earlier op of the segment: for ``uniform_``/``normal_``
  fills, whose consumption is a known number of draws (checked against the real kernel once per
  process), by MT19937 jump-ahead in milliseconds; for other random ops by re-running them on
  scratch memory, one at a time (memory bounded by the largest single random tensor). The state
  before every op reached that way is kept as a checkpoint, so later calls start from the nearest
  one.
* ``fast`` mode gives op ``index`` its own generator seeded from a hash of the segment's start
  state and ``index``: deterministic, independent of order and grouping, parallel-friendly, and
  usable on any device.

After each recorded random op the real generator is advanced by one draw. That marks the stream:
if the next op finds the generator in the marked state, it continues the segment; if anything
else touched the generator in between (``torch.manual_seed``, real random ops), a new segment
starts from the generator's current state, exactly as eager code would see it.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from jupyter_metainit.core._plain import plain

__all__ = ["RngSegment", "fast_generator", "record_random", "state_before"]


@dataclass(frozen=True)
class BurnSpec:
    """Enough of a random op to re-run it on scratch memory: same layout, same consumption."""

    func: Any
    args: tuple  # tensors replaced by ("tensor", size, stride, dtype)
    kwargs: dict
    has_generator: bool
    nbytes: int


class RngSegment:
    """Deferred random ops that consume one generator in order, from ``start_state``."""

    def __init__(self, start_state: torch.Tensor, device: torch.device) -> None:
        self.start_state = start_state
        self.device = device
        self.specs: list[BurnSpec] = []
        self.checkpoints: dict[int, torch.Tensor] = {0: start_state}
        self._keys: list[int] = [0]
        self.seed_key = hashlib.blake2b(start_state.numpy().tobytes(), digest_size=16).digest()
        self.lock = threading.Lock()
        _segments.add(self)

    def add_checkpoint(self, index: int, state: torch.Tensor) -> None:
        if index not in self.checkpoints:
            self.checkpoints[index] = state
            bisect.insort(self._keys, index)

    def nearest_checkpoint(self, index: int) -> int:
        return self._keys[bisect.bisect_right(self._keys, index) - 1]

    def clear_checkpoints(self) -> None:
        self.checkpoints = {0: self.start_state}
        self._keys = [0]


class _Tracker:
    __slots__ = ("expected", "generator", "segment")

    def __init__(self, generator: torch.Generator, segment: RngSegment) -> None:
        self.generator = generator
        self.segment = segment
        self.expected: torch.Tensor | None = None


_trackers: dict[int, _Tracker] = {}
_lock = threading.Lock()


def _scratch_spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, torch.Generator):
        return None
    if isinstance(x, torch.device):
        return None
    if isinstance(x, (list, tuple)):
        return type(x)(_scratch_spec(v) for v in x)
    return x


def make_spec(func: Any, args: tuple, kwargs: dict, has_generator: bool, nbytes: int) -> BurnSpec:
    kw = {k: _scratch_spec(v) for k, v in kwargs.items() if k not in ("generator", "device")}
    return BurnSpec(func, tuple(_scratch_spec(a) for a in args), kw, has_generator, nbytes)


def record_random(generator: torch.Generator | None, spec: BurnSpec) -> tuple[RngSegment, int]:
    """Place a new deferred random op in its generator's stream; returns (segment, index)."""
    gen = generator if generator is not None else torch.default_generator
    with _lock, plain():
        state = gen.get_state()
        tracker = _trackers.get(id(gen))
        if (
            tracker is None
            or tracker.generator is not gen
            or tracker.expected is None
            or not torch.equal(tracker.expected, state)
        ):
            tracker = _Tracker(gen, RngSegment(state, gen.device))
            _trackers[id(gen)] = tracker
        segment = tracker.segment
        index = len(segment.specs)
        segment.specs.append(spec)
        # Mark the stream (see module docstring): one real draw, then remember the state.
        torch.empty(1, dtype=torch.int64, device=gen.device).random_(generator=gen)
        tracker.expected = gen.get_state()
    return segment, index


def run_random(
    spec_or_call: Callable[[torch.Generator], Any], generator: torch.Generator, has_generator: bool
) -> Any:
    """Run a random op with ``generator``; ops without a generator argument use the default
    generator, which is swapped in and restored so that the caller's RNG state is untouched."""
    if has_generator:
        return spec_or_call(generator)
    default = torch.default_generator if generator.device.type == "cpu" else None
    if default is None:
        raise RuntimeError("random ops without a generator argument replay on the CPU only")
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        out = spec_or_call(None)
        generator.set_state(default.get_state())
    finally:
        default.set_state(saved)
    return out


def _scratch_op(spec: BurnSpec, generator: torch.Generator) -> None:
    """Re-run the op on scratch memory of the same layout: exact for any op, memory = its size."""
    device = generator.device

    def build(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
            _, size, stride, dtype = x
            t = torch.empty_strided(size, stride, dtype=dtype, device=device)
            return t.zero_() if spec.func is not torch.ops.aten.multinomial.default else t.fill_(1)
        if isinstance(x, (list, tuple)):
            return type(x)(build(v) for v in x)
        return x

    args = tuple(build(a) for a in spec.args)
    kwargs = {k: build(v) for k, v in spec.kwargs.items()}

    def call(gen: torch.Generator | None) -> Any:
        kw = dict(kwargs)
        if gen is not None:
            kw["generator"] = gen
        if any(a.name == "device" for a in spec.func._schema.arguments):
            kw["device"] = device
        return spec.func(*args, **kw)

    run_random(call, generator, spec.has_generator)


# Draws (32-bit outputs of mt19937) that common CPU random fills consume, by element count.
# uniform_ takes one draw per element below double precision; normal_ on a contiguous tensor of
# at least 16 elements draws in blocks of 16: float32 fills uniforms, then redraws the last 16
# when the size is not a multiple of 16 (ATen's normal_fill); half types round up to a block.
# Each formula is checked against the real kernel once per process before it is trusted (see
# _formula_holds), so a different PyTorch build falls back safely.
_CHUNK = 1 << 20


def _draws(spec: BurnSpec) -> int | None:
    if spec.func not in (torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default):
        return None
    target = spec.args[0]
    if not (isinstance(target, tuple) and len(target) == 4 and target[0] == "tensor"):
        return None
    _, size, stride, dtype = target
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    n = 1
    for s in size:
        n *= s
    if spec.func is torch.ops.aten.uniform_.default:
        return n
    contiguous = torch.empty_strided(size, stride, device="meta").is_contiguous()
    if n < 16 or not contiguous:
        return None
    if dtype == torch.float32:
        return n + (16 if n % 16 else 0)
    return -(-n // 16) * 16  # half types: whole blocks of 16


_verified: dict[tuple, bool] = {}


def _formula_holds(spec: BurnSpec) -> bool:
    key = (spec.func, spec.args[0][3])
    ok = _verified.get(key)
    if ok is None:
        ok = True
        for n in (37, 64, 1000):
            probe = BurnSpec(spec.func, (("tensor", (n,), (1,), key[1]),), {}, True, 0)
            a, b = torch.Generator(), torch.Generator()
            a.manual_seed(n)
            b.manual_seed(n)
            _scratch_op(probe, a)
            _advance(b, _draws(probe) or 0)
            ok = ok and torch.equal(a.get_state(), b.get_state())
        _verified[key] = ok
    return ok


_JUMP_ABOVE = 4 << 20  # below this many draws, generating them is faster than jumping


def _advance(generator: torch.Generator, draws: int) -> None:
    """Move ``generator`` past ``draws`` 32-bit outputs.

    Large distances use MT19937 jump-ahead (``_mt19937``: milliseconds for any distance); small
    ones consume the draws in 4 MiB chunks.
    """
    if draws > _JUMP_ABOVE and generator.device.type == "cpu":
        from jupyter_metainit.core._mt19937 import jump_state

        generator.set_state(jump_state(generator.get_state(), draws))
        return
    buf = torch.empty(min(draws, _CHUNK), dtype=torch.float32, device=generator.device)
    while draws > 0:
        k = min(draws, _CHUNK)
        buf[:k].uniform_(generator=generator)
        draws -= k


def _known_draws(spec: BurnSpec, generator: torch.Generator) -> int | None:
    draws = _draws(spec) if generator.device.type == "cpu" else None
    return draws if draws is not None and _formula_holds(spec) else None


def _burn(spec: BurnSpec, generator: torch.Generator) -> None:
    """Move ``generator`` past ``spec`` as the op itself would."""
    draws = _known_draws(spec, generator)
    if draws is not None:
        _advance(generator, draws)
    else:
        _scratch_op(spec, generator)


def state_before(
    segment: RngSegment, index: int, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """The generator state right before op ``index`` of ``segment`` would run eagerly.

    Consecutive ops with a known draw count are skipped with a single jump; only the state
    reached at ``index`` (and after ops that had to be re-run) is kept as a checkpoint.
    """
    with segment.lock, plain():
        start = segment.nearest_checkpoint(index)
        if start == index:
            return segment.checkpoints[index]
        gen = torch.Generator(device=segment.device)
        gen.set_state(segment.checkpoints[start])
        pending = pending_bytes = 0
        for i in range(start, index):
            spec = segment.specs[i]
            draws = _known_draws(spec, gen)
            if draws is not None:
                pending += draws
                pending_bytes += spec.nbytes
                continue
            if pending:
                _advance(gen, pending)
            _scratch_op(spec, gen)
            segment.add_checkpoint(i + 1, gen.get_state())
            if progress is not None:
                progress(pending_bytes + spec.nbytes)
            pending = pending_bytes = 0
        if pending:
            _advance(gen, pending)
            if progress is not None:
                progress(pending_bytes)
        segment.add_checkpoint(index, gen.get_state())
        return segment.checkpoints[index]


def burn_bytes(segment: RngSegment, index: int) -> int:
    """Bytes of random numbers that must be regenerated to reach op ``index`` (for progress)."""
    start = segment.nearest_checkpoint(index)
    return sum(s.nbytes for s in segment.specs[start:index])


def fast_generator(segment: RngSegment, index: int, device: torch.device) -> torch.Generator:
    """A generator of its own for op ``index``: seeded from the segment and the op's position."""
    digest = hashlib.blake2b(segment.seed_key + index.to_bytes(8, "little"), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def forget_generators() -> None:
    """Drop stream tracking (``clear_meta_init_cache``): the next random op starts a segment."""
    with _lock:
        _trackers.clear()


_segments: weakref.WeakSet[RngSegment] = weakref.WeakSet()


def live_segments() -> list[RngSegment]:
    return list(_segments)
