"""``transformers``' ``from_pretrained`` inside meta_init: a fully deferred, file-backed model."""

from __future__ import annotations

import pytest
import torch
from _models import llama_config
from _twins import eager_and_deferred
from safetensors.torch import load_file, save_file
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core import DeferredTensor, tensor_source

transformers = pytest.importorskip("transformers")


def _saved(tmp_path, *, tied=False, **save_kwargs):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=tied))
    model.save_pretrained(tmp_path, **save_kwargs)
    return tmp_path


def _opened(path, **kwargs):
    """``(eager, deferred)``: ``from_pretrained(path)`` eagerly and under ``meta_init``."""
    open_it = transformers.AutoModelForCausalLM.from_pretrained
    return eager_and_deferred(lambda: open_it(path, **kwargs), seed=5)


def _assert_deferred_then_equal(eager, deferred):
    tensors = [*deferred.parameters(), *deferred.buffers()]
    assert all(isinstance(t, DeferredTensor) for t in tensors)
    materialize(deferred)
    a, b = eager.state_dict(), deferred.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("shard", [None, "60KB"], ids=["single_file", "sharded"])
def test_safetensors_checkpoint(tmp_path, shard):
    path = _saved(tmp_path, **({"max_shard_size": shard} if shard else {}))
    eager, deferred = _opened(path)
    assert tensor_source(deferred.model.layers[1].mlp.up_proj.weight) == "checkpoint"
    assert tensor_source(deferred.model.rotary_emb.inv_freq) == "init"
    _assert_deferred_then_equal(eager, deferred)


def test_dtype_argument(tmp_path):
    eager, deferred = _opened(_saved(tmp_path), dtype=torch.bfloat16)
    assert deferred.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    _assert_deferred_then_equal(eager, deferred)


def test_tied_weights_stay_tied(tmp_path):
    eager, deferred = _opened(_saved(tmp_path, tied=True))
    assert deferred.lm_head.weight is deferred.model.embed_tokens.weight
    _assert_deferred_then_equal(eager, deferred)
    assert deferred.lm_head.weight is deferred.model.embed_tokens.weight


def test_missing_weights_are_initialized_as_transformers_does(tmp_path):
    path = _saved(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"], state["model.norm.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    eager, deferred = _opened(path)
    assert tensor_source(deferred.model.layers[1].mlp.down_proj.weight) == "init"
    _assert_deferred_then_equal(eager, deferred)


def test_bin_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=False))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    eager, deferred = _opened(tmp_path)
    assert tensor_source(deferred.model.embed_tokens.weight) == "checkpoint"
    _assert_deferred_then_equal(eager, deferred)


def test_one_layer_materializes_alone(tmp_path):
    eager, deferred = _opened(_saved(tmp_path))
    materialize(deferred.model.layers[1])
    assert not is_deferred(deferred.model.layers[1]) and is_deferred(deferred.model.layers[0])
    for a, b in zip(
        eager.model.layers[1].parameters(), deferred.model.layers[1].parameters(), strict=True
    ):
        assert torch.equal(a, b)


def test_opening_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    import os

    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    _opened(_saved(tmp_path))
    assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ


def test_a_sparse_70b_checkpoint_opens_deferred_and_reads_only_what_is_materialized(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _common import bytes_read, write_sparse_checkpoint
    from _models import LLAMA_70B

    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(llama_config(LLAMA_70B, tie_word_embeddings=False))
    total = write_sparse_checkpoint(meta.to(torch.bfloat16), str(tmp_path))
    assert total > 130 << 30  # 141 GB of holes
    with meta_init():
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.model.layers[79].mlp.down_proj.weight.dtype == torch.bfloat16
    assert all(isinstance(t, DeferredTensor) for t in model.parameters())
    norm = model.model.layers[40].post_attention_layernorm
    before = bytes_read()
    materialize(norm)
    read = bytes_read() - before
    assert 8192 * 2 <= read < 8192 * 2 + (128 << 10)  # its bytes, plus the file's header check
    assert torch.equal(norm.weight, torch.zeros(8192, dtype=torch.bfloat16))  # holes read as 0
    assert is_deferred(model.model.layers[40].mlp)


class _BufferConfig(transformers.PretrainedConfig):
    model_type = "jm_buffers"


class _Positions(transformers.PreTrainedModel):
    """A non-persistent buffer that ``_init_weights`` leaves alone: ``from_pretrained`` gives it
    ``torch.empty_like(meta_buffer, device="cpu")``, uninitialised memory."""

    config_class = _BufferConfig

    def __init__(self, config):
        super().__init__(config)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(5), persistent=False)
        self.post_init()

    def _init_weights(self, module):
        pass


class _ScaledPositions(_Positions):
    """The same buffer, computed by ``_init_weights`` from the placeholder it was given."""

    def _init_weights(self, module):
        if isinstance(module, _ScaledPositions):
            module.pos.mul_(0).add_(torch.arange(5) * 2)  # reads the placeholder first


class _WithTable(_Positions):
    """A persistent buffer the checkpoint (saved by ``_Positions``) does not have."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("table", torch.ones(2, 3))


def _saved_custom(tmp_path):
    torch.manual_seed(0)
    _Positions(_BufferConfig()).save_pretrained(tmp_path)
    return tmp_path


def _same_metadata(a, b):
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def test_non_persistent_buffer_left_uninitialised_materializes_like_eager(tmp_path):
    eager, deferred = eager_and_deferred(_Positions.from_pretrained, _saved_custom(tmp_path))
    assert isinstance(deferred.pos, DeferredTensor)
    materialize(deferred)
    assert _same_metadata(deferred.pos, eager.pos)  # values: uninitialised memory, as eager's
    assert torch.equal(deferred.lin.weight, eager.lin.weight)
    assert torch.equal(deferred.lin.bias, eager.lin.bias)


def test_non_persistent_buffer_computed_from_its_placeholder_equals_eager(tmp_path):
    eager, deferred = eager_and_deferred(_ScaledPositions.from_pretrained, _saved_custom(tmp_path))
    materialize(deferred)
    assert torch.equal(deferred.pos, eager.pos)
    assert torch.equal(deferred.pos, torch.arange(5) * 2)


def test_missing_persistent_buffer_left_uninitialised_materializes_like_eager(tmp_path):
    eager, deferred = eager_and_deferred(_WithTable.from_pretrained, _saved_custom(tmp_path))
    assert isinstance(deferred.table, DeferredTensor)
    materialize(deferred)
    assert _same_metadata(deferred.table, eager.table)
    assert torch.equal(deferred.lin.weight, eager.lin.weight)
