"""Exact fills split across cores: bit-identical to the serial fill, generator included."""

from __future__ import annotations

import pytest
import torch

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core.rng import split_fill as _split_fill
from jupyter_metainit.core.rng.split_fill import MIN_CHUNK, split_fill
from jupyter_metainit.core.runtime.pool import CORES_VARIABLE

aten = torch.ops.aten
N = 2 * MIN_CHUNK + 16 * 1000 + 7  # not a multiple of 16: normal_ redraws its last block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    ("func", "args"), [(aten.normal_.default, (0.0, 0.02)), (aten.uniform_.default, (-0.1, 0.1))]
)
def test_split_fill_equals_the_serial_fill(func, args, dtype):
    serial, split = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    func(serial, *args, generator=a)
    done = split_fill(func, split, lambda t, g: func(t, *args, generator=g), b, workers=3)
    assert done
    assert torch.equal(serial.view(-1).view(torch.uint8), split.view(-1).view(torch.uint8))
    assert torch.equal(a.get_state(), b.get_state())


def test_small_or_strided_fills_are_left_to_the_serial_kernel():
    gen = torch.Generator().manual_seed(0)
    fill = lambda t, g: t.normal_(generator=g)  # noqa: E731
    assert not split_fill(aten.normal_.default, torch.empty(1000), fill, gen, workers=4)
    strided = torch.empty(N, 2)[:, 0]
    assert not split_fill(aten.normal_.default, strided, fill, gen, workers=4)


def test_a_large_fill_on_one_core_is_made_in_steps_equal_to_the_serial_fill(monkeypatch):
    # one thread (a replay's group on the pool): still in steps, so that it reports and stops
    # internal size, no setting: steps on a small tensor
    monkeypatch.setattr(_split_fill, "STEP_ELEMENTS", 16 * 1000)
    serial, stepped = torch.empty(N), torch.empty(N)
    a, b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    serial.normal_(generator=a)
    calls = []

    def fill(t, g):
        calls.append(t.numel())
        return t.normal_(generator=g)

    assert split_fill(aten.normal_.default, stepped, fill, b, workers=1)
    assert len(calls) > 100 and max(calls) <= 16 * 1000 + 16
    assert torch.equal(serial, stepped) and torch.equal(a.get_state(), b.get_state())


def test_exact_materialization_splits_large_fills_and_equals_eager(monkeypatch):
    monkeypatch.setenv(CORES_VARIABLE, "2")
    calls = []
    real = _split_fill._fill_in_chunks

    def counting(target, fill, generator, bounds, per_element, parallel, *rest):
        if parallel:  # not the once-per-process check on small tensors
            calls.append(len(bounds))
        return real(target, fill, generator, bounds, per_element, parallel, *rest)

    # internal spy: nothing public says how a fill was cut
    monkeypatch.setattr(_split_fill, "_fill_in_chunks", counting)
    # internal cost: on the native kernels this 8.6 M fill is not worth a jump on two cores
    monkeypatch.setattr(_split_fill, "JUMP_SECONDS", 0.0)
    torch.manual_seed(0)
    eager = torch.nn.Linear(4096, 2100)
    torch.nn.init.normal_(eager.weight, std=0.02)
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_init():
        model = torch.nn.Linear(4096, 2100)
        torch.nn.init.normal_(model.weight, std=0.02)
    materialize(model)
    assert 2 in calls  # the weight was generated as two chunks
    assert torch.equal(model.weight, eager.weight) and torch.equal(model.bias, eager.bias)
    assert torch.equal(torch.get_rng_state(), after_eager)


def _shard_of_a_normal_weight(rank: int, world: int):
    torch.manual_seed(0)
    with meta_init():
        layer = torch.nn.Linear(4096, 2001)  # kaiming_uniform_ (dead) then normal_
        torch.nn.init.normal_(layer.weight, std=0.02)
        shard = layer.weight.chunk(world, dim=0)[rank].clone()
        after = torch.nn.Linear(8, 8)  # later draws must start where eager's do
    return layer, shard, after


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_shard_is_generated_alone_and_exactly(rank, monkeypatch):
    regions = []
    real = _split_fill.fill_region

    def spy(*args, **kwargs):
        done = real(*args, **kwargs)
        regions.append(done)
        return done

    # internal spy: nothing public says which region a fill made
    monkeypatch.setattr("jupyter_metainit.core.replay.random_modes.fill_region", spy)
    torch.manual_seed(0)
    eager = torch.nn.Linear(4096, 2001)
    torch.nn.init.normal_(eager.weight, std=0.02)
    eager_after = torch.nn.Linear(8, 8)
    _layer, shard, after = _shard_of_a_normal_weight(rank, 3)
    materialize(shard)
    assert regions == [True]  # only the shard's rows of the weight were generated
    assert torch.equal(shard, eager.weight.chunk(3, dim=0)[rank])
    materialize(after)
    assert torch.equal(after.weight, eager_after.weight)


def test_a_fast_shard_equals_the_fast_whole():
    layer, shard, _ = _shard_of_a_normal_weight(1, 2)
    materialize(shard, rng="fast")
    materialize(layer, rng="fast")
    assert torch.equal(shard, layer.weight.chunk(2, dim=0)[1])


@pytest.mark.parametrize("rng", ["exact", "fast"])
def test_a_copied_shard_is_generated_straight_into_its_memory(rng, monkeypatch):
    fused = []
    real = _split_fill.fill_region_into

    def spy(*args, **kwargs):
        done = real(*args, **kwargs)
        fused.append(done)
        return done

    # internal spy: nothing public says which region a fill made
    monkeypatch.setattr("jupyter_metainit.core.replay.shards.fill_region_into", spy)
    torch.manual_seed(0)
    with meta_init():
        layer = torch.nn.Linear(4096, 2001)
        torch.nn.init.normal_(layer.weight, std=0.02)
        shard = torch.empty(667, 4096)
        shard.copy_(layer.weight.chunk(3, dim=0)[1])  # as FSDP2 copies a rank's rows
        after = torch.nn.Linear(8, 8)
    materialize(shard, rng=rng)
    assert fused == [True]
    materialize(layer, rng=rng)
    assert torch.equal(shard, layer.weight.chunk(3, dim=0)[1])
    if rng == "exact":
        torch.manual_seed(0)
        eager = torch.nn.Linear(4096, 2001)
        torch.nn.init.normal_(eager.weight, std=0.02)
        eager_after = torch.nn.Linear(8, 8)
        assert torch.equal(layer.weight, eager.weight)
        materialize(after)
        assert torch.equal(after.weight, eager_after.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    ("func", "args"), [(aten.normal_.default, (0.0, 1.0)), (aten.uniform_.default, (-1.0, 1.0))]
)
@pytest.mark.parametrize(
    ("n", "first", "length"),
    [(1000, 500, 500), (1003, 333, 667), (1003, 17, 20), (20487, 4096, 16391), (100005, 99990, 15)],
)
def test_a_slice_filled_through_pieces_equals_the_whole_fill(
    dtype, func, args, n, first, length, monkeypatch
):
    # internal sizes, no setting:
    monkeypatch.setattr(_split_fill, "MIN_CHUNK", 64)  # several spans and pieces on small sizes
    monkeypatch.setattr(_split_fill, "SCRATCH_ELEMENTS", 64)
    whole = torch.empty(n, dtype=dtype)
    whole_gen = torch.Generator().manual_seed(5)
    func(whole, *args, generator=whole_gen)
    part = torch.empty(length, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    fill = lambda t, g: func(t, *args, generator=g)  # noqa: E731
    ends = []
    assert _split_fill.fill_region_into(
        func, n, part, first, fill, gen, workers=2, at_end=ends.append
    )
    expected = whole[first : first + length].contiguous()
    assert torch.equal(part.view(torch.uint8), expected.view(torch.uint8))
    # a part that runs to the fill's end reports where the whole fill leaves the generator
    assert len(ends) == (1 if first + length == n else len(ends))
    assert all(torch.equal(state, whole_gen.get_state()) for state in ends)


def test_a_fill_is_cut_only_where_that_saves_a_quarter_of_its_time():
    assert _split_fill.worth_cutting(1.0, 4) == 4
    assert _split_fill.worth_cutting(_split_fill.JUMP_SECONDS * 2, 2) == 1  # the jump eats it
    assert _split_fill.worth_cutting(0.5, 1) == 1


def test_consecutive_last_shards_continue_the_stream_exactly():
    torch.manual_seed(0)
    with meta_init():
        layers = [torch.nn.Linear(2048, 2049, bias=False) for _ in range(3)]
        for layer in layers:  # back-to-back fills, as post_init draws them
            torch.nn.init.normal_(layer.weight, std=0.02)
        shards = []
        for layer in layers:
            shard = torch.empty(1024, 2048)
            shard.copy_(layer.weight[1025:])  # the last rank's rows
            shards.append(shard)
    materialize(shards)
    torch.manual_seed(0)
    eager = [torch.nn.Linear(2048, 2049, bias=False) for _ in range(3)]
    for layer in eager:
        torch.nn.init.normal_(layer.weight, std=0.02)
    for shard, layer in zip(shards, eager, strict=True):
        assert torch.equal(shard, layer.weight[1025:])
