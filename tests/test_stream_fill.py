"""A run of one stream's fills cut across cores: bit-identical to the serial fills and state."""

from __future__ import annotations

import itertools

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit.core import values_to_write
from jupyter_metainit.core.replay import stream_fills
from jupyter_metainit.core.rng import stream_fill
from jupyter_metainit.core.rng.draws import draws_per_element
from jupyter_metainit.core.rng.split_fill import ALIGN
from jupyter_metainit.core.rng.stream_fill import StreamFill, fill_stream
from jupyter_metainit.core.runtime.pool import CORES_VARIABLE

aten = torch.ops.aten


def _draws(func, n: int, dtype: torch.dtype) -> int:
    gen = torch.Generator().manual_seed(0)
    before = torch.Generator().manual_seed(0)
    func(torch.empty(n, dtype=dtype), generator=gen)
    for k in range(0, 4 * n + 64):  # the smallest k whose draws reach the same state
        probe = torch.Generator()
        probe.set_state(before.get_state())
        torch.empty(k, dtype=torch.float32).uniform_(generator=probe)
        if torch.equal(probe.get_state(), gen.get_state()):
            return k
    raise AssertionError("draw count not found")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("func", [aten.normal_.default, aten.uniform_.default])
@pytest.mark.parametrize("workers", [2, 3, 5])
def test_a_run_of_fills_cut_across_threads_equals_the_serial_fills(func, dtype, workers):
    sizes, gaps = [1000, 37, 16 * 50 + 9, 2048, 333], [0, 5, 0, 700, 1]
    start = torch.Generator().manual_seed(11)
    serial_gen = torch.Generator().manual_seed(11)
    serial, fills, offset = [], [], 0
    for n, gap in zip(sizes, gaps, strict=True):
        if gap:  # the draws of another op of the stream (dead: skipped)
            torch.empty(gap, dtype=torch.float32).uniform_(generator=serial_gen)
        offset += gap
        t = torch.empty(n, dtype=dtype)
        func(t, generator=serial_gen)
        serial.append(t)
        draws = _draws(func, n, dtype)
        target = torch.empty(n, dtype=dtype)
        fill = lambda x, g: func(x, generator=g)  # noqa: E731
        fills.append(StreamFill(target, fill, offset, draws, draws_per_element(dtype), ALIGN[func]))
        offset += draws
    end = fill_stream(fills, start.get_state(), workers)
    for f, expected in zip(fills, serial, strict=True):
        assert torch.equal(f.target.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(end, serial_gen.get_state())


def test_the_cuts_fall_on_the_kernels_blocks_and_cover_every_element():
    fills = [StreamFill(torch.empty(n), None, 0, n, 1, 16) for n in (100, 5, 4000, 17, 999)]
    parts = stream_fill._parts(fills, 4)
    assert len(parts) <= 4
    seen = {i: [] for i in range(len(fills))}
    for part in parts:
        for i, a, b in part:
            n = fills[i].target.numel()
            assert a % 16 == 0 and (b == n or (b % 16 == 0 and n - b >= 16)) and b - a > 0
            seen[i].append((a, b))
    for i, spans in seen.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == fills[i].target.numel()
        assert all(x[1] == y[0] for x, y in itertools.pairwise(spans))


def _streams_counted(monkeypatch) -> list[int]:
    """Three cores and no size floor for the stream path; the returned list gets the number of
    fills of each run of fills cut across the cores."""
    monkeypatch.setenv(CORES_VARIABLE, "3")
    # internal size and spy, no setting: small fills take the stream path, counted
    monkeypatch.setattr(stream_fills, "MIN_STREAM_ELEMENTS", 1)
    used: list[int] = []
    real_fill_stream = stream_fills.fill_stream
    monkeypatch.setattr(
        stream_fills, "fill_stream", lambda *a: used.append(len(a[0])) or real_fill_stream(*a)
    )
    return used


def test_values_to_write_of_a_batch_cuts_its_fills_across_cores_and_equals_eager(monkeypatch):
    used = _streams_counted(monkeypatch)

    def build() -> nn.Module:
        bf16 = {"dtype": torch.bfloat16}
        model = nn.Sequential(nn.Linear(300, 200, **bf16), nn.LayerNorm(200, **bf16),
                              nn.Linear(200, 77, **bf16))  # fmt: skip
        for layer in (model[0], model[2]):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.uniform_(layer.bias, -0.1, 0.1)
        return model

    eager, deferred = eager_and_deferred(build, seed=5)
    names = list(dict(deferred.named_parameters()))
    values = values_to_write([dict(deferred.named_parameters())[n] for n in names])
    assert used, "the batch's fills did not run as one stream"
    for name, value in zip(names, values, strict=True):
        assert torch.equal(value, dict(eager.named_parameters())[name].detach()), name
    # the stream continues where the batch ended: a later read needs no jump and is exact
    assert torch.equal(values_to_write(deferred[2].weight), eager[2].weight.detach())


def test_parts_are_reported_final_while_the_rest_is_generated(monkeypatch):
    # internal size, no setting: several reports on a small fill
    monkeypatch.setattr(stream_fill, "REPORT_ELEMENTS", 1000)
    gen = torch.Generator().manual_seed(2)
    serial = [torch.empty(n, dtype=torch.bfloat16).normal_(generator=gen) for n in (5000, 333)]
    fills = [
        StreamFill(torch.empty(n, dtype=torch.bfloat16), lambda x, g: x.normal_(generator=g),
                   start, draws, 1, 16)
        for n, start, draws in ((5000, 0, 5008), (333, 5008, 336))
    ]  # fmt: skip
    seen = []

    def on_piece(i, a, b):  # the values reported are final when reported
        seen.append((i, a, b))
        assert torch.equal(fills[i].target[a:b], serial[i][a:b])

    fill_stream(fills, torch.Generator().manual_seed(2).get_state(), 2, on_piece)
    assert sum(b - a for _, a, b in seen) == 5333
    assert max(b - a for _, a, b in seen) <= 1000 + 16


def test_a_lone_fill_runs_cut_across_cores_its_parts_told_as_final(monkeypatch):
    # A batch of one large tensor (an embedding) goes the same way as a run of fills.
    used = _streams_counted(monkeypatch)
    eager, deferred = eager_and_deferred(lambda: nn.Embedding(500, 64), seed=7)
    told = []
    [value] = values_to_write([deferred.weight], on_part=lambda k, a, b, flat: told.append(b - a))
    assert used == [1]
    assert torch.equal(value, eager.weight.detach())
    assert sum(told) == 500 * 64
