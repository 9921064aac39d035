"""What holds on a real CUDA device. Skipped without one (CI has none); run on a lent GPU."""

from __future__ import annotations

import pytest
import torch
from _twins import deferred, eager_and_deferred
from torch import nn

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _small_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 10), nn.BatchNorm1d(10)
    )


def test_materialize_to_cuda_gives_eager_values_on_the_gpu():
    eager, model = eager_and_deferred(_small_model)
    materialize(model, device="cuda")
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.device.type == "cuda", name
        assert torch.equal(real.cpu(), expected), name


def test_a_model_recorded_for_cuda_materializes_on_cuda_without_a_device_argument():
    model = deferred(_small_model, device="cuda")
    assert next(model.parameters()).device.type == "cuda"
    materialize(model)
    assert not is_deferred(model)
    assert {t.device.type for t in model.state_dict().values()} == {"cuda"}


def _cuda_model() -> nn.Module:
    with torch.device("cuda"):
        return _small_model()


def _assert_same_state(model: nn.Module, eager: nn.Module, device_type: str) -> None:
    for (name, real), (_, expected) in zip(
        model.state_dict().items(), eager.state_dict().items(), strict=True
    ):
        assert real.device.type == device_type, name
        assert torch.equal(real, expected.to(real.device)), name


# Random ops recorded for a CUDA device that is present draw from that device's default CUDA
# generator, as eagerly: exact eager GPU values, and the CPU stream untouched.


def test_a_model_built_under_a_cuda_device_context_equals_eager_built_on_the_gpu():
    eager, model = eager_and_deferred(_cuda_model)
    materialize(model)
    _assert_same_state(model, eager, "cuda")


def test_meta_init_device_cuda_gives_the_values_of_eager_construction_on_the_gpu():
    eager, model = eager_and_deferred(_small_model, device="cuda")
    materialize(model)
    _assert_same_state(model, eager, "cuda")


def test_a_part_recorded_for_cuda_materialized_alone_equals_eager_on_the_gpu():
    eager, model = eager_and_deferred(_cuda_model)
    materialize(model[3])
    _assert_same_state(model[3], eager[3], "cuda")


def test_tensors_recorded_for_cuda_materialized_on_the_cpu_are_eager_gpu_values_moved():
    eager, model = eager_and_deferred(_cuda_model)
    materialize(model, device="cpu")
    _assert_same_state(model, eager, "cpu")


def _mixed() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(64, 64, device="cuda"), nn.Linear(64, 64)), torch.randn(5)


def test_a_mixed_cuda_and_cpu_build_gives_eager_values_on_both_devices():
    (eager_model, eager_x), (model, x) = eager_and_deferred(_mixed)
    materialize(model)
    assert model[0].weight.device.type == "cuda" and model[1].weight.device.type == "cpu"
    assert torch.equal(model[0].weight, eager_model[0].weight)
    assert torch.equal(model[0].bias, eager_model[0].bias)
    assert torch.equal(model[1].weight, eager_model[1].weight)
    assert torch.equal(model[1].bias, eager_model[1].bias)
    assert torch.equal(materialize(x), eager_x)


def test_a_mixed_cuda_and_cpu_build_leaves_both_generators_where_eager_does():
    torch.manual_seed(0)
    _mixed()
    eager_cpu, eager_cuda = torch.get_rng_state(), torch.cuda.get_rng_state()
    deferred(_mixed)
    assert torch.equal(torch.get_rng_state(), eager_cpu)
    assert torch.equal(torch.cuda.get_rng_state(), eager_cuda)


def test_a_cuda_build_leaves_the_cpu_generator_untouched():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    deferred(_cuda_model)
    assert torch.equal(torch.get_rng_state(), before)


def test_dropout_in_a_deferred_forward_on_cuda_draws_like_eager():
    def build() -> tuple[nn.Module, torch.Tensor]:
        layer = nn.Linear(32, 32, device="cuda")
        out = nn.functional.dropout(layer(torch.ones(4, 32, device="cuda")), 0.5)
        return layer, out

    torch.manual_seed(0)
    eager_layer, eager_out = build()
    eager_cuda = torch.cuda.get_rng_state()
    layer, out = deferred(build)
    assert torch.equal(torch.cuda.get_rng_state(), eager_cuda)
    assert torch.equal(materialize(out), eager_out)
    assert torch.equal(materialize(layer).weight, eager_layer.weight)


def test_a_cuda_state_read_during_a_build_is_the_eager_one():
    def build() -> torch.Tensor:
        torch.randn(1000, device="cuda")
        return torch.cuda.get_rng_state()

    eager, twin = eager_and_deferred(build)
    assert torch.equal(twin, eager)


def test_fast_mode_on_cuda_is_deterministic():
    first = deferred(_small_model)
    second = deferred(_small_model)
    materialize(first, device="cuda", rng="fast")
    materialize(second, device="cuda", rng="fast")
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert a.device.type == "cuda"
        assert torch.equal(a, b)


def test_freeing_a_cuda_part_gives_its_memory_back():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = deferred(lambda: nn.Linear(4096, 4096))
    materialize(model, device="cuda", keep_cache=True)
    assert torch.cuda.memory_allocated() - before >= 4096 * 4096 * 4
    dematerialize(model)
    assert is_deferred(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20
    materialize(model, device="cuda")
    torch.manual_seed(0)
    expected = nn.Linear(4096, 4096)
    assert torch.equal(model.weight.cpu(), expected.weight)


def test_bfloat16_cast_on_cuda_equals_eager_cast():
    eager, model = eager_and_deferred(_small_model)
    eager = eager.to(torch.bfloat16)
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
    eager, model = eager_and_deferred(transformers.LlamaForCausalLM, config)
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

    model = deferred(_small_model)
    table = fits(model, "cuda:0")
    assert bool(table["fits"].all())


_CUDA_RANDOM_OPS = {
    "rand": lambda: torch.rand(1000, device="cuda"),
    "randn": lambda: torch.randn(3, 7, device="cuda"),
    "randperm": lambda: torch.randperm(50, device="cuda"),
    "randint": lambda: torch.randint(-(1 << 40), 1 << 40, (33,), device="cuda"),
    "uniform_": lambda: torch.empty(5000, device="cuda").uniform_(),
    "normal_strided": lambda: torch.empty(8, 8, device="cuda").t().normal_(),
    "bernoulli_": lambda: torch.empty(99, device="cuda").bernoulli_(0.3),
    "multinomial": lambda: torch.multinomial(torch.ones(20, device="cuda"), 5),
    "exponential_": lambda: torch.empty(77, device="cuda").exponential_(),
    "poisson": lambda: torch.poisson(torch.full((66,), 3.0, device="cuda")),
    "dropout": lambda: nn.functional.dropout(torch.ones(300, device="cuda"), 0.5),
}


@pytest.mark.parametrize("name", sorted(_CUDA_RANDOM_OPS))
def test_each_random_op_recorded_for_cuda_gives_eager_values_and_cuda_state(name):
    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first = _CUDA_RANDOM_OPS[name]()
        second = torch.rand(10, device="cuda")  # where the first op left the generator
        return first, second, torch.cuda.get_rng_state()

    torch.manual_seed(0)
    eager = build()
    eager_cpu = torch.get_rng_state()
    made = deferred(build)
    assert torch.equal(torch.get_rng_state(), eager_cpu)
    assert torch.equal(made[2], eager[2])
    assert torch.equal(torch.cuda.get_rng_state(), eager[2])
    assert torch.equal(materialize(made[1]), eager[1])
    assert torch.equal(materialize(made[0]), eager[0])


def test_a_fast_part_made_on_cuda_comes_back_with_the_same_values_after_a_free():
    model = deferred(_small_model)  # recorded for the CPU, drawn on the GPU
    materialize(model, device="cuda", rng="fast", keep_cache=True)
    before = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    dematerialize(model)
    materialize(model)
    for name, value in model.state_dict().items():
        assert value.device.type == "cuda", name
        assert torch.equal(value.cpu(), before[name]), name


def test_a_fast_part_made_on_the_cpu_comes_back_with_the_same_values_on_cuda():
    model = deferred(_small_model)
    materialize(model, rng="fast", keep_cache=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dematerialize(model)
    materialize(model, device="cuda")
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), before[name]), name


def test_a_random_tensor_larger_than_its_gpu_says_what_to_do_and_records_nothing():
    from jupyter_metainit.core.errors import MetaInitError

    elements = torch.cuda.mem_get_info()[1] // 4 + (1 << 28)  # float32: more than the whole GPU
    torch.manual_seed(0)
    with meta_init(device="cuda"):
        with pytest.raises(MetaInitError, match=r"do not fit.*device='cpu'"):
            torch.randn(elements)
        later = torch.randn(10)
    torch.manual_seed(0)
    assert torch.equal(materialize(later), torch.randn(10, device="cuda"))
