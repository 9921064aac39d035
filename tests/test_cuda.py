"""What holds on a real CUDA device. Skipped without one (CI has none); run on a lent GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _small_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 10), nn.BatchNorm1d(10)
    )


def _eager(build, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def _deferred(build, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    with meta_init(**kwargs):
        return build()


def test_materialize_to_cuda_gives_eager_values_on_the_gpu():
    eager = _eager(_small_model)
    model = _deferred(_small_model)
    materialize(model, device="cuda")
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.device.type == "cuda", name
        assert torch.equal(real.cpu(), expected), name


def test_a_model_recorded_for_cuda_materializes_on_cuda_without_a_device_argument():
    model = _deferred(_small_model, device="cuda")
    assert next(model.parameters()).device.type == "cuda"
    materialize(model)
    assert not is_deferred(model)
    assert {t.device.type for t in model.state_dict().values()} == {"cuda"}


def test_a_model_built_under_a_cuda_device_context_gets_the_cpu_stream_values_moved():
    eager = _eager(_small_model)

    def build() -> nn.Module:
        with torch.device("cuda"):
            return _small_model()

    model = _deferred(build)
    materialize(model)
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.device.type == "cuda", name
        assert torch.equal(real.cpu(), expected), name


def test_fast_mode_on_cuda_is_deterministic():
    first = _deferred(_small_model)
    second = _deferred(_small_model)
    materialize(first, device="cuda", rng="fast")
    materialize(second, device="cuda", rng="fast")
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert a.device.type == "cuda"
        assert torch.equal(a, b)


def test_freeing_a_cuda_part_gives_its_memory_back():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = _deferred(lambda: nn.Linear(4096, 4096))
    materialize(model, device="cuda", keep_cache=True)
    assert torch.cuda.memory_allocated() - before >= 4096 * 4096 * 4
    dematerialize(model)
    assert is_deferred(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20
    materialize(model, device="cuda")
    expected = _eager(lambda: nn.Linear(4096, 4096))
    assert torch.equal(model.weight.cpu(), expected.weight)


def test_bfloat16_cast_on_cuda_equals_eager_cast():
    eager = _eager(_small_model).to(torch.bfloat16)
    model = _deferred(_small_model)
    materialize(model, device="cuda", dtype=torch.bfloat16)
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.dtype == expected.dtype, name
        assert torch.equal(real.cpu(), expected), name


def test_a_transformers_llama_materialized_on_cuda_equals_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    eager = _eager(lambda: transformers.LlamaForCausalLM(config))
    model = _deferred(lambda: transformers.LlamaForCausalLM(config))
    materialize(model.model.layers[1], device="cuda")
    materialize(model, device="cuda")
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.device.type == "cuda", name
        assert torch.equal(real.cpu(), expected), name
    ids = torch.arange(8, device="cuda")[None]
    assert torch.equal(model(ids).logits.cpu(), eager.cuda()(ids).logits.cpu())


def test_fits_reads_the_gpus_free_memory():
    from jupyter_metainit import fits

    model = _deferred(_small_model)
    table = fits(model, "cuda:0")
    assert bool(table["fits"].all())


def test_a_fast_part_made_on_cuda_comes_back_with_the_same_values_after_a_free():
    model = _deferred(_small_model)  # recorded for the CPU, drawn on the GPU
    materialize(model, device="cuda", rng="fast", keep_cache=True)
    before = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    dematerialize(model)
    materialize(model)
    for name, value in model.state_dict().items():
        assert value.device.type == "cuda", name
        assert torch.equal(value.cpu(), before[name]), name


def test_a_fast_part_made_on_the_cpu_comes_back_with_the_same_values_on_cuda():
    model = _deferred(_small_model)
    materialize(model, rng="fast", keep_cache=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dematerialize(model)
    materialize(model, device="cuda")
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), before[name]), name
