"""MT19937 jump-ahead: ``jump_state`` equals real draws of torch's CPU generator, byte for byte."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from jupyter_metainit.core.rng import mt19937, mt19937_polynomial
from jupyter_metainit.core.rng.mt19937 import jump_state


def jump_generator(generator: torch.Generator, draws: int) -> None:
    """Advance a CPU ``generator`` in place by ``draws`` 32-bit outputs."""
    generator.set_state(jump_state(generator.get_state(), draws))


SIZES = [0, 1, 2, 623, 624, 625, 1247, 1248, 1249, 19_937, 100_000, 10**6 + 7]
RANDOM_SIZES = random.Random(20261122).sample(range(2, 3_000_000), 8)


def draw(g: torch.Generator, n: int) -> torch.Tensor:
    """``n`` real 32-bit draws (uniform_ on float32 takes exactly one per element)."""
    return torch.empty(n, dtype=torch.float32).uniform_(generator=g)


def seeded(seed: int, skip: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    draw(g, skip)
    return g


def fields(state: torch.Tensor) -> tuple[int, int, np.ndarray]:
    raw = state.numpy()
    left = int(raw[8:12].view("<i4")[0])
    nxt = int(raw[16:24].view("<u8")[0])
    return left, nxt, raw[24 : 24 + 8 * 624].view("<u8").astype(np.uint32)


def temper(y: np.ndarray) -> np.ndarray:
    y = y ^ (y >> np.uint32(11))
    y = y ^ ((y << np.uint32(7)) & np.uint32(0x9D2C5680))
    y = y ^ ((y << np.uint32(15)) & np.uint32(0xEFC60000))
    return y ^ (y >> np.uint32(18))


def reference_outputs(state: torch.Tensor, n: int) -> np.ndarray:
    """The next ``n`` raw 32-bit outputs, from a pure-numpy model of at::mt19937."""
    left, _, words = fields(state)
    seq = mt19937_polynomial.sequence(words, 624 + n + 624)
    # Outputs still in the current block are words[625 - left ..]; then the next blocks follow.
    first = 624 - (left - 1)
    return temper(seq[first : first + n])


def test_state_layout_and_reference_model():
    g = seeded(1234)
    s = g.get_state()
    assert s.dtype == torch.uint8 and s.numel() == 5056
    raw = s.numpy()
    assert int(raw[0:8].view("<u8")[0]) == 1234
    assert fields(s)[:2] == (1, 0)  # seeding: left = 1, next = 0
    assert int(raw[12:16].view("<i4")[0]) == 1  # seeded
    assert fields(s)[2][0] == 1234  # MT init: word 0 is the seed
    for skip in (0, 5, 623, 624, 700):
        g = seeded(99, skip)
        s = g.get_state()
        expected = reference_outputs(s, 2000)
        got = draw(g, 2000).numpy()
        # uniform_ on float32 is (y & (2^24 - 1)) / 2^24 of one draw y per element, in order
        assert np.array_equal(got, (expected & np.uint32(0xFFFFFF)).astype(np.float32) / 2**24)
        left, nxt, _ = fields(g.get_state())
        assert left + nxt == 625


def check(g: torch.Generator, n: int) -> None:
    start = g.get_state()
    jumped = jump_state(start, n)
    assert torch.equal(start, g.get_state())  # input untouched
    draw(g, n)
    assert torch.equal(jumped, g.get_state()), n
    h = torch.Generator()
    h.set_state(jumped)
    assert torch.equal(draw(h, 1500), draw(g, 1500)), n
    assert torch.equal(h.get_state(), g.get_state())


@pytest.mark.parametrize("n", SIZES + RANDOM_SIZES)
def test_jump_from_freshly_seeded(n):
    check(seeded(n % 1000 + 1), n)


@pytest.mark.parametrize("n", SIZES + RANDOM_SIZES)
@pytest.mark.parametrize("skip", [1, 300, 623, 624, 1000])
def test_jump_from_mid_block(n, skip):
    check(seeded(42, skip), n)


def test_jump_from_default_seed_and_random_offsets():
    rnd = random.Random(7)
    for _ in range(10):
        g = seeded(rnd.randrange(2**63), rnd.randrange(5000))
        check(g, rnd.randrange(2_000_000))


def test_other_fields_untouched():
    g = seeded(5, 10)
    torch.randn(3, generator=g)  # leaves a cached normal sample in the state
    s = g.get_state()
    assert s[5016:].any()
    for n in (3, 10_000, 10**9):
        j = jump_state(s, n)
        assert torch.equal(j[:8], s[:8]) and torch.equal(j[12:16], s[12:16])
        assert torch.equal(j[5016:], s[5016:])
    check(g, 77_777)


def test_polynomial_path_matches_recurrence():
    block = np.random.default_rng(3).integers(0, 2**32, 624, dtype=np.uint32)
    for steps in (1, 623, 624, 625, 19_936, 19_937, 19_938, 50_000, 123_457):
        direct = mt19937._advance_block(block, steps, direct_limit=10**9)
        assert np.array_equal(mt19937._advance_block(block, steps, direct_limit=0), direct)


def test_jump_generator_in_place():
    g, h = seeded(3, 17), seeded(3, 17)
    jump_generator(g, 2_345_678)
    draw(h, 2_345_678)
    assert torch.equal(g.get_state(), h.get_state())


def test_bad_input():
    with pytest.raises(ValueError):
        jump_state(torch.Generator().get_state(), -1)
    with pytest.raises(ValueError):
        jump_state(torch.zeros(100, dtype=torch.uint8), 1)
    with pytest.raises(TypeError):
        jump_state(torch.zeros(5056, dtype=torch.int32), 1)


def test_a_huge_jump_equals_two_jumps_of_half_its_distance():
    # 10**11 draws one by one would take hours; the time of the jump itself is a figure
    # (benchmarks/bench_rng.py prints it).
    s = seeded(11, 321).get_state()
    once = jump_state(s, 10**11)
    twice = jump_state(jump_state(s, 5 * 10**10), 5 * 10**10)
    assert torch.equal(once, twice)
    # a different split, landing mid-block on the way
    assert torch.equal(once, jump_state(jump_state(s, 12_345), 10**11 - 12_345))


def test_the_stored_characteristic_polynomial_is_mt19937s():

    assert mt19937_polynomial._stored_phi() == mt19937_polynomial.characteristic_polynomial()


def test_a_jump_is_cheap_once_its_distance_recurs_or_was_jumped():
    from jupyter_metainit.core.rng.mt19937 import jump_is_cheap

    state = torch.Generator().manual_seed(11).get_state()
    draws = 16**7 + 3 * 16**6 + 5 * 16**5 + 7 * 16**4 + 12_345  # 4 stored parts; no other test
    assert not jump_is_cheap(state, draws)
    assert jump_is_cheap(state, draws)  # asked again: it recurs, computing it once pays
    assert not jump_is_cheap(state, draws + 10_000)
    jump_state(state, draws + 10_000)
    assert jump_is_cheap(state, draws + 10_000)  # kept
    assert jump_is_cheap(state, 1000)  # within reach of the recurrence: never a polynomial
    assert jump_is_cheap(state, 5 * 16**5 + 100)  # one stored part


def test_the_stored_jump_parts_are_powers_of_t():
    poly = mt19937_polynomial.get_poly()
    for j, d in [(0, 1), (5, 7), (mt19937._DIGITS - 1, 15)]:
        assert mt19937._digit_part(j, d) == poly.power_of_t(d * 16**j - 1), (j, d)


@pytest.mark.parametrize("steps", [2**29 + 12_345, 7 * 16**9 + 3 * 16**4 + 1, 10**11 + 7])
def test_a_long_jump_made_of_stored_parts_equals_one_power(steps):
    block = np.random.default_rng(steps % 1000).integers(0, 2**32, 624, dtype=np.uint32)
    by_parts = mt19937._advance_in_parts(block, steps)
    assert by_parts is not None
    by_power = mt19937._apply(block, mt19937_polynomial.get_poly().power_of_t(steps - 1))
    assert np.array_equal(by_parts, by_power)


def test_a_new_power_serves_its_distance_one_block_shorter_and_longer():
    """The same draw count is one block more or less by where the state is in its block."""
    block = np.random.default_rng(5).integers(0, 2**32, 624, dtype=np.uint32)
    steps = 624 * 4_321
    mt19937._advance_block(block, steps)  # the first time: stored parts, nothing kept
    assert mt19937._kept_nearby(steps) is None
    mt19937._advance_block(block, steps)  # it recurs: keeps t^(steps - 624 - 1)
    for blocks, distance in enumerate([steps - 624, steps, steps + 624]):
        assert mt19937._kept_nearby(distance) == blocks
        reference = mt19937._advance_block(block, distance, direct_limit=10**9)
        assert np.array_equal(mt19937._advance_block(block, distance), reference)


def test_a_jump_inside_meta_init_runs_on_real_tensors():
    from jupyter_metainit import meta_init

    state = torch.Generator().manual_seed(2).get_state()
    expected = jump_state(state, 9_876_543)
    with meta_init():
        assert torch.equal(jump_state(state, 9_876_543), expected)


def _recurrence(block: np.ndarray, length: int) -> list[int]:
    """MT19937's recurrence word by word, as its reference code writes it."""
    x = [int(w) for w in block]
    while len(x) < length:
        k = len(x) - 624
        y = (x[k] & 0x80000000) | (x[k + 1] & 0x7FFFFFFF)
        x.append(x[k + 397] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0))
    return x[:length]


@pytest.mark.parametrize("length", [624, 625, 851, 1248, 20_565])
def test_the_sequence_is_mt19937s_recurrence(length):
    block = np.random.default_rng(length).integers(0, 2**32, 624, dtype=np.uint64)
    block = block.astype(np.uint32)
    assert mt19937_polynomial.sequence(block, length).tolist() == _recurrence(block, length)


@pytest.mark.parametrize("group_bits", [1, 3, 5, 8])
def test_a_jump_is_the_same_whatever_the_bits_taken_at_a_time(group_bits, monkeypatch):
    state = seeded(11, skip=100).get_state()
    # internal: the jump's group width, compared across widths (no setting chooses it)
    monkeypatch.setattr(mt19937, "_GROUP_BITS", 1)
    plain = jump_state(state, 3_000_017)
    monkeypatch.setattr(mt19937, "_GROUP_BITS", group_bits)
    assert torch.equal(jump_state(state, 3_000_017), plain)


def test_a_jump_runs_on_the_calling_thread_alone():
    # A jump's gathers started an OpenMP team (ATen parallelizes above its grain size): on two
    # busy cores the team's waits cost 20 to 100 times the gather itself. In a fresh process,
    # where no team exists yet, a jump starts no thread.
    import subprocess
    import sys

    code = (
        "import os, torch\n"
        "from jupyter_metainit.core.rng.mt19937 import jump_state\n"
        "torch.set_num_threads(2)\n"
        "state = torch.Generator().manual_seed(0).get_state()\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "jump_state(state, 141_820_224)\n"
        "print(len(os.listdir('/proc/self/task')) - before)\n"
    )
    if sys.platform != "linux":
        pytest.skip("counts threads in /proc/self/task")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
