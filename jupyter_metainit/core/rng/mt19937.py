"""Jump-ahead for PyTorch's CPU generator (MT19937): move a state by N draws in about O(log N).

Used by the core's ``exact`` RNG mode: to replay a deferred random op from the state it would
have had eagerly, the CPU generator must skip the draws of every earlier op of its segment.
Consuming them one by one costs N / (~10^8 per second); :func:`jump_state` computes the state
after N 32-bit draws directly, in well under a second for any N (the first call also derives
MT19937's characteristic polynomial, a one-off fraction of a second).

The state
    ``torch.Generator().get_state()`` (CPU) is the 5056 bytes of ``CPUGeneratorImplState``:
    ``uint64 seed @0, int32 left @8, int32 seeded @12, uint64 next @16, uint64 state[624] @24``
    (32-bit words, zero-extended), then the Box-Muller caches (``normal_x/y/rho``,
    ``normal_is_valid``, ``next_float_normal_sample`` and its flag) from byte 5016 on. Only
    ``left``, ``next`` and the 624 words change; every other byte is copied unchanged.

The engine (``aten/src/ATen/core/MT19937RNGEngine.h``)
    A draw is ``if (--left == 0) twist(); y = state[next++]; return temper(y)``. ``twist``
    replaces the 624-word block in place by the next 624 words of the sequence
    ``x[k+624] = x[k+397] ^ ((upper1(x[k]) | lower31(x[k+1])) >> 1) ^ (lsb(x[k+1]) * 0x9908B0DF)``
    and sets ``left = 624, next = 0``; seeding sets ``left = 1, next = 0``. So a jump of
    ``N < left`` only moves ``next`` and ``left``; a larger one performs ``t = ceil(N'/624)``
    twists (``N' = N - (left - 1)``), i.e. maps the block by ``T^(624 t)`` where ``T`` slides
    the 624-word window one word along the sequence, and ends with ``next = N' - 624 (t - 1)``,
    ``left = 625 - next``.

The jump (Haramoto, Matsumoto, L'Ecuyer, "A fast jump ahead algorithm for linear recurrences
in a polynomial space", 2008)
    ``T`` is linear over GF(2) on the 19968-bit window. Its minimal polynomial is
    ``t * phi(t)``, where ``phi`` (degree 19937) is MT19937's characteristic polynomial and the
    extra ``t`` accounts for the 31 low bits of the window's first word, which one step kills.
    Hence ``T^J x = h(T) (T x)`` with ``h = t^(J-1) mod phi``. ``phi`` is found once, by
    Berlekamp-Massey on 2 * 19937 bits of one bit position of the sequence (cached at module
    level). ``h`` comes from square-and-multiply in GF(2)[t] on Python ints used as bit vectors
    (squaring spreads bits through a byte table; reduction clears 8 bits at a time with a
    256-entry table of multiples of ``phi``). Finally ``h(T)(T x) = XOR of the windows
    x[1+j .. 1+j+623] over the set bits j of h``: the sequence is extended 19937 words (by
    numpy's MT19937) and the selected windows are XOR-reduced, five bits of ``h`` at a time
    (``_apply``): about 1.5 ms per jump.
"""

from __future__ import annotations

import pathlib
import threading
from collections import OrderedDict

import numpy as np
import torch

from jupyter_metainit.core.rng.mt19937_polynomial import (
    DEGREE,
    N,
    get_poly,
    poly_lock,
    sequence,
    tempered_sequence,
    untemper,
)
from jupyter_metainit.core.runtime.interrupts import critical
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["advance_by_generating", "jump_is_cheap", "jump_state"]


# Byte layout of CPUGeneratorImplState (x86-64 / aarch64, little-endian).
_STATE_BYTES = 5056


_OFF_LEFT = 8


_OFF_NEXT = 16


_OFF_WORDS = 24


_WORDS_END = _OFF_WORDS + 8 * N


# Jumps up to this many words are done by running the recurrence directly.
_DIRECT_LIMIT = 4 * DEGREE


# Windows gathered and XOR-reduced at a time: 48 x 624 words, below ATen's parallel grain size
# (32768 elements), so each gather runs on the calling thread. 256 at a time started an OpenMP
# team per gather: on two busy cores its waits cost 20 to 100 times the gather (a jump took
# 60-340 ms of CPU instead of 3).
_WINDOW_CHUNK = 48


# Bits of a jump polynomial taken at a time by ``_apply`` (4 to 6 are equally fast; 1 is the
# plain method, 8 builds more combined sequences than it saves windows).
_GROUP_BITS = 5


_powers: OrderedDict[int, int] = OrderedDict()


_POWERS_KEPT = 1024  # 2.5 KB each


def _power_of_t(k: int) -> int:
    """``t^k mod phi``, kept: a model repeats its layers, so the same jump distances come back
    (each costs about 15 ms to compute and 1.5 ms to apply)."""
    with critical(), poly_lock:
        h = _powers.get(k)
        if h is not None:
            _powers.move_to_end(k)
            return h
    h = get_poly().power_of_t(k)
    with critical(), poly_lock:
        _powers[k] = h
        if len(_powers) > _POWERS_KEPT:
            _powers.popitem(last=False)
    return h


def _twists(left: int, draws: int) -> int:
    """Blocks of 624 words the state moves through for ``draws`` more outputs (0: none)."""
    if draws < left:
        return 0
    return -(-(draws - (left - 1)) // N)


def jump_is_cheap(state: torch.Tensor, draws: int) -> bool:
    """Whether :func:`jump_state` of ``draws`` from ``state`` costs a few milliseconds at most:
    its polynomial is kept, it is made of a few stored parts, or this distance was asked about
    before (a model's repeated layers bring the same distances back, so computing the
    polynomial once, about 15 ms, pays). Above about a million draws, a cheap jump beats
    generating them."""
    with plain():
        left = int(state.reshape(-1)[_OFF_LEFT : _OFF_LEFT + 4].numpy().view("<i4")[0])
    steps = N * _twists(left, int(draws))
    if steps <= _DIRECT_LIMIT:
        return True
    with critical(), poly_lock:
        if _kept_nearby(steps) is not None or steps in _asked:
            return True
        if _stored_parts(steps) <= _CHEAP_PARTS:
            return True  # made of a few stored parts
        _note_asked(steps)
        return False


_asked: OrderedDict[int, None] = OrderedDict()  # distances asked about or jumped before


def _note_asked(steps: int) -> None:
    """Remember a distance (the most recent ones). Call with ``poly_lock`` held."""
    _asked[steps] = None
    if len(_asked) > _POWERS_KEPT:
        _asked.popitem(last=False)


_CHEAP_PARTS = 3  # stored parts applied (about 1.5 ms each) that still make a cheap jump


_NEARBY_BLOCKS = 2


def _kept_nearby(steps: int) -> int | None:
    """Blocks (0 to 2) short of ``steps`` at which a kept polynomial lands, else None: the same
    distance in draws is one block more or less depending on where in its block the state is,
    and the last blocks are cheap to run directly. Call with ``poly_lock`` held."""
    for blocks in range(_NEARBY_BLOCKS + 1):
        if steps - blocks * N - 1 in _powers:
            return blocks
    return None


# Long jumps not seen before (the flush after building a whole model) are made of stored parts:
# for each base-16 digit d at position j of the distance, t^(d 16^j - 1) mod phi, kept in
# ``_mt19937_jumps.bin`` (a constant of MT19937 like phi; a test recomputes some). Up to ten
# applications of about 1.5 ms replace computing a new power (about 15 ms for a 2^22 distance).
# How the file was made (about 10 s): for j in range(_DIGITS), for d in 1..15, in that order,
# ``get_poly().power_of_t(d * 16**j - 1).to_bytes(_POLY_BYTES, "little")``, concatenated.
_JUMPS_FILE = pathlib.Path(__file__).with_name("_mt19937_jumps.bin")


_DIGITS = 10  # distances below 16**10 words (1.1e12 draws)


_POLY_BYTES = (DEGREE + 7) // 8


_digit_parts: bytes | None = None


def _digit_part(j: int, d: int) -> int | None:
    global _digit_parts
    if _digit_parts is None:
        try:
            _digit_parts = _JUMPS_FILE.read_bytes()
        except OSError:
            _digit_parts = b""
    start = (j * 15 + d - 1) * _POLY_BYTES
    if len(_digit_parts) < start + _POLY_BYTES:
        return None
    return int.from_bytes(_digit_parts[start : start + _POLY_BYTES], "little")


def _stored_parts(steps: int) -> int:
    """How many stored parts ``_advance_in_parts`` applies for ``steps`` (digits too small for
    one run directly)."""
    if steps >= 16**_DIGITS:
        return _DIGITS + 1
    count, j = 0, 0
    while steps:
        steps, d = divmod(steps, 16)
        count += d * 16**j > _DIRECT_LIMIT
        j += 1
    return count


def _advance_in_parts(block: np.ndarray, steps: int) -> np.ndarray | None:
    """``_advance_block`` by the stored part of each base-16 digit of ``steps``; None if a
    part is missing."""
    j = 0
    while steps:
        steps, d = divmod(steps, 16)
        if d:
            part = d * 16**j
            if part <= _DIRECT_LIMIT:
                block = sequence(block, part + N)[part:].copy()
            else:
                h = _digit_part(j, d)
                if h is None:
                    return None
                block = _apply(block, h)
        j += 1
    return block


def _advance_block(block: np.ndarray, steps: int, direct_limit: int = _DIRECT_LIMIT) -> np.ndarray:
    """The window ``steps`` words further along the sequence whose window is ``block``."""
    if steps <= direct_limit:
        return sequence(block, steps + N)[steps:].copy()
    with critical(), poly_lock:
        blocks = _kept_nearby(steps)
        recurs = steps in _asked
        if not recurs:
            _note_asked(steps)
    parts = _stored_parts(steps)
    # Stored parts the first time, and always when one part does it (as cheap as a kept
    # power); a distance that recurs gets its own power, kept.
    first_time = blocks is None and (parts <= 1 or (not recurs and parts <= _DIGITS))
    if blocks is not None:
        block = _apply(block, _power_of_t(steps - blocks * N - 1))
        return sequence(block, (blocks + 1) * N)[blocks * N :].copy() if blocks else block
    if first_time:
        advanced = _advance_in_parts(block, steps)
        if advanced is not None:
            return advanced
    # A new power, kept one block short: the same draw count comes back a block longer or
    # shorter (by where in its block the state is), and _kept_nearby then serves both.
    if steps - N > direct_limit:
        block = _apply(block, _power_of_t(steps - N - 1))
        return sequence(block, 2 * N)[N:].copy()
    return _apply(block, _power_of_t(steps - 1))


def _apply(block: np.ndarray, h: int) -> np.ndarray:
    """The window of the sequence after ``block`` given by ``h = t^(steps - 1) mod phi``.

    That window is the XOR of the windows ``seq[1 + j : 1 + j + 624]`` over the set bits ``j``
    of ``h``, about 10,000 of them. Taken ``_GROUP_BITS`` bits at a time (the "four Russians"
    way), bits ``j = k g + i`` of group ``g`` with pattern ``m`` contribute the window at
    ``1 + k g`` of ``combined[m]``, where ``combined[m][p]`` is the XOR of ``seq[p + i]`` over
    the bits ``i`` of ``m``: 32 sequences made once, then 4,000 windows instead of 10,000."""
    k = _GROUP_BITS
    length = DEGREE + N
    # Tempering is linear over GF(2): XOR the tempered words and untemper the result only.
    seq = tempered_sequence(block, length + k - 1)
    coefficients = np.zeros(-(-DEGREE // k) * k, dtype=np.uint8)
    coefficients[:DEGREE] = np.unpackbits(
        np.frombuffer(h.to_bytes((DEGREE + 7) // 8, "little"), np.uint8), bitorder="little"
    )[:DEGREE]
    patterns = coefficients.reshape(-1, k) @ (1 << np.arange(k, dtype=np.int64))
    groups = np.flatnonzero(patterns)
    starts = patterns[groups] * length + k * groups + 1  # in `combined`, flattened
    combined = _combined_buffer(k, length)
    combined[0] = 0
    for i in range(k):
        np.bitwise_xor(combined[: 1 << i], seq[i : i + length], out=combined[1 << i : 2 << i])
    # Windows are overlapping strided views, gathered a chunk at a time into this thread's
    # buffer (torch's index_select writes into it; numpy's fancy indexing would allocate 10 MB
    # per jump, page faults included where large blocks are always mapped anew).
    out = np.zeros(N, dtype=np.uint32)
    partial = np.empty(N, dtype=np.uint32)
    with plain():  # real tensors even when called inside meta_init
        flat = torch.from_numpy(combined.reshape(-1).view(np.int32))
        windows = flat.as_strided((flat.numel() - N + 1, N), (1, 1))
        rows = torch.from_numpy(starts)
        gathered = _gather_buffer()
        picked = gathered.numpy().view(np.uint32)
        for i in range(0, len(starts), _WINDOW_CHUNK):
            chunk = rows[i : i + _WINDOW_CHUNK]
            torch.index_select(windows, 0, chunk, out=gathered[: len(chunk)])
            np.bitwise_xor.reduce(picked[: len(chunk)], axis=0, out=partial)
            out ^= partial
    return untemper(out)


_buffers = threading.local()


def _combined_buffer(k: int, length: int) -> np.ndarray:
    buffer = getattr(_buffers, "combined", None)
    if buffer is None or buffer.shape != (1 << k, length):
        buffer = _buffers.combined = np.empty((1 << k, length), dtype=np.uint32)
    return buffer


def _gather_buffer() -> torch.Tensor:
    buffer = getattr(_buffers, "gathered", None)
    if buffer is None:
        buffer = _buffers.gathered = torch.empty((_WINDOW_CHUNK, N), dtype=torch.int32)
    return buffer


def _state_copy(state: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    """A copy of a CPU generator's state and numpy views of its ``left``, ``next`` and words."""
    with plain():  # a real copy even when called inside meta_init
        out = state.detach().reshape(-1).clone()
    raw = out.numpy()
    return (
        out,
        raw[_OFF_LEFT : _OFF_LEFT + 4].view("<i4"),
        raw[_OFF_NEXT : _OFF_NEXT + 8].view("<u8"),
        raw[_OFF_WORDS:_WORDS_END].view("<u8"),
    )


def jump_state(state: torch.Tensor, draws: int) -> torch.Tensor:
    """The CPU generator state after ``draws`` more 32-bit outputs from ``state``.

    ``state`` is ``generator.get_state()`` of a CPU ``torch.Generator``; the result is
    byte-for-byte what ``get_state()`` would return after ``draws`` real draws (one per element
    of e.g. ``uniform_`` on float32, ``random_`` on int32), with the seed and the normal-sampling
    caches untouched. ``state`` itself is not modified."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise TypeError("state must be a uint8 tensor from torch.Generator().get_state()")
    if state.device.type != "cpu" or state.numel() != _STATE_BYTES:
        raise ValueError(f"expected the {_STATE_BYTES}-byte state of a CPU generator")
    draws = int(draws)
    if draws < 0:
        raise ValueError("draws must be >= 0")
    out, left_view, next_view, words_view = _state_copy(state)
    left = int(left_view[0])
    if not 1 <= left <= N:
        raise ValueError(f"invalid generator state (left = {left})")
    twists = _twists(left, draws)
    if twists == 0:
        left_view[0] = left - draws
        next_view[0] = int(next_view[0]) + draws
        return out
    words = words_view.astype(np.uint32)
    rest = draws - (left - 1)  # outputs taken from blocks after the current one
    words_view[:] = _advance_block(words, N * twists)
    new_next = rest - N * (twists - 1)
    next_view[0] = new_next
    left_view[0] = N + 1 - new_next
    return out


def advance_by_generating(state: torch.Tensor, draws: int) -> torch.Tensor:
    """The state after ``draws`` outputs, by running the generator (numpy's MT19937, which can
    skip outputs without writing them): linear in ``draws``, the faster way below a few million.

    numpy's ``pos`` is PyTorch's ``next``, except that a freshly seeded PyTorch state
    (``left == 1``) twists before its next output, which numpy expresses as ``pos == 624``.
    """
    out, left_view, next_view, words_view = _state_copy(state)
    left = int(left_view[0])
    pos = N if left == 1 else int(next_view[0])
    bit_generator = np.random.MT19937()
    bit_generator.state = {
        "bit_generator": "MT19937",
        "state": {"key": words_view.astype(np.uint32), "pos": pos},
    }
    bit_generator.random_raw(int(draws), output=False)
    after = bit_generator.state["state"]
    words_view[:] = after["key"]
    next_view[0] = after["pos"]
    left_view[0] = N + 1 - after["pos"]
    return out
