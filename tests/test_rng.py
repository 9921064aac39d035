"""RNG policy: exact replay from the right generator state, and fast independent streams."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core import _rng


def build(n=6):
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


def deferred(seed=0, n=6):
    torch.manual_seed(seed)
    with meta_init():
        return build(n)


def test_exact_last_layer_first_equals_eager():
    torch.manual_seed(0)
    eager = build()
    m = deferred()
    materialize(m[5])
    materialize(m[0])
    assert torch.equal(m[5].weight, eager[5].weight)
    assert torch.equal(m[0].bias, eager[0].bias)


def test_exact_burn_through_is_checkpointed_for_later_calls():
    m = deferred()
    seg = m[5].weight._rec.storage.writes[1].rng.segment
    assert _rng.burn_bytes(seg, 10) > 0
    materialize(m[5])
    # the states reached are kept: no stream has to be regenerated again to reach them
    assert _rng.burn_bytes(seg, 10) == 0 and _rng.burn_bytes(seg, 11) == 0
    assert _rng.burn_bytes(seg, 12) == 0  # after the layer's own two ops


def test_burn_through_progress_is_reported():
    m = deferred()
    seen = []
    materialize(m[5].weight, progress=lambda d, t: seen.append((d, t)))
    earlier = 5 * (8 * 8 * 4 + 8 * 4)  # five earlier layers' weight and bias streams
    assert seen[-1][0] == seen[-1][1] >= earlier + 8 * 8 * 4


def test_reseeding_starts_a_new_stream_like_eager():
    torch.manual_seed(0)
    e1 = build(2)
    torch.manual_seed(0)
    e2 = build(2)
    torch.manual_seed(0)
    with meta_init():
        a = build(2)
    torch.manual_seed(0)
    with meta_init():
        b = build(2)
    materialize([a, b])
    assert torch.equal(a[1].weight, e1[1].weight) and torch.equal(b[1].weight, e2[1].weight)


def test_consecutive_blocks_continue_the_stream_like_eager():
    torch.manual_seed(0)
    e1, e2 = build(2), build(2)
    torch.manual_seed(0)
    with meta_init():
        a = build(2)
    with meta_init():
        b = build(2)
    materialize(b)
    materialize(a)
    assert torch.equal(a[0].weight, e1[0].weight) and torch.equal(b[1].weight, e2[1].weight)


def test_fast_mode_is_deterministic_and_order_independent():
    m1, m2 = deferred(), deferred()
    materialize(m1, rng="fast")
    materialize(m2[4], rng="fast")
    materialize(m2[0], rng="fast")
    materialize(m2, rng="fast")
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fast_mode_gives_every_tensor_its_own_stream():
    m = deferred(n=8)
    materialize(m, rng="fast")
    weights = [layer.weight.detach() for layer in m]
    for i in range(len(weights)):
        for j in range(i + 1, len(weights)):
            assert not torch.equal(weights[i], weights[j])


def test_fast_mode_depends_on_the_seed():
    a, b = deferred(seed=1), deferred(seed=2)
    materialize(a, rng="fast")
    materialize(b, rng="fast")
    assert not torch.equal(a[0].weight, b[0].weight)


def test_fast_generators_differ_per_op():
    seg = _rng.RngSegment(torch.get_rng_state(), torch.device("cpu"))
    g0 = _rng.fast_generator(seg, 0, torch.device("cpu"))
    g1 = _rng.fast_generator(seg, 1, torch.device("cpu"))
    assert g0.initial_seed() != g1.initial_seed()
    assert _rng.fast_generator(seg, 0, torch.device("cpu")).initial_seed() == g0.initial_seed()


def test_dropout_in_a_recorded_forward_is_exact():
    torch.manual_seed(0)
    x = torch.ones(4, 4)
    eager = nn.functional.dropout(x * 1, 0.5)
    torch.manual_seed(0)
    with meta_init():
        y = nn.functional.dropout(torch.ones(4, 4), 0.5)
    materialize(y)
    assert torch.equal(y, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 4103])
@pytest.mark.parametrize("op", ["uniform_", "normal_"])
def test_burn_through_reaches_the_same_generator_state_as_the_op(op, n, dtype):
    func = getattr(torch.ops.aten, op).default
    spec = _rng.BurnSpec(func, (("tensor", (n,), (1,), dtype),), {}, True, n * 4)
    real, burnt = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    getattr(torch.empty(n, dtype=dtype), op)(generator=real)
    _rng._burn(spec, burnt)
    assert torch.equal(real.get_state(), burnt.get_state())


def test_burn_through_of_large_fills_uses_bounded_scratch_memory():
    spec = _rng.BurnSpec(
        torch.ops.aten.normal_.default, (("tensor", (64, 1024), (1024, 1), torch.float32),),
        {}, True, 0,
    )  # fmt: skip
    assert _rng.known_draws(spec, torch.device("cpu")) == 64 * 1024


def test_long_burn_through_jumps_ahead_exactly():
    n = 64 * 1024 * 1024 + 5  # above the jump threshold
    spec = _rng.BurnSpec(torch.ops.aten.uniform_.default, (("tensor", (n,), (1,), torch.float32),),
                         {}, True, n * 4)  # fmt: skip
    real, jumped = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    torch.empty(n).uniform_(generator=real)
    _rng._burn(spec, jumped)
    assert torch.equal(real.get_state(), jumped.get_state())
