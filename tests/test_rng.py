"""RNG policy: exact replay from the right generator state, and fast independent streams."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from _twins import assert_same, deferred, eager_and_deferred
from torch import nn

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core.rng import draws, positions, segments, streams


def _state_after(spec, state, device):
    """The state after ``spec`` drew from ``state``: by its known draw count, else by running
    it on scratch memory (what replay does, op by op)."""
    count = draws.known_draws(spec, device)
    if count is not None:
        return positions.advance_state(state, count)
    return positions.run_on_scratch(spec, state, device)


def build(n=6):
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


def test_exact_last_layer_first_equals_eager():
    torch.manual_seed(0)
    eager = build()
    m = deferred(build)
    materialize(m[5])
    materialize(m[0])
    assert torch.equal(m[5].weight, eager[5].weight)
    assert torch.equal(m[0].bias, eager[0].bias)


def test_exact_burn_through_is_checkpointed_for_later_calls():
    torch.manual_seed(0)
    m = build(6)  # a real model: the stream's state after it is where the deferred one starts
    torch.manual_seed(0)
    with meta_init():
        m = build(6)
    seg = m[5].weight._rec.storage.writes[1].rng.segment
    assert seg.nearest_checkpoint(10) < 10
    materialize(m[5])
    # the states reached are kept: no stream has to be regenerated again to reach them
    assert seg.nearest_checkpoint(10) == 10 and seg.nearest_checkpoint(12) == 12


def test_regenerating_the_stream_is_reported_as_a_phase_not_bytes():
    m = deferred(build)
    seen = []

    def progress(done, total, phase=""):
        seen.append((done, total, phase))

    materialize(m[5].weight, progress=progress)
    assert any("random stream" in phase for _, _, phase in seen)
    assert {total for _, total, _ in seen} == {8 * 8 * 4}  # the weight's memory, from the start
    assert seen[-1][0] == 8 * 8 * 4


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
    m1, m2 = deferred(build), deferred(build)
    materialize(m1, rng="fast")
    materialize(m2[4], rng="fast")
    materialize(m2[0], rng="fast")
    materialize(m2, rng="fast")
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fast_mode_gives_every_tensor_its_own_stream():
    m = deferred(build, 8)
    materialize(m, rng="fast")
    weights = [layer.weight.detach() for layer in m]
    for i in range(len(weights)):
        for j in range(i + 1, len(weights)):
            assert not torch.equal(weights[i], weights[j])


def test_fast_mode_depends_on_the_seed():
    a, b = deferred(build, seed=1), deferred(build, seed=2)
    materialize(a, rng="fast")
    materialize(b, rng="fast")
    assert not torch.equal(a[0].weight, b[0].weight)


class _RandomSubset(nn.Module):
    """A random subset of indices (a data-dependent shape from random values) and tensors
    shaped after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("keep", torch.nonzero(torch.rand(6) > 0.5).flatten())
        self.picked = nn.Parameter(torch.randn(6, 4)[self.keep])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fast_mode_gives_a_shape_computed_from_random_values_its_recorded_values(seed):
    # the subset's shape was recorded from the exact stream: its random inputs replay exact
    eager, m = eager_and_deferred(_RandomSubset, seed=seed)
    materialize(m, rng="fast")
    assert torch.equal(m.keep, eager.keep)
    assert m.picked.shape == eager.picked.shape
    # the rest stays fast: not eager's values
    assert not torch.equal(m.lin.weight, eager.lin.weight)
    assert not torch.equal(m.picked, eager.picked)


def test_fast_generators_differ_per_op():
    seg = segments.RngSegment(torch.get_rng_state(), torch.device("cpu"))
    g0 = positions.fast_generator(seg, 0, torch.device("cpu"))
    g1 = positions.fast_generator(seg, 1, torch.device("cpu"))
    assert g0.initial_seed() != g1.initial_seed()
    assert positions.fast_generator(seg, 0, torch.device("cpu")).initial_seed() == g0.initial_seed()


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
    spec = segments.BurnSpec(func, (("tensor", (n,), (1,), dtype),), {}, True, n * 4)
    real = torch.Generator().manual_seed(7)
    start = real.get_state()
    getattr(torch.empty(n, dtype=dtype), op)(generator=real)
    assert torch.equal(real.get_state(), _state_after(spec, start, torch.device("cpu")))


def test_burn_through_of_large_fills_uses_bounded_scratch_memory():
    spec = segments.BurnSpec(
        torch.ops.aten.normal_.default, (("tensor", (64, 1024), (1024, 1), torch.float32),),
        {}, True, 0,
    )  # fmt: skip
    assert draws.known_draws(spec, torch.device("cpu")) == 64 * 1024


def test_long_burn_through_jumps_ahead_exactly():
    n = 64 * 1024 * 1024 + 5  # above the jump threshold
    uniform = torch.ops.aten.uniform_.default
    spec = segments.BurnSpec(uniform, (("tensor", (n,), (1,), torch.float32),), {}, True, n * 4)
    real = torch.Generator().manual_seed(3)
    start = real.get_state()
    torch.empty(n).uniform_(generator=real)
    assert torch.equal(real.get_state(), _state_after(spec, start, torch.device("cpu")))


class _RandomFactories(nn.Module):
    """Generator-less random factories: ``torch.rand``/``randn``/``randint``/``randperm``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.rand(64, 64))
        self.register_buffer("b", torch.randn(64, 64))
        self.register_buffer("c", torch.randint(0, 100, (64, 64)))
        self.register_buffer("d", torch.randperm(257))
        self.register_buffer("e", torch.rand_like(self.a))


def test_fast_mode_is_deterministic_across_threads_and_leaves_the_callers_rng_alone():
    import concurrent.futures

    def build():
        torch.manual_seed(0)
        with meta_init():
            return _RandomFactories()

    models = [build() for _ in range(8)]
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda m: materialize(m, rng="fast"), models))
    assert torch.equal(torch.get_rng_state(), state)
    first = models[0].state_dict()
    for m in models[1:]:
        for k, v in m.state_dict().items():
            assert torch.equal(v, first[k]), k


def test_exact_mode_leaves_the_callers_rng_alone():
    torch.manual_seed(0)
    with meta_init():
        m = _RandomFactories()
    torch.manual_seed(99)
    state = torch.get_rng_state()
    materialize(m)
    assert torch.equal(torch.get_rng_state(), state)


def test_generator_less_random_factories_are_exact():

    eager, deferred = eager_and_deferred(_RandomFactories)
    materialize(deferred)
    assert_same(eager, deferred)


def _rng_after(build):
    torch.manual_seed(7)
    build()
    return torch.get_rng_state()


@pytest.mark.parametrize(
    "build",
    [
        lambda: build(4),
        lambda: nn.LSTM(8, 8, num_layers=2),  # many small fills, counted draws
        lambda: torch.randperm(1000),  # draws counted by formula
        lambda: torch.empty(7).normal_(),  # fewer than 16 elements: run on scratch memory
        lambda: torch.empty(40, 3)[:, 0].normal_(),  # strided: run on scratch memory
        lambda: nn.functional.dropout(torch.ones(33), 0.3),
        lambda: torch.empty(1000, dtype=torch.float64).uniform_(),
        lambda: torch.empty(100, dtype=torch.int64).random_(),
        lambda: torch.empty(5, 5).bernoulli_(0.5),
    ],
    ids=[
        "linears",
        "lstm",
        "randperm",
        "small_normal",
        "strided_normal",
        "dropout",
        "f64",
        "random_int64",
        "bernoulli",
    ],
)
def test_rng_state_after_a_deferred_build_is_the_eager_one(build):
    eager = _rng_after(build)
    with meta_init():
        deferred = _rng_after(build)
    assert torch.equal(torch.get_rng_state(), eager)
    assert torch.equal(deferred, eager)  # read inside the block, through torch.get_rng_state


def test_random_numbers_drawn_after_a_deferred_build_are_the_eager_ones():
    torch.manual_seed(3)
    build()
    eager_next = torch.rand(5)
    torch.manual_seed(3)
    with meta_init():
        build()
    assert torch.equal(torch.rand(5), eager_next)


def test_ops_recorded_after_the_block_advance_the_generator_like_eager():
    torch.manual_seed(0)
    e = build(2)
    for layer in e:
        nn.init.normal_(layer.weight)
    eager_next = torch.rand(3)
    torch.manual_seed(0)
    with meta_init():
        d = build(2)
    for layer in d:
        nn.init.normal_(layer.weight)
    assert torch.equal(torch.rand(3), eager_next)
    materialize(d)
    for a, b in zip(e.parameters(), d.parameters(), strict=True):
        assert torch.equal(a, b)


class _SavesAndRestores(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        state = torch.get_rng_state()
        self.b = nn.Linear(8, 8)  # drawn from the saved state ...
        torch.set_rng_state(state)
        self.c = nn.Linear(8, 8)  # ... and again: c equals b
        with torch.random.fork_rng():
            torch.manual_seed(5)
            self.d = nn.Linear(8, 8)
        self.e = nn.Linear(8, 8)  # continues after c, as if d never happened
        torch.manual_seed(1)
        self.f = nn.Linear(8, 8)
        torch.manual_seed(1)
        self.g = nn.Linear(8, 8)  # the same seed again: g equals f


class _DirectGeneratorReseeding(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.default_generator
        g.manual_seed(11)
        self.a = nn.Linear(8, 8)
        g.manual_seed(11)
        self.b = nn.Linear(8, 8)
        own = torch.Generator().manual_seed(4)
        self.register_buffer("c", torch.empty(20).normal_(generator=own))
        own.manual_seed(4)
        self.register_buffer("d", torch.empty(20).normal_(generator=own))


@pytest.mark.parametrize("ctor", [_SavesAndRestores, _DirectGeneratorReseeding])
def test_saving_restoring_and_reseeding_inside_constructors_replays_exactly(ctor):

    eager, deferred = eager_and_deferred(ctor)
    materialize(deferred)
    assert_same(eager, deferred)


def test_dropout_without_probability_draws_nothing_and_is_not_rerun():
    qkv = ("tensor", (1, 64, 4096, 128), (0, 0, 0, 0), torch.float32)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    spec = segments.BurnSpec(sdpa, (qkv, qkv, qkv, 0.0), {}, False, 0)
    assert draws.known_draws(spec, torch.device("cpu")) == 0


# Random ops whose number of draws depends on the values they read: a later tensor materialized
# alone needs the generator's position after them.
_VALUE_DEPENDENT_DRAWS = {
    "poisson": lambda rate: torch.poisson(rate * 5),
    "gamma": lambda rate: torch.distributions.Gamma(rate, 1.0).sample(),
    "dirichlet": lambda rate: torch.distributions.Dirichlet(rate).sample(),
    "beta": lambda rate: torch.distributions.Beta(rate, rate + 1).sample(),
    "binomial": lambda rate: torch.binomial(torch.full_like(rate, 20.0), rate / 4),
    "rrelu_train": lambda rate: nn.functional.rrelu(rate - 1.5, training=True),
    "rrelu_inplace": lambda rate: nn.functional.rrelu_(rate - 1.5, training=True),
}


class _DrawsDependOnValues(nn.Module):
    def __init__(self, sample):
        super().__init__()
        self.rate = nn.Parameter(torch.empty(50).uniform_(0.5, 3.0))
        self.register_buffer("sample", sample(self.rate.detach().clone()))
        self.later = nn.Parameter(torch.empty(40).normal_())


@pytest.mark.parametrize("kind", sorted(_VALUE_DEPENDENT_DRAWS))
def test_a_parameter_after_a_value_dependent_random_op_materialized_alone_equals_eager(kind):

    sample = _VALUE_DEPENDENT_DRAWS[kind]
    eager, deferred = eager_and_deferred(lambda: _DrawsDependOnValues(sample))
    materialize(deferred.later)
    assert torch.equal(deferred.later, eager.later)


@pytest.mark.parametrize("kind", sorted(_VALUE_DEPENDENT_DRAWS))
def test_a_value_dependent_random_op_itself_replays_exactly(kind):

    sample = _VALUE_DEPENDENT_DRAWS[kind]
    eager, deferred = eager_and_deferred(lambda: _DrawsDependOnValues(sample))
    materialize(deferred.later)
    materialize(deferred)
    assert_same(eager, deferred)


def test_value_dependent_positions_survive_clearing_the_cache():
    from jupyter_metainit import clear_meta_init_cache

    eager, deferred = eager_and_deferred(
        lambda: _DrawsDependOnValues(_VALUE_DEPENDENT_DRAWS["poisson"])
    )
    clear_meta_init_cache()
    materialize(deferred.later)
    assert torch.equal(deferred.later, eager.later)


def test_value_dependent_random_op_recorded_after_the_block_advances_the_generator_like_eager():
    torch.manual_seed(0)
    rate = nn.Parameter(torch.empty(50).uniform_(0.5, 3.0))
    eager_sample = torch.poisson(rate.detach() * 5)
    eager_next = torch.rand(3)
    torch.manual_seed(0)
    with meta_init():
        deferred_rate = nn.Parameter(torch.empty(50).uniform_(0.5, 3.0))
    deferred_sample = torch.poisson(deferred_rate.detach() * 5)
    assert torch.equal(torch.rand(3), eager_next)
    materialize(deferred_sample)
    assert torch.equal(deferred_sample, eager_sample)


@pytest.mark.parametrize(
    "draw",
    [
        lambda p: torch.randperm(100),
        lambda p: torch.randperm(50, dtype=torch.float32),
        lambda p: torch.bernoulli(p.clamp(0, 1)),
        lambda p: torch.bernoulli(p, 0.3),
        lambda p: torch.empty(7, 5).bernoulli_(p[:5].clamp(0, 1)),
        lambda p: torch.empty(70, dtype=torch.float64).bernoulli_(0.3),
        lambda p: torch.multinomial(p.clamp(0.1).view(5, 10), 3),
        lambda p: torch.multinomial(p.clamp(0.1), 30, replacement=True),
    ],
    ids=[
        "randperm",
        "randperm_float",
        "bernoulli",
        "bernoulli_p",
        "bernoulli_tensor_p",
        "bernoulli_f64",
        "multinomial",
        "multinomial_replacement",
    ],
)
def test_rng_state_after_randperm_bernoulli_multinomial_in_init_is_the_eager_one(draw):
    class Draws(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.randn(50))
            self.register_buffer("drawn", draw(self.p.detach()))
            self.later = nn.Parameter(torch.randn(20))

    eager, deferred = eager_and_deferred(Draws)
    materialize(deferred.later)
    materialize(deferred)
    assert_same(eager, deferred)


def _save_draw_restore(g):
    a = torch.empty(40).normal_(generator=g)
    saved = g.get_state()
    b = torch.empty(40).normal_(generator=g)
    g.set_state(saved)
    c = torch.empty(40).normal_(generator=g)
    return [a, b, c]


def _restore_twice(g):
    a = torch.randn(40, generator=g)
    saved = g.get_state()
    b = torch.randn(40, generator=g)
    g.set_state(saved)
    c = torch.randn(40, generator=g)
    g.set_state(saved)
    d = torch.empty(40).uniform_(generator=g)
    return [a, b, c, d]


def _restore_as_last_step(g):
    a = torch.empty(40).normal_(generator=g)
    saved = g.get_state()
    b = torch.empty(40).normal_(generator=g)
    g.set_state(saved)
    return [a, b]


def _default_generator_save_restore(g):
    a = torch.empty(40).normal_()
    saved = torch.default_generator.get_state()
    b = torch.empty(40).normal_()
    torch.default_generator.set_state(saved)
    c = torch.empty(40).normal_()
    return [a, b, c]


def _state_copied_to_another_generator(g):
    a = torch.empty(40).normal_(generator=g)
    other = torch.Generator()
    other.set_state(g.get_state())
    b = torch.empty(40).normal_(generator=other)
    c = torch.empty(40).normal_(generator=g)
    return [a, b, c]


def _reseeding_mid_build(g):
    a = torch.empty(40).normal_(generator=g)
    g.manual_seed(9)
    b = torch.empty(40).normal_(generator=g)
    torch.manual_seed(3)
    c = torch.empty(40).normal_()
    return [a, b, c]


def _fork_rng_inside(g):
    a = torch.empty(40).normal_(generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        b = torch.empty(40).normal_()
    c = torch.empty(40).normal_()
    d = torch.empty(40).normal_(generator=g)
    return [a, b, c, d]


def _restore_after_value_dependent_op(g):
    a = torch.randn(40, generator=g).abs()
    b = torch.poisson(a * 4, generator=g)
    saved = g.get_state()
    c = torch.randn(40, generator=g)
    g.set_state(saved)
    d = torch.randn(40, generator=g)
    return [a, b, c, d]


_GENERATOR_USES = [
    _save_draw_restore, _restore_twice, _restore_as_last_step, _default_generator_save_restore,
    _state_copied_to_another_generator, _reseeding_mid_build, _fork_rng_inside,
    _restore_after_value_dependent_op,
]  # fmt: skip


def _build_with_generator(use, deferred):
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    if deferred:
        with meta_init():
            tensors = use(g)
    else:
        tensors = use(g)
    return tensors, g.get_state(), torch.get_rng_state()


@pytest.mark.parametrize("use", _GENERATOR_USES, ids=lambda f: f.__name__.strip("_"))
def test_the_last_draw_after_saving_and_restoring_a_generator_equals_eager_alone(use):
    eager, _, _ = _build_with_generator(use, deferred=False)
    deferred, _, _ = _build_with_generator(use, deferred=True)
    materialize(deferred[-1])
    assert torch.equal(deferred[-1], eager[-1])
    materialize(deferred)
    for a, b in zip(eager, deferred, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use", _GENERATOR_USES, ids=lambda f: f.__name__.strip("_"))
def test_generator_states_after_a_build_that_saves_and_restores_equal_eager(use):
    _, eager_g, eager_global = _build_with_generator(use, deferred=False)
    _, deferred_g, deferred_global = _build_with_generator(use, deferred=True)
    assert torch.equal(deferred_g, eager_g)
    assert torch.equal(deferred_global, eager_global)


def test_initial_seeds_read_during_a_build_are_the_eager_ones():
    def build_and_read():
        g = torch.Generator().manual_seed(5)
        torch.manual_seed(0)
        torch.empty(40).normal_(generator=g)
        torch.empty(40).normal_()
        return torch.initial_seed(), g.initial_seed()

    eager = build_and_read()
    with meta_init():
        deferred = build_and_read()
    assert deferred == eager


def test_a_value_dependent_sample_of_a_transposed_input_read_during_the_build_equals_eager():
    class ReadsItsSample(nn.Module):
        def __init__(self):
            super().__init__()
            rate = torch.empty(5, 10).uniform_(0.5, 3.0)
            self.register_buffer("sample", torch.poisson(rate.t() * 4)[1:, ::2])
            self.total = float(self.sample.sum())  # a read: values computed during the build
            self.later = nn.Parameter(torch.randn(20))

    eager, deferred = eager_and_deferred(ReadsItsSample)
    assert deferred.total == eager.total
    materialize(deferred)
    assert_same(eager, deferred)


def test_a_generator_state_saved_in_one_block_and_restored_in_the_next_replays_like_eager():
    def build(deferred):
        g = torch.Generator().manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            first = torch.randn(40, generator=g)
            saved = g.get_state()
            torch.randn(40, generator=g)
        with meta_init() if deferred else contextlib.nullcontext():
            g.set_state(saved)
            again = torch.randn(40, generator=g)
        return first, again, g.get_state()

    eager_first, eager_again, eager_state = build(deferred=False)
    first, again, state = build(deferred=True)
    materialize(again)
    assert torch.equal(again, eager_again)
    assert torch.equal(state, eager_state)
    materialize(first)
    assert torch.equal(first, eager_first)


def test_real_random_work_on_a_generator_given_a_saved_state_draws_like_eager():
    real = torch.empty(30)

    def build(deferred):
        g = torch.Generator().manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            torch.randn(40, generator=g)
            other = torch.Generator()
            other.set_state(g.get_state())
            real.normal_(generator=other)  # a real tensor: drawn now, from `other`
            return real.clone(), other.get_state()

    eager_values, eager_state = build(deferred=False)
    values, state = build(deferred=True)
    assert torch.equal(values, eager_values)
    assert torch.equal(state, eager_state)


# Every kind of recorded random op, on an explicit generator (None: the default CPU one): known
# draw counts (left pending, lazily), counts found by re-running on scratch memory, and counts
# that depend on the values read.
_RANDOM_OPS = {
    "rand": lambda g: torch.rand(100, generator=g),
    "randn": lambda g: torch.randn(100, generator=g),
    "randn_small": lambda g: torch.randn(3, generator=g),
    "randperm": lambda g: torch.randperm(6, generator=g),
    "randint": lambda g: torch.randint(10, (5,), generator=g),
    "randint_wide": lambda g: torch.randint(-(1 << 40), 1 << 40, (5,), generator=g),
    "uniform_": lambda g: torch.empty(50).uniform_(generator=g),
    "normal_": lambda g: torch.empty(50).normal_(generator=g),
    "normal_strided": lambda g: torch.empty(8, 8).t().normal_(generator=g),
    "bernoulli_": lambda g: torch.empty(5).bernoulli_(0.5, generator=g),
    "bernoulli": lambda g: torch.bernoulli(torch.full((7,), 0.3), generator=g),
    "multinomial": lambda g: torch.multinomial(torch.ones(5), 3, generator=g),
    "exponential_": lambda g: torch.empty(9).exponential_(generator=g),
    "cauchy_": lambda g: torch.empty(9).cauchy_(generator=g),
    "geometric_": lambda g: torch.empty(9).geometric_(0.3, generator=g),
    "log_normal_": lambda g: torch.empty(9).log_normal_(generator=g),
    "random_": lambda g: torch.empty(9, dtype=torch.int64).random_(generator=g),
    "poisson": lambda g: torch.poisson(torch.full((6,), 3.0), generator=g),
    "normal_tensor": lambda g: torch.normal(torch.zeros(6), torch.ones(6), generator=g),
}


def _state_after_op(op, explicit, deferred):
    if explicit:
        g = torch.Generator().manual_seed(5)
        read = g
    else:
        torch.manual_seed(5)
        g, read = None, torch.default_generator
    with meta_init() if deferred else contextlib.nullcontext():
        op(g)
        saved = read.get_state()
    return saved


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "default"])
@pytest.mark.parametrize("name", sorted(_RANDOM_OPS))
def test_a_state_saved_right_after_a_recorded_random_op_draws_like_eager_outside_the_block(
    name, explicit
):
    later = []
    for recorded in (False, True):
        fresh = torch.Generator()
        fresh.set_state(_state_after_op(_RANDOM_OPS[name], explicit, recorded))
        later.append(torch.randn(30, generator=fresh))
    assert torch.equal(later[1], later[0])


def test_a_generator_pickled_during_a_build_carries_the_eager_state():
    import pickle

    def pickled(deferred):
        g = torch.Generator().manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            torch.rand(100, generator=g)
            return pickle.loads(pickle.dumps(g)).get_state()

    assert torch.equal(pickled(deferred=True), pickled(deferred=False))


def test_a_generator_state_cloned_during_a_build_carries_the_eager_state():
    def cloned(deferred):
        g = torch.Generator().manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            torch.rand(100, generator=g)
            return g.clone_state().get_state()

    assert torch.equal(cloned(deferred=True), cloned(deferred=False))


# Ways to keep a saved state that make a new tensor inside the block (a deferred one).
_STATE_COPIES = {
    "clone": lambda st: st.clone(),
    "deepcopy": lambda st: copy.deepcopy(st),
    "from_numpy": lambda st: torch.from_numpy(st.numpy().copy()),
    "tensor": lambda st: torch.tensor(st.numpy()),
    "slice": lambda st: st[:],
    "cat": lambda st: torch.cat([st[:100], st[100:]]),
    "to_int_and_back": lambda st: st.to(torch.int32).to(torch.uint8),
    "copy_into_empty": lambda st: torch.empty_like(st).copy_(st),
    "torch_save_load": lambda st: _saved_and_loaded(st),
}


def _saved_and_loaded(t):
    import io

    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("name", sorted(_STATE_COPIES))
def test_restoring_a_copy_of_a_saved_state_inside_the_block_draws_like_eager(name):
    def build(deferred):
        g = torch.Generator().manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            torch.rand(100, generator=g)
            saved = g.get_state()
            torch.randn(2, generator=g)
            g.set_state(_STATE_COPIES[name](saved))
            return torch.randn(20, generator=g), g.get_state()

    eager, eager_state = build(deferred=False)
    deferred, deferred_state = build(deferred=True)
    assert torch.equal(materialize(deferred), eager)
    assert torch.equal(deferred_state, eager_state)


def test_restoring_a_copy_of_a_saved_state_with_torch_set_rng_state_draws_like_eager():
    def build(deferred):
        torch.manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            torch.rand(100)
            saved = torch.get_rng_state()
            torch.randn(2)
            torch.set_rng_state(saved.clone())
            return torch.randn(20)

    eager = build(deferred=False)
    assert torch.equal(materialize(build(deferred=True)), eager)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs a machine without cuda:1")
def test_a_build_for_an_absent_gpu_draws_from_the_cpu_stream_as_eager_code_on_the_cpu():
    torch.manual_seed(0)
    eager = nn.Linear(8, 8)
    eager_state = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_init():
        model = nn.Linear(8, 8, device="cuda:1")
    assert torch.equal(torch.get_rng_state(), eager_state)
    materialize(model, device="cpu")
    assert torch.equal(model.weight, eager.weight) and torch.equal(model.bias, eager.bias)


def _segments_of(build_model):
    """The model ``build_model()`` returns, and weak references to the RNG segments it made."""
    before = segments.live_segments()
    model = build_model()
    made = [weakref.ref(s) for s in segments.live_segments() if not any(s is b for b in before)]
    return model, made


@pytest.mark.parametrize("how", ["deferred", "materialized", "kept for dematerialize"])
def test_a_builds_rng_checkpoints_live_and_die_with_its_model(how):
    model, made = _segments_of(lambda: deferred(build, 24))
    assert made
    if how != "deferred":
        materialize(model[3], keep_cache=how != "materialized")  # exact: checkpoints made
        assert all(len(ref().checkpoints) > 1 for ref in made)
        materialize(model, keep_cache=how != "materialized")
    gc.collect()
    alive = how != "materialized"  # dematerialize replays them; deferred parts too
    assert all((ref() is not None) == alive for ref in made)
    del model
    gc.collect()
    assert all(ref() is None for ref in made)


def test_a_generator_made_in_each_rebuilt_model_is_not_kept_once_its_model_is_gone():
    def build_with_own_generator():
        g = torch.Generator().manual_seed(1)
        with meta_init():
            model = nn.Linear(4, 4)
            nn.init.normal_(model.weight, generator=g)
        return model

    materialize(build_with_own_generator())
    gc.collect()  # a build's records hold each other in cycles
    trackers = len(streams._trackers)
    for _ in range(5):
        materialize(build_with_own_generator())
        gc.collect()
    assert len(streams._trackers) <= trackers


def test_a_state_saved_mid_build_still_stands_for_the_eager_state_once_that_model_is_gone():
    def again(deferred):
        g = torch.Generator().manual_seed(5)
        with meta_init() if deferred else contextlib.nullcontext():
            first = torch.randn(40, generator=g)
            saved = torch._C.Generator.get_state(g)  # unwrapped: while deferred, a mark
        del first
        gc.collect()
        with meta_init() if deferred else contextlib.nullcontext():
            other = torch.Generator()
            other.set_state(saved)
            return torch.randn(40, generator=other)

    assert torch.equal(materialize(again(deferred=True)), again(deferred=False))


def test_a_stream_whose_earlier_ops_are_all_gone_continues_like_eager():
    def build(deferred):
        torch.manual_seed(3)
        with meta_init() if deferred else contextlib.nullcontext():
            torch.randn(1000)  # dropped at once: nothing can replay it
            gc.collect()
            return torch.randn(10), torch.empty(7).normal_()

    eager = build(deferred=False)
    got = build(deferred=True)
    assert all(torch.equal(materialize(t), e) for t, e in zip(got, eager, strict=True))
