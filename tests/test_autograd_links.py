"""Autograd links of materialized non-leaves (``core/materialize/autograd_links``): a tensor
computed in ``__init__`` from parameters, in grad mode, keeps eager's ``grad_fn`` when its
parameters are materialized in the same call, and its gradients equal eager's."""

from __future__ import annotations

import warnings

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn
from torch.nn.utils import parametrizations

from jupyter_metainit import materialize


class _SpectralSnapshot(nn.Module):
    """A spectral-normalized weight read in ``__init__`` (train mode): the power iteration runs
    under ``no_grad`` and writes ``_u``/``_v`` with ``out=``; the division is a graph node."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = parametrizations.spectral_norm(nn.Linear(6, 6))
        self.w = self.lin.weight
        self.w_again = self.lin.weight  # after one more power iteration


class _OldSpectralNorm(nn.Module):
    """``torch.nn.utils.spectral_norm``: the weight attribute a forward in ``__init__`` sets."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.lin = nn.utils.spectral_norm(nn.Linear(6, 6))
        self.lin(torch.ones(1, 6))
        self.w = self.lin.weight


def _original(m: nn.Module) -> torch.Tensor:
    lin = m.lin
    return (
        lin.parametrizations.weight.original
        if hasattr(lin, "parametrizations")
        else lin.weight_orig
    )


@pytest.mark.parametrize("build", [_SpectralSnapshot, _OldSpectralNorm])
def test_a_spectral_norm_weight_from_init_passes_eager_gradients_to_its_parameter(build):
    eager, m = eager_and_deferred(build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "materialized as a leaf" warning
        materialize(m)
    assert type(m.w.grad_fn) is type(eager.w.grad_fn)  # DivBackward0, not a leaf
    for name, value in eager.state_dict().items():
        assert torch.equal(m.state_dict()[name], value), name
    assert torch.equal(m.w, eager.w)
    m.w.sum().backward()
    eager.w.sum().backward()
    assert torch.equal(_original(m).grad, _original(eager).grad)


def test_a_second_spectral_norm_snapshot_passes_eager_gradients_too():
    eager, m = eager_and_deferred(_SpectralSnapshot)
    materialize(m)
    assert torch.equal(m.w_again, eager.w_again) and not m.w_again.is_leaf
    (m.w_again * m.w).sum().backward()
    (eager.w_again * eager.w).sum().backward()
    assert torch.equal(_original(m).grad, _original(eager).grad)
