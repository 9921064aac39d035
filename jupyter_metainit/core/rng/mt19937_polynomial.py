"""MT19937's sequence and characteristic polynomial, and arithmetic in GF(2)[t] modulo it.

The mathematics behind ``mt19937``'s jump-ahead (see its docstring): :func:`sequence` extends
the 32-bit word sequence (numpy's MT19937), :func:`characteristic_polynomial` finds ``phi`` by
Berlekamp-Massey (stored in ``_mt19937_phi.bin``; a test recomputes it), and :class:`Poly`
computes powers of ``t`` modulo ``phi`` (square-and-multiply on Python ints as bit vectors).
"""

from __future__ import annotations

import pathlib
import threading

import numpy as np

from jupyter_metainit.core.runtime.interrupts import critical

__all__ = [
    "DEGREE",
    "N",
    "characteristic_polynomial",
    "get_poly",
    "poly_lock",
    "sequence",
    "tempered_sequence",
    "untemper",
]


N = 624  # words in a block


DEGREE = 19937  # degree of the characteristic polynomial


_SPREAD = np.array([int(f"{b:08b}", 4) for b in range(256)], dtype="<u2")  # bit i -> bit 2i


def sequence(block: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` words of the sequence whose first window is ``block``."""
    return untemper(tempered_sequence(block, length))


def tempered_sequence(block: np.ndarray, length: int) -> np.ndarray:
    """``sequence``, each word tempered as MT19937 outputs it.

    numpy's MT19937 runs the recurrence in C: set to ``block`` with ``pos = 624`` (its next
    output twists), its outputs are the next words, tempered. Twice as fast as the recurrence
    in numpy (227 words, ``N - M``, per step), and a jump needs 20,000 words."""
    seq = np.empty(max(length, N), dtype=np.uint32)
    seq[:N] = _temper(np.asarray(block, dtype=np.uint32))
    more = len(seq) - N
    if more:
        bit_generator = np.random.MT19937()
        bit_generator.state = {
            "bit_generator": "MT19937",
            "state": {"key": np.asarray(block, dtype=np.uint32), "pos": N},
        }
        seq[N:] = bit_generator.random_raw(more)
    return seq[:length]


# MT19937's output tempering, a linear map of each word over GF(2): (right shift, mask) steps.
_TEMPERING = ((11, None), (7, 0x9D2C5680), (15, 0xEFC60000), (18, None))


def _temper_step(y: np.ndarray, x: np.ndarray, shift: int, mask: int | None) -> np.ndarray:
    if mask is None:
        return y ^ (x >> np.uint32(shift))
    return y ^ ((x << np.uint32(shift)) & np.uint32(mask))


def _temper(y: np.ndarray) -> np.ndarray:
    for shift, mask in _TEMPERING:
        y = _temper_step(y, y, shift, mask)
    return y


def untemper(y: np.ndarray) -> np.ndarray:
    """Inverse of ``_temper``: each step ``y = x ^ f(x)`` is undone by the fixed-point
    iteration ``x = y ^ f(x)``, ``shift`` more bits right each time."""
    for shift, mask in reversed(_TEMPERING):
        x = y
        for _ in range(32 // shift):
            x = _temper_step(y, x, shift, mask)
        y = x
    return y


def _berlekamp_massey(bits: np.ndarray) -> tuple[int, int]:
    """Shortest LFSR of a GF(2) sequence: ``(C, L)`` with ``C`` as an int, bit i = c_i (c_0 = 1),
    such that ``s[n] = XOR_{i=1..L} c_i s[n-i]``."""
    n_bits = len(bits)
    # r: bit (n_bits - 1 - j) holds s[j], so (r >> (n_bits - 1 - n)) has bit i = s[n - i].
    r = int.from_bytes(np.packbits(bits.astype(np.uint8)).tobytes(), "big")
    r >>= (-n_bits) % 8
    c, b, length, m = 1, 1, 0, 1
    for n in range(n_bits):
        if (c & (r >> (n_bits - 1 - n))).bit_count() & 1:
            previous = c
            c ^= b << m
            if 2 * length <= n:
                length = n + 1 - length
                b = previous
                m = 1
                continue
        m += 1
    return c, length


def characteristic_polynomial() -> int:
    """MT19937's characteristic polynomial phi (bit i = coefficient of t^i), found from the
    generator's own output by Berlekamp-Massey (about 90 ms; ``_mt19937_phi.bin`` keeps it, and
    a test checks the two agree)."""
    block = np.random.default_rng(0).integers(0, 2**32, N, dtype=np.uint32)
    seq = sequence(block, N + 2 * DEGREE)
    c, length = _berlekamp_massey(seq[N:] & np.uint32(1))
    if length != DEGREE:  # pragma: no cover - would mean a broken recurrence
        raise RuntimeError(f"MT19937 characteristic polynomial has degree {length}")
    # phi(t) = t^L C(1/t): reverse the L + 1 coefficients.
    return int(f"{c:0{length + 1}b}"[::-1], 2)


_PHI_FILE = pathlib.Path(__file__).with_name("_mt19937_phi.bin")


def _stored_phi() -> int:
    """phi as stored beside this module (a constant of MT19937), else computed."""
    try:
        phi = int.from_bytes(_PHI_FILE.read_bytes(), "little")
    except OSError:
        return characteristic_polynomial()
    return phi if phi.bit_length() == DEGREE + 1 else characteristic_polynomial()


def _square(x: int) -> int:
    """``x(t)^2`` in GF(2)[t]: bit i moves to bit 2i (cross terms cancel)."""
    raw = np.frombuffer(x.to_bytes((x.bit_length() + 7) // 8, "little"), np.uint8)
    return int.from_bytes(_SPREAD[raw].tobytes(), "little")


class _Poly:
    """MT19937's characteristic polynomial and the tables for arithmetic modulo it."""

    def __init__(self, phi: int | None = None) -> None:
        self.phi = _stored_phi() if phi is None else phi
        # reduce_table[b]: the multiple q * phi (deg q < 8) whose bits DEGREE..DEGREE+7 are b.
        self.reduce_table = [0] * 256
        for q in range(256):
            product = 0
            for i in range(8):
                if q >> i & 1:
                    product ^= self.phi << i
            self.reduce_table[product >> DEGREE] = product

    def reduce(self, x: int) -> int:
        table = self.reduce_table
        while True:
            top = x.bit_length()
            if top <= DEGREE:
                return x
            p = max(DEGREE, top - 8)
            x ^= table[(x >> p) & 0xFF] << (p - DEGREE)

    def power_of_t(self, k: int) -> int:
        """``t^k mod phi`` as an int (bit i = coefficient of t^i)."""
        if k < DEGREE:
            return 1 << k
        shift = k.bit_length() - 14  # the top 14 bits of k give an exponent < DEGREE
        x = 1 << (k >> shift)
        for i in range(shift - 1, -1, -1):
            x = self.reduce(_square(x))
            if k >> i & 1:
                x <<= 1
                if x >> DEGREE:
                    x ^= self.phi
        return x


_poly: _Poly | None = None


poly_lock = threading.Lock()


def get_poly() -> _Poly:
    global _poly
    if _poly is None:
        with critical(), poly_lock:
            if _poly is None:
                _poly = _Poly()
    return _poly
