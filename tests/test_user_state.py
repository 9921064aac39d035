"""What the user's code made of a tensor survives materialize: here, being an inference tensor
(made under ``torch.inference_mode()``), as eager construction makes it."""

from __future__ import annotations

import pytest
import torch
from _twins import assert_same, eager_and_deferred
from torch import nn

from jupyter_metainit import dematerialize, materialize
from jupyter_metainit.core.errors import MaterializationError


class Tables(nn.Module):
    """Buffers made under ``torch.inference_mode()`` (a rotary table, a view of one) beside
    ordinary parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.inference_mode():
            self.register_buffer("table", torch.randn(6))
            ramp = torch.arange(8.0)
            self.register_buffer("ramp", ramp)
            self.register_buffer("tail", ramp[3:])


class BuiltForInference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.lin = nn.Linear(3, 2)


def _inference_flags(model: nn.Module) -> dict[str, bool]:
    return {name: t.is_inference() for name, t in model.state_dict(keep_vars=True).items()}


@pytest.mark.parametrize("rng", ["exact", "fast"])
def test_a_buffer_made_under_inference_mode_is_an_inference_tensor_once_materialized(rng):
    eager, model = eager_and_deferred(Tables)
    materialize(model, rng=rng)
    assert _inference_flags(model) == _inference_flags(eager)
    assert _inference_flags(model)["table"] and not _inference_flags(model)["lin.weight"]
    if rng == "exact":
        assert_same(eager, model)


def test_inference_buffers_over_one_memory_still_share_it():
    _, model = eager_and_deferred(Tables)
    materialize(model)
    assert model.tail.untyped_storage().data_ptr() == model.ramp.untyped_storage().data_ptr()
    assert torch.equal(model.tail, torch.arange(3.0, 8.0))


def test_inference_buffers_materialized_one_by_one_are_inference_tensors():
    eager, model = eager_and_deferred(Tables)
    materialize(model.tail)
    materialize(model.ramp)
    materialize(model)
    assert _inference_flags(model) == _inference_flags(eager)
    assert_same(eager, model)


def test_parameters_of_a_layer_built_under_inference_mode_come_back_as_eagers():
    eager, model = eager_and_deferred(BuiltForInference)
    materialize(model)
    for got, ref in zip(model.parameters(), eager.parameters(), strict=True):
        assert type(got) is type(ref)
        assert (got.is_inference(), got.requires_grad) == (ref.is_inference(), ref.requires_grad)
        assert torch.equal(got, ref)


def test_an_inference_buffer_freed_and_materialized_again_is_an_inference_tensor():
    eager, model = eager_and_deferred(Tables)
    materialize(model, keep_cache=True)
    dematerialize(model)
    materialize(model)
    assert _inference_flags(model) == _inference_flags(eager)
    assert_same(eager, model)


def test_an_inference_buffer_written_since_it_was_materialized_is_not_freed():
    _, model = eager_and_deferred(Tables)
    materialize(model, keep_cache=True)
    with torch.inference_mode():
        model.table.add_(1)  # no version counter to tell: the digest of its memory does
    with pytest.raises(MaterializationError, match="table"):
        dematerialize(model)
    assert model.table.is_inference()
