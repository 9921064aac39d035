from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from _models import LLAMA_70B, llama_config
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.core import tensor_state
from jupyter_metainit.estimates import dry_run, fits, memory_table


def tiny_llama_config() -> transformers.LlamaConfig:
    return llama_config()


def test_linear_flops_are_2mnk():
    m, k, n = 7, 3, 5
    with meta_init():
        model = nn.Sequential(nn.Linear(k, n, bias=False))
    table = dry_run(model, (m, k))
    assert table.loc["0", "flops"] == 2 * m * n * k
    assert table.loc["", "flops"] == 2 * m * n * k


def test_output_shapes_and_activation_bytes_per_module():
    with meta_init():
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    table = dry_run(model, (4, 3))
    assert table.loc["0", "output_shape"] == (4, 5)
    assert table.loc["2", "output_shape"] == (4, 2)
    assert table.loc["1", "activation_bytes"] == 4 * 5 * 4
    assert table.loc["", "output_shape"] == (4, 2)


def test_dry_run_leaves_model_deferred():
    with meta_init():
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    table = dry_run(model, (4, 3))
    assert table.loc["", "state"] == "deferred"


def test_columns_persist_in_later_tables():
    with meta_init():
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    dry_run(model, (4, 3))
    table = memory_table(model, depth=0)
    assert table.loc["", "flops"] == 2 * 4 * 3 * 5
    assert table.loc["", "peak_forward_bytes"] >= table.loc["", "total_bytes"]


def test_submodule_table_shows_its_dry_run_figures():
    with meta_init():
        model = nn.Sequential(nn.Linear(3, 5), nn.Sequential(nn.ReLU(), nn.Linear(5, 2)))
    dry_run(model, (4, 3))
    table = memory_table(model[1])
    assert table.loc["1", "flops"] == 2 * 4 * 5 * 2
    assert table.attrs["dry_run"] is None  # the run was on the parent


def test_peak_counts_inputs_and_live_outputs():
    with meta_init():
        model = nn.Sequential(nn.Linear(3, 5, bias=False), nn.ReLU())
    table = dry_run(model, (4, 3))
    weights = 3 * 5 * 4
    # input (48 B) + linear output (80 B) + relu output (80 B) are alive together at the end
    assert table.loc["", "peak_forward_bytes"] == weights + 48 + 80 + 80


def test_real_integer_input_keeps_dtype_and_is_not_used():
    with meta_init():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    ids = torch.tensor([[1, 2, 3]])
    table = dry_run(model, ids)
    assert table.loc["0", "output_shape"] == (1, 3, 4)
    assert table.attrs["dry_run"]["inputs"] == ["(1, 3) int64"]


def test_shape_input_for_embedding_model_becomes_token_ids():
    with meta_init():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    assert dry_run(model, (2, 7)).loc["", "output_shape"] == (2, 7, 2)


def test_real_model_gets_deferred_activations():
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    table = dry_run(model, torch.randn(4, 3))
    assert table.loc["", "state"] == "cpu" and table.loc["0", "flops"] == 2 * 4 * 3 * 5


def test_meta_device_model_works():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    assert dry_run(model, (4, 3)).loc["0", "output_shape"] == (4, 5)


def test_llama_flops_equal_eager_flop_counter():
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    ids = torch.randint(0, 1000, (1, 16))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        real(ids)
    with meta_init():
        deferred = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    table = dry_run(deferred, (1, 16))
    # The dry run counts eager CPU flash attention, 4·b·h·s²·d per layer (2 layers). torch's
    # counter counts it from 2.15 on (its FLOP registry gained the CPU kernel); up to 2.14 it
    # leaves it out, so the same figure is the counter's plus that term.
    attention = 2 * 4 * 1 * 4 * 16 * 16 * 16
    counted = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry
    assert table.loc["", "flops"] == counter.get_total_flops() + (0 if counted else attention)
    assert table.loc["", "output_shape"] == (1, 16, 1000)


def test_lazy_linear_shapes_inferred_and_materialize_equals_eager():
    x = torch.ones(2, 3)
    torch.manual_seed(0)
    with meta_init():
        model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    table = dry_run(model, x)
    assert table.loc["0", "params"] == 3 * 4 + 4 and table.loc["", "state"] == "deferred"
    materialize(model)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    eager(x)
    pairs = list(zip(model.parameters(), eager.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)


def test_lazy_conv2d_materialize_equals_eager():
    torch.manual_seed(0)
    with meta_init():
        model = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    table = dry_run(model, (2, 3, 8, 8))
    assert table.loc["3", "params"] == 4 * 6 * 6 * 3 + 3
    materialize(model)
    torch.manual_seed(0)
    eager = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    eager(torch.zeros(2, 3, 8, 8))
    pairs = list(zip(model.parameters(), eager.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)


def test_seventy_b_dry_run_allocates_no_activations():
    # What the dry run itself adds to the process's peak resident memory, against the smallest
    # activation it must not allocate: one hidden state, 1 x 4096 x 8192 float32 = 128 MiB (the
    # logits alone would be 2 GiB). Not the whole process's peak: the imports alone take
    # 280 MB with torch's CPU build and 800 MB with a CUDA build (its libraries, resident pages
    # that vary with the page cache: 1.18 GB was seen in a full run on torch 2.15).
    script = textwrap.dedent(
        """
        import resource, torch, transformers
        from jupyter_metainit import meta_init
        from jupyter_metainit.estimates import dry_run
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        cfg = transformers.LlamaConfig(**SHAPES)
        with meta_init():
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        before = peak()
        table = dry_run(model, (1, 4096))
        assert table.loc["", "output_shape"] == (1, 4096, 128256)
        print(peak() - before)
        """
    ).replace("SHAPES", repr(LLAMA_70B))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    hidden_state = 1 * 4096 * LLAMA_70B["hidden_size"] * 4
    assert int(done.stdout.split()[-1]) < hidden_state


def test_dry_run_of_a_tensor_says_to_pass_the_module():
    with pytest.raises(TypeError, match=r"dry_run\(\) takes an nn.Module .* not Tensor"):
        dry_run(torch.ones(3), (1, 3))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}


def _same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_dry_run_leaves_batchnorm_running_stats_of_a_real_model_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = _snapshot(model)
    dry_run(model, (8, 4))
    assert _same_state(model, before)


def test_dry_run_with_dropout_leaves_the_global_rng_state_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    state = torch.get_rng_state()
    dry_run(model, (8, 4))
    assert torch.equal(torch.get_rng_state(), state)


def test_dry_run_leaves_an_explicit_generator_kept_on_the_model_unchanged():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen = torch.Generator().manual_seed(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.randn(x.shape, generator=self.gen)

    model = Noisy()
    state = model.gen.get_state()
    dry_run(model, (2, 3))
    assert torch.equal(model.gen.get_state(), state)


def test_dry_run_leaves_train_and_eval_modes_unchanged():
    class SwitchesToEval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.eval()
            return self.norm(x)

    model = SwitchesToEval().train()
    dry_run(model, (2, 3))
    assert model.training and model.norm.training


def test_dry_run_leaves_a_tensor_attribute_written_by_forward_unchanged():
    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = torch.zeros(())
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            self.cache = x * 2  # a cache set by forward is not left on the model either
            return self.lin(x)

    model = Counts()
    dry_run(model, (2, 3))
    assert torch.equal(model.calls, torch.zeros(())) and "cache" not in model.__dict__


def test_dry_run_on_a_deferred_model_in_train_mode_materializes_equal_to_eager():
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()

    torch.manual_seed(0)
    with meta_init():
        model = build()
    dry_run(model, (8, 4))
    after_dry_run = torch.get_rng_state()
    materialize(model)
    torch.manual_seed(0)
    eager = build()
    assert _same_state(model, _snapshot(eager))
    assert torch.equal(after_dry_run, torch.get_rng_state())


def test_dry_run_does_not_write_a_deferred_input_in_place():
    with meta_init():
        x = torch.full((2, 3), -1.0)
    dry_run(nn.ReLU(inplace=True), x)
    materialize(x)
    assert torch.equal(x, torch.full((2, 3), -1.0))


def test_memory_table_and_fits_leave_a_real_model_and_the_rng_unchanged():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    before, state = _snapshot(model), torch.get_rng_state()
    memory_table(model)
    fits(model, "cpu", budget="1GiB")
    assert _same_state(model, before) and torch.equal(torch.get_rng_state(), state)
    assert model.training


def test_dry_run_leaves_a_generator_passed_to_forward_unchanged():
    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
            return x + torch.randn(x.shape, generator=generator)

    gen = torch.Generator().manual_seed(1)
    state = gen.get_state()
    dry_run(Noisy(), (2, 2), generator=gen)
    assert torch.equal(gen.get_state(), state)


def test_dry_run_on_a_partly_real_model_leaves_both_parts_as_eager_builds_them():
    def build() -> nn.Module:
        return nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4)).train()

    torch.manual_seed(0)
    with meta_init():
        model = build()
    materialize(model[0])
    dry_run(model, (8, 4))
    materialize(model)
    torch.manual_seed(0)
    assert _same_state(model, _snapshot(build()))


def test_dry_run_forward_sees_attributes_set_on_the_model_tensors():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 3))
            self.w.scale = 2.0  # read by forward, as quantized layers read their state

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w * self.w.scale

    table = dry_run(Scaled(), (2, 3))
    assert table.loc["", "output_shape"] == (2, 3)


def test_a_dry_run_inside_meta_init_leaves_later_draws_as_eager_makes_them():
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()

    torch.manual_seed(0)
    with meta_init():
        model = build()
        dry_run(model, (8, 4))
        later = torch.randn(3)
    materialize(later)
    torch.manual_seed(0)
    build()
    assert torch.equal(later, torch.randn(3))


def test_dry_run_leaves_lazy_modules_of_a_real_model_lazy():
    model = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d())
    dry_run(model, torch.randn(2, 7))
    assert [type(m).__name__ for m in model] == ["LazyLinear", "LazyBatchNorm1d"]
    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)
    assert isinstance(model[1].running_mean, nn.parameter.UninitializedBuffer)


def test_a_real_lazy_model_after_a_dry_run_trains_as_one_without_it():
    def build() -> nn.Module:
        return nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d()).train()

    x = torch.randn(2, 7)
    model = build()
    dry_run(model, x)
    torch.manual_seed(0)
    out = model(x)
    torch.manual_seed(0)
    twin = build()
    assert torch.equal(out, twin(x)) and _same_state(model, _snapshot(twin))


def test_forward_hooks_of_a_real_model_see_deferred_tensors_during_a_dry_run():
    seen: list[str] = []
    model = nn.Sequential(nn.Linear(3, 3))
    model[0].register_forward_hook(lambda mod, args, out: seen.append(tensor_state(out)))
    dry_run(model, torch.randn(2, 3))
    assert seen == ["deferred"]


_PARAMETRIZATIONS = [
    nn.utils.parametrizations.weight_norm,
    nn.utils.parametrizations.spectral_norm,
    nn.utils.parametrizations.orthogonal,
]


@pytest.mark.parametrize("parametrize", _PARAMETRIZATIONS, ids=lambda f: f.__name__)
def test_dry_run_of_a_real_parametrized_model_leaves_it_unchanged(parametrize):
    model = nn.Sequential(parametrize(nn.Linear(3, 3)), nn.ReLU()).train()
    x = torch.randn(2, 3)
    before, state = _snapshot(model), torch.get_rng_state()
    table = dry_run(model, x)
    # the parametrization's own ops (orthogonal's matrix_exp) run inside module 0
    assert table.loc["0", "output_shape"] == (2, 3) and table.loc["0", "flops"] >= 2 * 2 * 3 * 3
    assert _same_state(model, before) and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("parametrize", _PARAMETRIZATIONS, ids=lambda f: f.__name__)
def test_dry_run_of_a_deferred_parametrized_model_materializes_equal_to_eager(parametrize):
    def build() -> nn.Module:
        return nn.Sequential(parametrize(nn.Linear(3, 3)), nn.ReLU()).train()

    torch.manual_seed(0)
    with meta_init():
        model = build()
    assert dry_run(model, (2, 3)).loc["0", "output_shape"] == (2, 3)
    materialize(model)
    torch.manual_seed(0)
    assert _same_state(model, _snapshot(build()))


def test_dry_run_of_a_module_called_on_a_parameter_counts_it():
    class LearnedQuery(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query = nn.Parameter(torch.zeros(4, 3))
            self.proj = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.proj(self.query).T

    with meta_init():
        model = LearnedQuery()
    assert dry_run(model, (2, 3)).loc["proj", "output_shape"] == (4, 3)


@pytest.mark.parametrize("name", ["float16", "torch.float16", "fp16"])
def test_dry_run_accepts_an_input_dtype_name(name):
    table = dry_run(nn.Sequential(nn.Linear(3, 3).half()), (2, 3), input_dtype=name)
    assert table.attrs["dry_run"]["output_shapes"] == [(2, 3)]


def test_a_shape_becomes_an_input_of_the_models_floating_dtype():
    model = nn.Linear(3, 3).to(torch.bfloat16)
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    dry_run(model, (2, 3))
    assert seen == [torch.bfloat16]


def test_a_shape_for_an_attention_mask_becomes_int64_ones():
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return x * attention_mask

    seen = []
    model = Masked()
    model.register_forward_pre_hook(
        lambda m, args: seen.append((args[1].dtype, bool(args[1].eq(1).all())))
    )
    dry_run(model, (2, 3), (2, 3))
    assert seen == [(torch.long, True)]


def test_dry_run_with_an_unknown_input_dtype_name_lists_the_valid_forms():
    with pytest.raises(ValueError, match="'bfloat16'"):
        dry_run(nn.Linear(3, 3), (2, 3), input_dtype="floot16")


_MIXED_DTYPE_MODELS = {
    "linear": (lambda: nn.Linear(3, 3), (2, 3)),
    "linear_no_bias": (lambda: nn.Linear(3, 3, bias=False), (2, 3)),
    "bilinear_matmul": (lambda: nn.Sequential(nn.Flatten(0), nn.Linear(6, 2)), (2, 3)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, bias=False), (1, 3, 5, 5)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, bias=False), (1, 3, 5)),
    "layer_norm": (lambda: nn.LayerNorm(3), (2, 3)),
    "group_norm": (lambda: nn.GroupNorm(1, 4), (2, 4, 3)),
    "batch_norm": (lambda: nn.BatchNorm1d(3), (2, 3)),
    "lstm": (lambda: nn.LSTM(3, 4), (2, 1, 3)),
}


@pytest.mark.parametrize("name", sorted(_MIXED_DTYPE_MODELS))
@pytest.mark.parametrize("input_dtype", [torch.int64, torch.float64])
def test_dry_run_refuses_the_input_dtype_eager_refuses(name, input_dtype):
    build, shape = _MIXED_DTYPE_MODELS[name]
    x = torch.zeros(shape, dtype=input_dtype)
    with pytest.raises((RuntimeError, ValueError)) as eager:
        build()(x)
    with pytest.raises((RuntimeError, ValueError)) as dry:
        dry_run(build(), x)
    assert str(dry.value) == str(eager.value)


def test_dry_run_of_a_deferred_model_refuses_a_mismatched_input_dtype_as_eager_does():
    with meta_init():
        model = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="same dtype"):
        dry_run(model, torch.zeros(2, 3, dtype=torch.int64))


def test_dry_run_refuses_matmul_of_two_dtypes_as_eager_does():
    class MatMul(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 4, dtype=torch.float16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.bmm(x, self.w.expand(2, 3, 4))

    with pytest.raises(RuntimeError, match="expected scalar type Float but found Half"):
        MatMul()(torch.ones(2, 2, 3))
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Half"):
        dry_run(MatMul(), torch.ones(2, 2, 3))  # a shape would be half, as the model


def test_dry_run_checking_dtypes_allocates_no_large_output_of_small_inputs():
    script = textwrap.dedent(
        """
        import resource, torch
        from torch import nn
        from jupyter_metainit.estimates import dry_run
        class Grows(nn.Module):  # 1.6 GB outputs from a 1-element input
            def forward(self, x):
                return x.new_zeros(20000, 20000) + x.repeat(20000, 20000)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        assert dry_run(Grows(), (1, 1)).loc["", "output_shape"] == (20000, 20000)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    # Growth, not the total: a CUDA build of torch alone takes about 1 GiB once imported.
    assert int(done.stdout.split()[-1]) < 512 * 1024**2


def test_dry_run_without_flops_leaves_flops_empty_and_every_other_figure_the_same():
    with meta_init():
        model = transformers.LlamaForCausalLM(tiny_llama_config())
    counted = dry_run(model, (2, 16), use_cache=True).drop(columns=["flops"])
    uncounted = dry_run(model, (2, 16), use_cache=True, flops=False)
    assert uncounted["flops"].isna().all()
    assert uncounted.attrs["dry_run"]["flops"] is None
    uncounted = uncounted.drop(columns=["flops"])
    assert counted.columns.equals(uncounted.columns)
    for column in counted.columns:
        assert counted[column].tolist() == uncounted[column].tolist(), column
    assert (
        counted.attrs["dry_run"]["peak_activation_bytes"]
        == uncounted.attrs["dry_run"]["peak_activation_bytes"]
    )


def _tiny_mixtral(hidden: int) -> nn.Module:
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    with meta_init():
        return transformers.MixtralForCausalLM(config)


def test_token_id_shapes_become_valid_ids_for_a_model_that_reads_their_values():
    # The experts' routing reads values; uninitialized ids would index past the embedding.
    table = dry_run(_tiny_mixtral(64), (2, 8))
    assert table.loc["", "output_shape"] == (2, 8, 100)


def test_float32_grouped_mm_experts_run_as_eager_cpu_runs_them():
    # The meta kernel of _grouped_mm refuses float32 (a CUDA check); the CPU kernel takes it.
    table = dry_run(_tiny_mixtral(1024), (4, 64))
    experts = table.loc["model.layers.0.mlp.experts"]
    assert experts["output_shape"] == (4 * 64, 1024)
    assert experts["activation_bytes"] == 4 * 64 * 1024 * 4


class MultipliesByAMaskItMakes(nn.Module):
    """Its forward makes a tensor from no activation (as causal masks and position ids are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[1], x.shape[1])
        return x @ mask


def test_the_peak_counts_tensors_the_forward_makes_from_no_activation():
    with meta_init():
        model = MultipliesByAMaskItMakes()
    table = dry_run(model, (4, 256), input_dtype=torch.float32)
    inputs_and_output, mask = 2 * 4 * 256 * 4, 256 * 256 * 4
    assert table.attrs["dry_run"]["peak_activation_bytes"] == inputs_and_output + mask


def test_the_dry_run_records_which_attention_kernel_it_costed_on_the_cpu():
    config = llama_config(attn_implementation="sdpa")
    with meta_init():
        model = transformers.LlamaForCausalLM(config)
    eval_run = dry_run(model.eval(), (2, 16)).attrs["dry_run"]["attention"]
    assert eval_run["fused"] == config.num_hidden_layers and eval_run["math"] == 0
    model.model.layers[0].self_attn.attention_dropout = 0.5  # the CPU's flash kernel takes none
    train_run = dry_run(model.train(), (2, 16)).attrs["dry_run"]["attention"]
    assert train_run["math"] == 1 and "dropout 0.5" in train_run["math_on"]["cpu"]
