"""Exact fills split across cores: bit-identical to the serial fill, generator included."""

from __future__ import annotations

import pytest
import torch

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core import _split_fill
from jupyter_metainit.core._split_fill import MIN_CHUNK, split_fill

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
    assert not split_fill(aten.normal_.default, torch.empty(N), fill, gen, workers=1)


def test_exact_materialization_splits_large_fills_and_equals_eager(monkeypatch):
    monkeypatch.setattr(_split_fill, "available_cores", lambda: 2)
    calls = []
    real = _split_fill._fill_in_chunks

    def counting(target, fill, generator, bounds, per_element, parallel):
        if parallel:  # not the once-per-process check on small tensors
            calls.append(len(bounds))
        return real(target, fill, generator, bounds, per_element, parallel)

    monkeypatch.setattr(_split_fill, "_fill_in_chunks", counting)
    torch.manual_seed(0)
    eager = torch.nn.Linear(2048, 1500)
    torch.nn.init.normal_(eager.weight, std=0.02)
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_init():
        model = torch.nn.Linear(2048, 1500)
        torch.nn.init.normal_(model.weight, std=0.02)
    materialize(model)
    assert 2 in calls  # the weight was generated as two chunks
    assert torch.equal(model.weight, eager.weight) and torch.equal(model.bias, eager.bias)
    assert torch.equal(torch.get_rng_state(), after_eager)
