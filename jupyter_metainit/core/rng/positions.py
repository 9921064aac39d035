"""Stream positions at replay: the generator state right before op ``index`` of a segment.

``exact`` mode: :func:`state_before` moves from the nearest checkpoint past the ops before
``index`` (one MT19937 jump-ahead for a run of known-count ops, :func:`advance_state`; a re-run
on scratch memory for the others) and keeps checkpoints. ``fast`` mode:
:func:`fast_generator` gives op ``index`` a generator of its own seeded from the segment and
the op's position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from jupyter_metainit.core.rng.draws import known_draws
from jupyter_metainit.core.rng.mt19937 import advance_by_generating, jump_is_cheap, jump_state
from jupyter_metainit.core.rng.scratch import scratch_op
from jupyter_metainit.core.rng.segments import BurnSpec, RngSegment
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["advance_state", "fast_generator", "run_on_scratch", "state_before"]

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
    scratch_op(spec, gen)
    return gen.get_state()


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
