"""``save`` writes what ``materialize`` would give, also for a deferred view of memory an earlier
``materialize`` made real and that was changed in place since (``replay.realized``'s rule):
the view's values are the memory's values now, not its recording's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _twins import eager_and_deferred
from safetensors.torch import load_file
from torch import nn

from jupyter_metainit import is_deferred, materialize
from jupyter_metainit.saving import save
from jupyter_metainit.saving.writer import WRITE_VARIABLE


class _Views(nn.Module):
    """A parameter and buffers that are views of it (they share its memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.register_buffer("rows", self.w.data[2:4])
        self.register_buffer("w_t", self.w.data.t())
        self.register_buffer("flat", self.w.data.view(24))


def _edited_after_materializing(part: str) -> tuple[nn.Module, nn.Module]:
    """Eager and deferred twins; ``part`` of the deferred one materialized, then the same
    in-place change made to both through it."""
    eager, deferred = eager_and_deferred(_Views, seed=4)
    materialize(getattr(deferred, part))
    with torch.no_grad():
        getattr(deferred, part).mul_(3)
        getattr(eager, part).mul_(3)
    return eager, deferred


def _materialized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    materialize(model)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("path", ["direct", "mapped", "pwrite"])
def test_a_view_of_a_materialized_then_edited_parameter_is_saved_with_its_values_now(
    tmp_path, monkeypatch, path
):
    monkeypatch.setenv(WRITE_VARIABLE, path)  # the way save tries first
    eager, deferred = _edited_after_materializing("w")
    assert is_deferred(deferred.rows)
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved["rows"], eager.rows)


@pytest.mark.parametrize("alias", ["w_t", "flat"])
def test_transposed_and_reshaped_aliases_are_saved_with_the_memorys_values_now(tmp_path, alias):
    eager, deferred = _edited_after_materializing("w")
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved[alias], getattr(eager, alias).contiguous())


def test_materializing_the_view_instead_of_the_base_saves_the_base_as_it_is_now(tmp_path):
    eager, deferred = _edited_after_materializing("rows")
    assert is_deferred(deferred.w)
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved["w"], eager.w.detach())


@pytest.mark.parametrize("part", ["w", "rows"])
def test_every_saved_tensor_is_what_materialize_then_gives(tmp_path, part):
    _, deferred = _edited_after_materializing(part)
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    materialized = _materialized_state(deferred)
    assert saved.keys() == materialized.keys()
    assert all(torch.equal(saved[k], materialized[k]) for k in saved)


def test_loading_a_dcp_save_into_an_eager_model_leaves_its_shared_base_as_saved(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    eager, deferred = _edited_after_materializing("w")
    save(deferred, tmp_path / "ours", format="dcp")
    torch.manual_seed(0)
    target = _Views()  # other values; its buffers share its parameter's memory too
    state = target.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "ours", no_dist=True)
    assert torch.equal(target.w.detach(), eager.w.detach())


def test_save_pretrained_writes_a_view_of_edited_memory_as_eager_does(tmp_path):
    transformers = pytest.importorskip("transformers")

    class WithTable(transformers.GPTNeoXForCausalLM):
        def __init__(self, config) -> None:
            super().__init__(config)
            self.register_buffer("table", torch.randn(8, 4), persistent=False)
            self.register_buffer("rows", self.table[2:4])  # saved; its base is not

    config = transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        vocab_size=100, max_position_embeddings=32,
    )  # fmt: skip
    eager, deferred = eager_and_deferred(lambda: WithTable(config), seed=3)
    materialize(deferred.table)
    deferred.table.mul_(2)
    eager.table.mul_(2)
    deferred.save_pretrained(tmp_path / "ours")
    eager.save_pretrained(tmp_path / "eager")
    ours = (tmp_path / "ours" / "model.safetensors").read_bytes()
    assert ours == Path(tmp_path / "eager" / "model.safetensors").read_bytes()


def test_a_value_read_of_such_a_view_gives_the_memorys_values_now():
    eager, deferred = _edited_after_materializing("w")
    assert deferred.rows[1, 2].item() == eager.rows[1, 2].item()
    assert is_deferred(deferred.rows)


def test_memory_replaced_since_materializing_is_not_used(tmp_path):
    # ``w.data = ...`` gives w new memory: the view is no view of it any more, and materialize
    # replays the view's recording; save writes the same.
    _, deferred = _edited_after_materializing("w")
    deferred.w.data = deferred.w.data.clone().add_(1)
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved["rows"], _materialized_state(deferred)["rows"])


class _ViewBesideLargeFills(nn.Module):
    """A view of a small weight, then fills large enough to be written in parts while they are
    generated: one batch holds both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 32)
        self.register_buffer("a_rows", self.a.weight.data[3:5])
        self.b = nn.Linear(2047, 2049)
        self.c = nn.Linear(2049, 2047)


@pytest.mark.parametrize("path", ["direct", "pwrite"])
def test_parts_written_while_generating_land_beside_a_view_of_edited_memory(
    tmp_path, monkeypatch, path
):
    monkeypatch.setenv(WRITE_VARIABLE, path)  # the way save tries first
    eager, deferred = eager_and_deferred(_ViewBesideLargeFills)
    materialize(deferred.a.weight)
    with torch.no_grad():
        deferred.a.weight.mul_(2)
        eager.a.weight.mul_(2)
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    expected = {k: v.contiguous() for k, v in eager.state_dict().items()}
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
