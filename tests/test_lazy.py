"""Lazy modules (``nn.LazyLinear``) inside ``meta_init``: their parameters take the block's
``dtype`` as eager ones take ``torch.set_default_dtype``'s, with eager's values."""

from __future__ import annotations

import pytest
import torch
from _twins import assert_same, eager_and_deferred
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init

LOW = [torch.float64, torch.bfloat16]


def _lazy_linear() -> nn.Module:
    m = nn.LazyLinear(3)
    m(torch.randn(2, 5))
    return m


def _lazy_conv2d() -> nn.Module:
    m = nn.LazyConv2d(4, 3)
    m(torch.randn(1, 2, 8, 8))
    return m


class _LazyInInit(nn.Module):
    """A custom module whose ``__init__`` runs its lazy layer once to learn its sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.LazyConv2d(4, 3)
        self.head = nn.LazyLinear(2)
        self.head(self.conv(torch.randn(1, 3, 6, 6)).flatten(1))


@pytest.mark.parametrize("dtype", LOW)
def test_lazy_linear_takes_the_block_dtype(dtype):
    eager, m = eager_and_deferred(_lazy_linear, dtype=dtype)
    assert m.weight.dtype == m.bias.dtype == dtype and is_deferred(m)
    materialize(m)
    assert_same(eager, m)


@pytest.mark.parametrize("dtype", LOW)
def test_lazy_conv2d_takes_the_block_dtype(dtype):
    eager, m = eager_and_deferred(_lazy_conv2d, dtype=dtype)
    assert m.weight.dtype == m.bias.dtype == dtype and is_deferred(m)
    materialize(m)
    assert_same(eager, m)


@pytest.mark.parametrize("dtype", LOW)
def test_lazy_layers_run_in_a_custom_init_take_the_block_dtype(dtype):
    eager, m = eager_and_deferred(_LazyInInit, dtype=dtype)
    assert {p.dtype for p in m.parameters()} == {dtype} and is_deferred(m)
    materialize(m)
    assert_same(eager, m)


def test_lazy_linear_output_has_the_block_dtype():
    with meta_init(dtype=torch.float64):
        y = nn.LazyLinear(3)(torch.randn(2, 5))
    assert y.dtype == torch.float64


def test_lazy_linear_explicit_dtype_wins_over_the_block_dtype():
    with meta_init(dtype=torch.float64):
        m = nn.LazyLinear(3, dtype=torch.float16)
        m.weight.materialize((3, 5))
    assert m.weight.dtype == torch.float16
