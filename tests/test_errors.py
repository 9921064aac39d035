"""Failures leave every tensor deferred and still materializable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import MaterializationError, MetaInitError


def test_exception_in_replay_leaves_the_model_deferred():
    outside = torch.ones(4)
    with meta_init():
        good = nn.Linear(4, 4)
        bad = nn.Parameter(outside * 3)
    model = nn.ParameterList([good.weight, bad])
    outside.mul_(2)  # makes `bad` impossible to replay
    with pytest.raises(MaterializationError):
        materialize(model)
    assert is_deferred(good.weight) and is_deferred(bad)
    materialize(good)
    assert not is_deferred(good)


def test_errors_share_a_base_class():
    assert issubclass(MaterializationError, MetaInitError)
    assert issubclass(MetaInitError, RuntimeError)


def test_uninitialized_lazy_module_says_to_run_a_forward_pass():
    with meta_init():
        m = nn.LazyLinear(3)
    with pytest.raises(MaterializationError, match="forward pass"):
        materialize(m)


def test_plain_meta_device_tensors_say_how_to_record_them():
    with torch.device("meta"):
        m = nn.Linear(2, 2)
    with pytest.raises(MaterializationError, match="meta_init"):
        materialize(m)
