"""skip_init: uninitialised parameters, also for modules without a device argument."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, skip_init


def test_positional_and_keyword_arguments():
    m = skip_init(nn.Linear, 5, 1)
    assert m.weight.shape == (1, 5) and not is_deferred(m)
    m2 = skip_init(nn.Linear, in_features=6, out_features=1)
    assert m2.weight.shape == (1, 6) and type(m2.weight) is nn.Parameter


def test_module_without_device_argument():
    class NoDevice(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.w = nn.Parameter(torch.randn(n, n))
            self.register_buffer("b", torch.ones(n))

    m = skip_init(NoDevice, 4)
    assert m.w.shape == (4, 4) and m.b.shape == (4,) and not is_deferred(m)
    assert m.w.requires_grad and m.w.device == torch.device("cpu")


def test_rejects_non_modules():
    with pytest.raises(TypeError, match="Module subclass"):
        skip_init(dict)


def test_skip_init_keeps_a_parameter_subclass():
    class Tagged(nn.Parameter):
        pass

    class WithTagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = Tagged(torch.randn(2))

    assert type(skip_init(WithTagged).w) is Tagged
