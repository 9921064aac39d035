"""``torch.utils.swap_tensors`` and PyTorch's swap-on-conversion on deferred and materialized
models, as on eager ones (``core/runtime/swap``)."""

from __future__ import annotations

import weakref

import pytest
import torch
from _twins import deferred, eager_and_deferred
from torch import nn

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.materialize.walk import materialized_sources

KINDS = ["eager", "deferred", "materialized"]


@pytest.fixture
def swap_on_conversion():
    """``torch.__future__.set_swap_module_params_on_conversion(True)``, restored afterwards."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.register_buffer("scale", torch.rand(5))


def _model(kind: str, **materialize_options) -> Net:
    if kind == "eager":
        torch.manual_seed(0)
        return Net()
    model = deferred(Net)
    if kind == "materialized":
        materialize(model, **materialize_options)
    return model


def _assert_equals_eager(model: nn.Module, eager: nn.Module) -> None:
    materialize(model)
    got, ref = model.state_dict(), eager.state_dict()
    assert got.keys() == ref.keys()
    for key in ref:
        assert got[key].dtype == ref[key].dtype, key
        assert torch.equal(got[key], ref[key]), key


CONVERSIONS = {
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "to": lambda m: m.to(torch.float64),
    "to_bfloat16": lambda m: m.to(dtype=torch.bfloat16),
}


@pytest.mark.parametrize("kind", ["deferred", "materialized"])
@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_a_conversion_that_swaps_parameters_gives_eagers_values(
    swap_on_conversion, conversion, kind
):
    eager = CONVERSIONS[conversion](_model("eager"))
    model = _model(kind)
    weight = model.lin.weight
    CONVERSIONS[conversion](model)
    assert model.lin.weight is weight  # swapped into the same object, as eager's
    assert is_deferred(model.lin.weight) == (kind == "deferred")  # deferred stays deferred
    _assert_equals_eager(model, eager)


@pytest.mark.parametrize("kind", ["deferred", "materialized"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "set_data"])
def test_load_state_dict_with_assign_gives_the_loaded_tensors_as_eager_does(kind, swap):
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        results = []
        for k in ("eager", kind):
            torch.manual_seed(1)
            state = {
                key: torch.randn_like(v, device="cpu") for key, v in Net().state_dict().items()
            }
            model = _model(k)
            weight = model.lin.weight
            model.load_state_dict(state, assign=True)
            results.append((model, model.lin.weight is weight, state))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    (eager, eager_kept, _), (model, kept, state) = results
    assert kept == eager_kept  # the same object under swap, a new one otherwise
    assert not is_deferred(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, eager.state_dict()[key]) and torch.equal(value, state[key])
    assert isinstance(model.lin.weight, nn.Parameter)


def test_load_state_dict_into_a_deferred_model_under_swap_stays_deferred_and_loads(
    swap_on_conversion,
):
    torch.manual_seed(1)
    state = {key: torch.randn_like(v) for key, v in Net().state_dict().items()}
    model = _model("deferred")
    model.load_state_dict(state)
    assert is_deferred(model.lin.weight)
    materialize(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("kind", KINDS)
def test_swap_tensors_on_a_parameter_exchanges_contents_as_on_an_eager_one(kind):
    eager = _model("eager")
    model = _model(kind)
    weight = model.lin.weight
    other = nn.Parameter(torch.full((5, 6), 7.0))
    torch.utils.swap_tensors(model.lin.weight, other)
    assert model.lin.weight is weight
    assert torch.equal(model.lin.weight, torch.full((5, 6), 7.0))
    assert not is_deferred(model.lin.weight)
    # The other object holds what the parameter held: a deferred one is still materializable.
    assert is_deferred(other) == (kind == "deferred")
    assert torch.equal(materialize(other), eager.lin.weight)


def test_swap_tensors_still_refuses_a_tensor_someone_else_holds_a_weak_reference_to():
    model = _model("materialized")
    theirs = weakref.ref(model.lin.weight)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(model.lin.weight, nn.Parameter(torch.zeros(5, 6)))
    assert theirs() is model.lin.weight
    assert model.lin.weight in materialized_sources  # what the package knew is put back


def test_a_materialized_parameter_keeps_what_the_package_knows_of_it_through_a_swap(
    swap_on_conversion,
):
    model = _model("materialized", keep_cache=True)
    model.double()
    assert materialized_sources[model.lin.weight] == "init"
    # As after ``param.data = ...``: the recording kept no longer gives these values.
    with pytest.raises(MaterializationError, match="written since it was materialized"):
        dematerialize(model.lin)
    assert not is_deferred(model)


def test_a_deferred_model_converted_under_swap_then_materialized_on_its_own_equals_eager(
    swap_on_conversion,
):
    eager = _model("eager").double()
    model = _model("deferred").double()
    materialize(model.lin.weight)  # a part first: the rest still replays from the recording
    _assert_equals_eager(model, eager)


class WithView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.w_t = self.w.detach().t()  # a view of w's memory


def test_a_deferred_view_of_memory_swapped_out_stays_a_view_of_that_memory_as_in_eager():
    eager, model = eager_and_deferred(WithView)
    materialize(model.w)
    other = nn.Parameter(torch.zeros(3, 4))
    torch.utils.swap_tensors(model.w, other)
    torch.utils.swap_tensors(eager.w, nn.Parameter(torch.zeros(3, 4)))
    materialize(model.w_t)  # the memory it views is `other`'s now
    assert model.w_t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
    assert torch.equal(model.w_t, eager.w_t) and torch.equal(model.w, eager.w)


def test_a_real_tensor_used_in_a_recording_can_be_swapped_and_is_then_seen_as_changed():
    data = torch.randn(1 << 19)  # 2 MiB: watched by its digest, not copied (limits.md)
    with meta_init():
        doubled = data * 2
    torch.utils.swap_tensors(data, torch.zeros(1 << 19))
    with pytest.raises(MaterializationError, match="written after it was recorded"):
        materialize(doubled)  # as after data.zero_(): the recording read other values
    assert is_deferred(doubled)
