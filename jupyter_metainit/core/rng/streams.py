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

import bisect
import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from jupyter_metainit.core.errors import MetaInitError
from jupyter_metainit.core.rng.mt19937 import advance_by_generating, jump_is_cheap, jump_state
from jupyter_metainit.core.runtime.interrupts import critical
from jupyter_metainit.core.runtime.plain import plain

__all__ = [
    "BurnSpec",
    "RngSegment",
    "before_real_draw",
    "default_generator_for",
    "draws_depend_on_values",
    "fast_generator",
    "flush_all",
    "flush_default",
    "record_random",
    "run_random",
    "state_before",
    "true_state",
]

aten = torch.ops.aten

# The C methods themselves: while a block is active ``meta_init`` wraps ``torch.Generator``'s
# ``get_state``/``set_state`` (``_context``) so that user code reads exact states; the tracking
# below reads and leaves marks, and must not flush on every op.
raw_get_state = torch._C.Generator.get_state
raw_set_state = torch._C.Generator.set_state


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
        # States after ops whose draw count depends on the values they read (``poisson``):
        # measured at recording on the real inputs, never re-derivable from scratch memory, so
        # kept when the other checkpoints are cleared.
        self.fixed: dict[int, torch.Tensor] = {}
        self.seed_key = hashlib.blake2b(start_state.numpy().tobytes(), digest_size=16).digest()
        self.lock = threading.RLock()
        _segments.add(self)

    def add_checkpoint(self, index: int, state: torch.Tensor) -> None:
        with critical(), self.lock:
            if index not in self.checkpoints:
                self.checkpoints[index] = state
                bisect.insort(self._keys, index)

    def nearest_checkpoint(self, index: int) -> int:
        with critical(), self.lock:
            return self._keys[bisect.bisect_right(self._keys, index) - 1]

    def add_fixed(self, index: int, state: torch.Tensor) -> None:
        """``state`` is where op ``index - 1`` left the generator, measured on its real inputs."""
        with critical(), self.lock:
            self.fixed[index] = state
            self.checkpoints[index] = state
            if index not in self._keys:
                bisect.insort(self._keys, index)

    def clear_checkpoints(self) -> None:
        with critical(), self.lock:
            self.checkpoints = {0: self.start_state, **self.fixed}
            self._keys = sorted(self.checkpoints)


# ---------------------------------------------------------------------------------------------
# running random ops with a generator of our choosing


def _device_default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    raise RuntimeError(f"no default generator for {device}")


def default_generator_for(device: torch.device) -> torch.Generator | None:
    """The generator an op on ``device`` without an explicit one draws from eagerly: the
    device's default CUDA generator when that GPU is present at recording; otherwise None (the
    default CPU one; also for a tensor recorded for a GPU this machine lacks, ``cuda:1`` on a
    CPU-only machine, whose values are then the CPU stream's)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    torch.cuda.init()  # fills torch.cuda.default_generators (lazily, as eager code would)
    return torch.cuda.default_generators[index]


# Random ops that have no ``generator`` argument at all (dropout, fused attention, RNNs) must
# run on a device's default generator: it is swapped for ours and restored under this lock.
_default_swap_lock = threading.Lock()


def run_random(
    call: Callable[[torch.Generator | None], Any],
    generator: torch.Generator,
    has_generator: bool,
) -> Any:
    """Run a random op drawing from ``generator``.

    Ops with a ``generator`` argument get it; the few without one (``native_dropout``) run on
    the default generator of ``generator``'s device, set to ``generator``'s state and restored
    afterwards, under a process-wide lock: the caller's RNG state is unchanged, but another
    thread drawing from that default generator at that instant would be serialized with it
    only if it also went through here.
    """
    if has_generator:
        return call(generator)
    default = _device_default_generator(generator.device)
    with critical(), _default_swap_lock:
        saved = raw_get_state(default)
        raw_set_state(default, raw_get_state(generator))
        try:
            out = call(None)
            raw_set_state(generator, raw_get_state(default))
        finally:
            raw_set_state(default, saved)
    return out


def _scratch_tensor(x: Any, device: torch.device, func: Any) -> Any:
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
        _, size, stride, dtype = x
        t = torch.empty_strided(size, stride, dtype=dtype, device=device)
        # Values every random op accepts as input (probabilities, bounds); multinomial needs
        # weights that are not all zero.
        return t.fill_(1) if func is aten.multinomial.default else t.zero_()
    if isinstance(x, list):
        return [_scratch_tensor(v, device, func) for v in x]
    if isinstance(x, tuple):
        return tuple(_scratch_tensor(v, device, func) for v in x)
    return x


def _scratch_op(spec: BurnSpec, generator: torch.Generator) -> None:
    """Re-run the op on scratch memory of the same layout: exact for any op whose consumption
    does not depend on the values it reads, memory = its size."""
    device = generator.device
    args = tuple(_scratch_tensor(a, device, spec.func) for a in spec.args)
    kwargs = {k: _scratch_tensor(v, device, spec.func) for k, v in spec.kwargs.items()}
    if any(a.name == "device" for a in spec.func._schema.arguments):
        kwargs["device"] = device

    def call(gen: torch.Generator | None) -> Any:
        kw = dict(kwargs)
        if gen is not None:
            kw["generator"] = gen
        return spec.func(*args, **kw)

    run_random(call, generator, spec.has_generator)


# ---------------------------------------------------------------------------------------------
# known draw counts
#
# Draws (32-bit outputs of mt19937) that CPU random kernels consume, as a function of the
# output's size, dtype and layout and of the op's scalar arguments. Measured on the kernels and,
# since another PyTorch build may differ, checked against the real kernel once per process and
# per (op, dtype, scalar arguments) before being trusted (``_formula_holds``); an op whose formula
# does not hold is re-run on scratch memory instead.

_HALF = (torch.float16, torch.bfloat16)
_SINGLE = (torch.float32, *_HALF)


def _numel(size: tuple) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _normal_draws(n: int, dtype: torch.dtype, contiguous: bool) -> int | None:
    # normal_fill: blocks of 16 from uniforms; a partial last block redraws the last 16.
    # Below 16 elements (or strided) the serial kernel uses the generator's Box-Muller cache.
    if n < 16 or not contiguous:
        return None
    if dtype == torch.float32:
        return n + (16 if n % 16 else 0)
    if dtype in _HALF:
        return -(-n // 16) * 16
    if dtype == torch.float64:
        return 2 * n + (32 if n % 16 else 0)
    return None


def _per_element(dtype: torch.dtype, single: int, double: int) -> int | None:
    if dtype in _SINGLE:
        return single
    if dtype == torch.float64:
        return double
    return None


def _random_range_draws(low: Any, high: Any) -> int:
    return 2 if (int(high) - int(low)) >= (1 << 32) else 1


def _output_geometry(spec: BurnSpec) -> tuple[int, torch.dtype, bool] | None:
    """(elements, dtype, contiguous) of the tensor a random op fills or creates."""
    f = spec.func
    if f in _FACTORY_SIZE_ARG:
        size = spec.args[_FACTORY_SIZE_ARG[f]] if len(spec.args) > _FACTORY_SIZE_ARG[f] else None
        if f is aten.randperm.generator:
            size = (spec.args[0],)
        dtype = spec.kwargs.get("dtype")
        if size is None or dtype is None:
            return None
        return _numel(tuple(size)), dtype, True
    target = spec.args[0] if spec.args else None
    if not (isinstance(target, tuple) and len(target) == 4 and target[0] == "tensor"):
        return None
    _, size, stride, dtype = target
    if f in _LIKE_OPS:
        dtype = spec.kwargs.get("dtype") or dtype
        return _numel(size), dtype, True
    return _numel(size), dtype, is_contiguous(size, stride)


def is_contiguous(size: tuple, stride: tuple) -> bool:
    """Whether ``size``/``stride`` is the row-major contiguous layout (size-1 dims ignored)."""
    expected = 1
    for n, st in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


_FACTORY_SIZE_ARG = {
    aten.rand.generator: 0, aten.randn.generator: 0, aten.normal.float_float: 2,
    aten.randint.generator: 1, aten.randint.low_generator: 2, aten.randperm.generator: 0,
}  # fmt: skip
_LIKE_OPS = {aten.rand_like.generator, aten.randn_like.generator}


def _argument(spec: BurnSpec, name: str) -> Any:
    for i, a in enumerate(spec.func._schema.arguments):
        if a.name == name:
            if i < len(spec.args):
                return spec.args[i]
            return spec.kwargs.get(name, a.default_value)
    return None


def _draws_nothing(spec: BurnSpec) -> bool:
    """Random ops switched off by their arguments: no dropout probability, not training."""
    names = {a.name for a in spec.func._schema.arguments}
    if "dropout_p" in names:
        return _argument(spec, "dropout_p") == 0
    if "train" in names:
        p = _argument(spec, "p" if "p" in names else "dropout")
        return not _argument(spec, "train") or p == 0
    if "training" in names:
        return not _argument(spec, "training")
    return False


def _draws(spec: BurnSpec, nothing: bool = True) -> int | None:
    """Draws ``spec`` consumes on the CPU generator, or None if not known. ``nothing``: check
    first whether its arguments switch it off."""
    if nothing and _draws_nothing(spec):
        return 0
    if spec.func is aten.native_dropout.default:
        target = spec.args[0]
        n, dtype = _numel(target[1]), target[3]
        return 2 * n if dtype in (*_SINGLE, torch.float64) else None
    geometry = _output_geometry(spec)
    if geometry is None:
        return None
    n, dtype, contiguous = geometry
    f = spec.func
    if f in (aten.uniform_.default, aten.rand.generator, aten.rand_like.generator):
        per = _per_element(dtype, 1, 2)
        return None if per is None else per * n
    if f in (aten.normal_.default, aten.randn.generator, aten.randn_like.generator,
             aten.normal.float_float):  # fmt: skip
        return _normal_draws(n, dtype, contiguous)
    if f in (aten.exponential_.default, aten.cauchy_.default, aten.geometric_.default,
             aten.bernoulli_.float):  # fmt: skip
        return 2 * n if dtype in (*_SINGLE, torch.float64) else None
    if f is aten.random_.default:
        if dtype in (torch.int64, torch.float64):
            return 2 * n
        return n if dtype in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                              *_SINGLE) else None  # fmt: skip
    if f is aten.random_.to:
        return n * _random_range_draws(0, spec.args[1])
    if f is getattr(aten.random_, "from"):
        to = spec.args[2] if len(spec.args) > 2 else None
        return None if to is None else n * _random_range_draws(spec.args[1], to)
    if f is aten.randint.generator:
        return n * _random_range_draws(0, spec.args[0])
    if f is aten.randint.low_generator:
        return n * _random_range_draws(spec.args[0], spec.args[1])
    if f is aten.randperm.generator:
        return max(n - 1, 0) if n < (1 << 24) else None
    return None


def _shrunk(x: Any) -> Any:
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
        size = tuple(min(d, 1) for d in x[1])
        return ("tensor", size, torch.empty(size, device="meta").stride(), x[3])
    if isinstance(x, (list, tuple)):
        return type(x)(_shrunk(v) for v in x)
    return x


def _probe(spec: BurnSpec, n: int, nothing: bool) -> BurnSpec:
    """``spec`` on a contiguous 1-D output of ``n`` elements (same op, dtype and scalars); for
    an op switched off by its arguments, the same call with every tensor shrunk to one element."""
    f = spec.func
    if nothing:
        kwargs = {k: _shrunk(v) for k, v in spec.kwargs.items()}
        return BurnSpec(f, _shrunk(spec.args), kwargs, spec.has_generator, 0)
    if f in _FACTORY_SIZE_ARG:
        args = list(spec.args)
        args[_FACTORY_SIZE_ARG[f]] = n if f is aten.randperm.generator else [n]
        return BurnSpec(f, tuple(args), spec.kwargs, spec.has_generator, 0)
    dtype = spec.args[0][3]
    return BurnSpec(f, (("tensor", (n,), (1,), dtype), *spec.args[1:]), spec.kwargs,
                    spec.has_generator, 0)  # fmt: skip


# Random ops whose number of draws depends only on their arguments' sizes, dtypes and scalars,
# never on the values they read: re-running them on scratch memory moves a generator exactly as
# they do. Every other random op (``poisson``, ``binomial``, ``_standard_gamma`` and
# ``_sample_dirichlet`` behind ``torch.distributions``, ``rrelu_with_noise``: rejection loops,
# draws only for negative inputs; and any op not known here) is run on its real inputs at
# recording, from the exact state, and the state it ends in is kept.
_VALUE_INDEPENDENT = frozenset({
    "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "uniform", "uniform_",
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "random", "random_", "exponential", "exponential_", "cauchy", "cauchy_", "geometric",
    "geometric_", "log_normal", "log_normal_", "native_dropout", "dropout", "alpha_dropout",
    "feature_dropout", "feature_alpha_dropout", "_fused_dropout", "lstm", "gru", "rnn_tanh",
    "rnn_relu", "_cudnn_rnn", "miopen_rnn",
})  # fmt: skip


def draws_depend_on_values(func: Any) -> bool:
    """Whether the draws of random op ``func`` may depend on the values of its inputs."""
    name = func._schema.name.split("::")[-1]
    return name not in _VALUE_INDEPENDENT and "attention" not in name


_verified: dict[Any, bool] = {}


def _formula_key(spec: BurnSpec, nothing: bool) -> Any:
    if nothing:
        scalars = tuple(a for a in spec.args if not isinstance(a, (tuple, list)))
        return (spec.func, "draws nothing", scalars, tuple(sorted(map(str, spec.kwargs.items()))))
    geometry = _output_geometry(spec) if spec.func is not aten.native_dropout.default else None
    scalars = tuple(a for a in spec.args[1:] if not isinstance(a, (tuple, list)))
    return (spec.func, geometry[1] if geometry else None, scalars,
            tuple(sorted((k, str(v)) for k, v in spec.kwargs.items())))  # fmt: skip


def _formula_holds(spec: BurnSpec, nothing: bool) -> bool:
    key = _formula_key(spec, nothing)
    ok = _verified.get(key)
    if ok is None:
        ok = True
        with plain():
            for n in (37, 64, 1000):
                probe = _probe(spec, n, nothing)
                expected = _draws(probe, nothing)
                if expected is None:
                    ok = False
                    break
                a = torch.Generator().manual_seed(n)
                try:
                    _scratch_op(probe, a)
                except Exception:  # the probe's shapes do not suit the op: trust nothing
                    ok = False
                    break
                b = jump_state(torch.Generator().manual_seed(n).get_state(), expected)
                ok = ok and torch.equal(a.get_state(), b)
        _verified[key] = ok
    return ok


_known: dict[Any, int | None] = {}


def known_draws(spec: BurnSpec, device: torch.device) -> int | None:
    """Draws the op consumes on ``device``'s generator, if known and verified (CPU only)."""
    if device.type != "cpu":
        return None
    try:
        key = (spec.func, spec.args, tuple(spec.kwargs.items()))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _known:
        return _known[key]
    if _draws_nothing(spec) and _formula_holds(spec, nothing=True):
        draws: int | None = 0
    else:
        draws = _draws(spec, nothing=False)
        if draws is not None and not _formula_holds(spec, nothing=False):
            draws = None
    if key is not None:
        if len(_known) > 65536:
            _known.clear()
        _known[key] = draws
    return draws


# ---------------------------------------------------------------------------------------------
# moving states


# Below this many draws, generating them (about 4 ms per million) is faster than jumping.
_JUMP_ABOVE = 5 << 20
# ... and above this many when the jump's polynomial is kept (a distance seen before, as in a
# model's repeated layers): applying one costs about as much as generating a million draws.
_JUMP_KEPT_ABOVE = 1 << 20


# Below this many draws, torch's own uniform_ on a scratch buffer moves a generator fastest
# (numpy's MT19937 costs a fixed ~0.4 ms to set up).
_TORCH_BELOW = 1 << 16
_torch_draws_ok: bool | None = None


def _advance_with_torch(state: torch.Tensor, draws: int) -> torch.Tensor:
    gen = torch.Generator()
    gen.set_state(state)
    with plain():
        torch.empty(draws, dtype=torch.float32).uniform_(generator=gen)  # one draw an element
    return gen.get_state()


def _torch_draws_are_exact() -> bool:
    """Checked once per process: float32 ``uniform_`` takes one 32-bit output per element."""
    global _torch_draws_ok
    if _torch_draws_ok is None:
        start = torch.Generator().manual_seed(7).get_state()
        _torch_draws_ok = all(
            torch.equal(_advance_with_torch(start, n), advance_by_generating(start, n))
            for n in (1, 623, 624, 625, 5000)
        )
    return _torch_draws_ok


def advance_state(state: torch.Tensor, draws: int) -> torch.Tensor:
    """The CPU generator state ``draws`` 32-bit outputs after ``state``."""
    if draws <= 0:
        return state
    if draws > _JUMP_ABOVE or (draws > _JUMP_KEPT_ABOVE and jump_is_cheap(state, draws)):
        return jump_state(state, draws)
    if draws < _TORCH_BELOW and _torch_draws_are_exact():
        return _advance_with_torch(state, draws)
    return advance_by_generating(state, draws)


def run_on_scratch(spec: BurnSpec, state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The state after re-running ``spec`` on scratch memory from ``state``."""
    gen = torch.Generator(device=device)
    gen.set_state(state)
    _scratch_op(spec, gen)
    return gen.get_state()


def state_after(spec: BurnSpec, state: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The state after ``spec`` drew from ``state``: by its known draw count, else by running
    it on scratch memory."""
    draws = known_draws(spec, device)
    if draws is not None:
        return advance_state(state, draws)
    return run_on_scratch(spec, state, device)


def state_before(
    segment: RngSegment, index: int, progress: Callable[[int], None] | None = None
) -> torch.Tensor:
    """The generator state right before op ``index`` of ``segment`` would run eagerly.

    Consecutive ops with a known draw count are skipped with a single jump; only the state
    reached at ``index`` (and after ops that had to be re-run) is kept as a checkpoint.
    """
    with plain(), segment.lock:
        start = segment.nearest_checkpoint(index)
        if start == index:
            return segment.checkpoints[index]
        state = segment.checkpoints[start]
        pending = pending_bytes = 0
        for i in range(start, index):
            spec = segment.specs[i]
            draws = known_draws(spec, segment.device)
            if draws is not None:
                pending += draws
                pending_bytes += spec.nbytes
                continue
            state = advance_state(state, pending) if segment.device.type == "cpu" else state
            state = run_on_scratch(spec, state, segment.device)
            segment.add_checkpoint(i + 1, state)
            if progress is not None:
                progress(pending_bytes + spec.nbytes)
            pending = pending_bytes = 0
        if pending:
            state = advance_state(state, pending)
            if progress is not None:
                progress(pending_bytes)
        segment.add_checkpoint(index, state)
        return state


def fast_generator(segment: RngSegment, index: int, device: torch.device) -> torch.Generator:
    """A generator of its own for op ``index``: seeded from the segment and the op's position."""
    digest = hashlib.blake2b(segment.seed_key + index.to_bytes(8, "little"), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


# ---------------------------------------------------------------------------------------------
# following the real generators while recording


class _Tracker:
    """What recording knows about one real generator (see the module docstring)."""

    __slots__ = ("exact", "generator", "marked", "pending", "segment")

    def __init__(self, generator: torch.Generator, state: torch.Tensor) -> None:
        self.generator = generator
        self.segment = RngSegment(state, generator.device)
        self.exact = state  # the stream's state after the ops recorded so far, minus `pending`
        self.pending = 0  # draws of known-count ops recorded after `exact`
        self.marked = state  # the state we left the real generator in


# By the C++ generator (``_cdata``): an explicit generator reaches the recorder as a new Python
# object for every op, the same one the user holds only for default generators. A tracker keeps
# its generator alive, so the address is never reused while it is kept.
_trackers: dict[int, _Tracker] = {}
_lock = threading.RLock()

# Every state we left a real generator in while draws were pending (a *mark*), by digest, with
# the exact position it stands for (segment, index: the state before that op). A mark is the
# exact state with its ``left``/``next`` fields (see ``_mt19937``) set to a pair no generator
# ever holds (a draw keeps ``left + next == 625``, seeding sets ``(1, 0)``; marks take pairs with
# ``left + next < 625``), from a process-wide counter cycling through ~194,000 pairs: no
# ``manual_seed``/``set_state`` of a real state gives it, and each recorded op gets a new one.
# While a block is active, ``g.get_state()`` (and ``clone_state``, pickling) flush first and so
# never hand a mark out (``_context`` wraps them); a mark that still reaches a generator (saved
# through a path not wrapped) is recognized when restored (``g.set_state(st)``, also on another
# generator) and stands for the exact state eager code would have saved; a restore is never
# mistaken for no change.
_marks: OrderedDict[bytes, tuple[RngSegment, int]] = OrderedDict()
_MARKS_KEPT = 1 << 16
_STATE_BYTES = 5056  # a CPU generator's state (see ``_mt19937``); only CPU ones are marked
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
    segment, index = found
    return state_before(segment, index)


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
    left, position = _next_mark_fields()
    data[8:12] = np.frombuffer(left.to_bytes(4, "little"), dtype=np.uint8)
    data[16:24] = np.frombuffer(position.to_bytes(8, "little"), dtype=np.uint8)
    _marks[data[:_KEY_BYTES].tobytes()] = (tracker.segment, len(tracker.segment.specs))
    while len(_marks) > _MARKS_KEPT:
        _marks.popitem(last=False)
    return mark


def _mark(tracker: _Tracker) -> None:
    """Leave the real generator at the exact state, or, while draws are pending, at a fresh
    mark (see ``_marks``): reseeding or ``set_state`` between two recorded ops is then seen."""
    state = _new_mark(tracker) if tracker.pending else tracker.exact
    raw_set_state(tracker.generator, state)
    tracker.marked = state


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
            _trackers[gen._cdata] = tracker
        segment = tracker.segment
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
        tracker.segment.add_checkpoint(len(tracker.segment.specs), tracker.exact)
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


_segments: weakref.WeakSet[RngSegment] = weakref.WeakSet()


def live_segments() -> list[RngSegment]:
    return list(_segments)
