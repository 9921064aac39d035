"""``nn.init.trunc_normal_`` inside ``meta_init`` is recorded as one ``normal_`` when exact."""

from __future__ import annotations

import warnings

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core.record import trunc_normal
from jupyter_metainit.core.rng import streams

aten = torch.ops.aten


def _both(init, shape=(48, 20), dtype=torch.float32, seed=0):
    """``init(tensor)`` eagerly and deferred, then a draw after it; (eager, deferred) pairs."""
    (eager, eager_after), (deferred, deferred_after) = eager_and_deferred(
        lambda: (init(torch.empty(shape, dtype=dtype)), torch.rand(5)), seed=seed
    )  # asserts the generator's state after both, too
    writes = _writes(deferred)
    return (eager, materialize(deferred)), (eager_after, materialize(deferred_after)), writes


def _writes(t):
    return [op.func for op in t._rec.storage.writes]


def test_the_implementation_is_verified_on_this_torch():
    assert trunc_normal._implementation_verified()


def test_the_usual_bounds_record_one_normal_and_no_read():
    with meta_init():
        w = torch.empty(64, 32)
        nn.init.trunc_normal_(w, std=0.02)
    assert _writes(w) == [aten.empty.memory_format, aten.normal_.default]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_values_and_the_generator_equal_eager(dtype):
    values, after, _ = _both(lambda t: nn.init.trunc_normal_(t, std=0.02), dtype=dtype)
    assert torch.equal(*values)
    assert torch.equal(*after)


def test_bounds_no_normal_value_reaches_cost_no_random_work_at_build():
    torch.manual_seed(0)
    with meta_init():
        w = nn.init.trunc_normal_(torch.empty(64, 32), std=0.02)
        # Still pending: no scratch draw brought the generator to an exact state.
        assert streams._trackers[torch.default_generator._cdata].pending == w.numel()
    assert _writes(w) == [aten.empty.memory_format, aten.normal_.default]


def test_a_call_records_its_one_normal_and_nothing_else():
    with meta_init():
        w = torch.empty(64, 32)
        nn.init.trunc_normal_(w, std=0.02)
        first = w._rec.storage.writes[-1].seq
        nn.init.trunc_normal_(w, std=0.02)
    # No op recorded in between (the bounds are compared as real numbers, not as constants).
    assert w._rec.storage.writes[-1].seq == first + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reachable_bounds_are_read_on_scratch_and_stay_exact(dtype):
    # 6.7 std: reachable, so read, but nothing in this draw is out of bounds.
    init = lambda t: nn.init.trunc_normal_(t, std=0.3)  # noqa: E731
    assert not trunc_normal._bounds_unreachable(dtype, 0.0, 0.3, -2.0, 2.0)
    values, after, writes = _both(init, dtype=dtype)
    assert writes == [aten.empty.memory_format, aten.normal_.default]
    assert torch.equal(*values)
    assert torch.equal(*after)


def test_a_mean_far_larger_than_std_is_read_and_stays_exact():
    # float32 cannot hold 1e7 + z to a fraction of std: the bounds are read, not assumed
    assert not trunc_normal._bounds_unreachable(torch.float32, 1e7, 1.0, 1e7 - 100, 1e7 + 100)
    values, after, _ = _both(lambda t: nn.init.trunc_normal_(t, 1e7, 1.0, 1e7 - 100, 1e7 + 100))
    assert torch.equal(*values)
    assert torch.equal(*after)


def test_redraws_fall_back_to_pytorch_and_stay_exact():
    # std=1 in [-2, 2]: about 5 % of the first draw is out of bounds and redrawn.
    values, after, writes = _both(lambda t: nn.init.trunc_normal_(t), shape=(300,))
    assert torch.equal(*values)
    assert torch.equal(*after)
    assert aten.copy_.default in writes  # PyTorch's own loop: the redrawn result copied in


def test_narrow_bounds_take_pytorchs_other_branch_exactly():
    values, after, _ = _both(lambda t: nn.init.trunc_normal_(t, 0.0, 1.0, -0.1, 0.1))
    assert torch.equal(*values)
    assert torch.equal(*after)


def test_a_mean_far_outside_the_bounds_warns_as_eagerly():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, after, _ = _both(lambda t: nn.init.trunc_normal_(t, 5.0, 1.0, -1.0, 1.0))
    assert torch.equal(*values)
    assert torch.equal(*after)
    assert any("more than 2 std" in str(w.message) for w in caught)


def test_an_explicit_generator_is_followed_and_left_as_eagerly():
    def init(t, gen):
        return nn.init.trunc_normal_(t, std=0.02, generator=gen)

    gen = torch.Generator().manual_seed(3)
    eager = init(torch.empty(40, 7), gen)
    eager_state = gen.get_state()
    gen.manual_seed(3)
    with meta_init():
        deferred = init(torch.empty(40, 7), gen)
    assert torch.equal(gen.get_state(), eager_state)
    assert torch.equal(eager, materialize(deferred))


def test_a_non_contiguous_view_goes_through_pytorchs_function():
    values, after, _ = _both(lambda t: nn.init.trunc_normal_(t.t(), std=0.02))
    assert torch.equal(*values)
    assert torch.equal(*after)


def test_the_weights_of_a_model_equal_eager_after_partial_materialization():
    def build():
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(30, 50), nn.GELU(), nn.Linear(50, 30))
        for layer in (m[0], m[2]):
            nn.init.trunc_normal_(layer.weight, std=0.02)
        return m

    eager = build()
    with meta_init():
        deferred = build()
    materialize(deferred[2])  # the later layer first: its stream position is recorded
    materialize(deferred)
    for a, b in zip(eager.state_dict().values(), deferred.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_outside_meta_init_pytorchs_function_is_back():
    with meta_init():
        assert nn.init.trunc_normal_ is trunc_normal.trunc_normal_
    assert nn.init.trunc_normal_ is trunc_normal._original
