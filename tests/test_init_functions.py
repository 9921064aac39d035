"""Every ``torch.nn.init`` function and parametrization gives eager's values when deferred."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from jupyter_metainit import materialize, meta_init

INIT_FUNCTIONS = {
    "uniform_": lambda t: nn.init.uniform_(t, -0.3, 0.7),
    "normal_": lambda t: nn.init.normal_(t, 0.1, 2.0),
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "trunc_normal_narrow": lambda t: nn.init.trunc_normal_(t, 0.0, 1.0, -0.1, 0.1),
    "constant_": lambda t: nn.init.constant_(t, 0.25),
    "ones_": nn.init.ones_,
    "zeros_": nn.init.zeros_,
    "eye_": nn.init.eye_,
    "dirac_": nn.init.dirac_,
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": lambda t: nn.init.xavier_normal_(t, gain=nn.init.calculate_gain("relu")),
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=5**0.5),
    "kaiming_normal_": lambda t: nn.init.kaiming_normal_(t, mode="fan_out"),
    "orthogonal_": nn.init.orthogonal_,
    "sparse_": lambda t: nn.init.sparse_(t, 0.3),
}
SHAPES = {
    "1d": (17,),
    "2d_wide": (3, 40),
    "2d_tall": (40, 3),
    "3d": (6, 4, 3),
    "4d": (8, 4, 3, 3),
    "empty": (0, 5),
}


def _run(fn, shape):
    torch.manual_seed(0)
    try:
        return fn(torch.empty(shape)), None
    except Exception as e:
        return None, e


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("name", INIT_FUNCTIONS)
def test_init_function_equals_eager(name, shape):
    fn = INIT_FUNCTIONS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, eager_error = _run(fn, shape)
        with meta_init():
            deferred, deferred_error = _run(fn, shape)
    if eager_error is not None:
        # the same refusal, with the same message
        assert type(deferred_error) is type(eager_error)
        assert str(deferred_error) == str(eager_error)
        return
    assert deferred_error is None, deferred_error
    after = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(fn, shape)
    assert torch.equal(after, torch.get_rng_state())  # the generator moved as eagerly
    materialize(deferred)
    assert torch.equal(deferred, eager)
