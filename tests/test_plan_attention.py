"""place() costs attention by the kernel each planned device runs (SDPA's math kernel or a fused
one; transformers' attn_implementation), agrees with dry_run(), and with PyTorch's MemTracker on
a real run on the CPU for GPT-2, GPT-BigCode, Llama, T5 and ViT."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from jupyter_metainit import dry_run, materialize, meta_init, place

transformers = pytest.importorskip("transformers")

MiB = 1 << 20
HUGE = {"cpu": "64GiB"}
BATCH, SEQ, DECODED, IMAGE = 2, 64, 16, 32


def _config(kind: str, attn: str) -> Any:
    small = {"vocab_size": 1000}
    configs = {
        "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4,
                                                n_positions=SEQ, **small),
        "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(n_embd=128, n_layer=2, n_head=4,
                                                             n_positions=SEQ, **small),
        "llama": lambda: transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, **small),
        "t5": lambda: transformers.T5Config(d_model=128, d_ff=256, num_layers=2, num_heads=4,
                                            d_kv=32, decoder_start_token_id=0, pad_token_id=0,
                                            **small),
        "vit": lambda: transformers.ViTConfig(hidden_size=128, intermediate_size=512,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              image_size=IMAGE, patch_size=4),
    }  # fmt: skip
    config = configs[kind]()
    config._attn_implementation = attn
    return config


def _deferred(kind: str, attn: str = "sdpa") -> Any:
    classes = {"gpt2": "GPT2LMHeadModel", "gpt_bigcode": "GPTBigCodeForCausalLM",
               "llama": "LlamaForCausalLM", "t5": "T5ForConditionalGeneration",
               "vit": "ViTForImageClassification"}  # fmt: skip
    torch.manual_seed(0)
    with meta_init():
        return getattr(transformers, classes[kind])(_config(kind, attn))


def _workload(kind: str, training: bool) -> tuple[dict[str, Any], tuple, dict[str, Any]]:
    """place()'s workload arguments, and the real call's positional and keyword inputs."""
    ids = torch.randint(0, 1000, (BATCH, SEQ))
    if kind == "t5":
        decoded = torch.randint(0, 1000, (BATCH, DECODED))
        second = "labels" if training else "decoder_input_ids"
        real = {"input_ids": ids, second: decoded, **({} if training else {"use_cache": True})}
        return {"inputs": {"input_ids": (BATCH, SEQ), second: (BATCH, DECODED)}}, (), real
    if kind == "vit":
        pixels = torch.randn(BATCH, 3, IMAGE, IMAGE)
        if training:
            labels = torch.zeros(BATCH, dtype=torch.long)
            shapes = {"pixel_values": torch.zeros(()).expand(pixels.shape), "labels": (BATCH,)}
            return {"inputs": shapes}, (), {"pixel_values": pixels, "labels": labels}
        return {"inputs": [tuple(pixels.shape)]}, (pixels,), {}
    real = {"labels": ids} if training else {"use_cache": True}
    return {"batch": BATCH, "seq_len": SEQ}, (ids,), real


def measured_peak(model: Any, args: tuple, kwargs: dict, training: bool) -> int:
    """MemTracker's peak of a real forward (inference, no_grad, eval mode) or of the second of
    two AdamW steps (training), the inputs counted."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not training:
        model.eval()
        tracker.track_external(model, *inputs)
        with tracker, torch.no_grad():
            model(*args, **kwargs)
    else:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.track_external(model, optimizer, *inputs)
        with tracker:
            for step in range(2):
                model(*args, **kwargs).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
    return max(int(stats["Total"]) for stats in tracker.get_tracker_snapshot("peak").values())


MODELS = ["gpt2", "gpt_bigcode", "llama", "t5", "vit"]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", MODELS)
def test_the_predicted_peak_is_within_5_percent_of_memtrackers_on_the_cpu(kind, attn, training):
    model = _deferred(kind, attn)
    workload, args, kwargs = _workload(kind, training)
    predicted = place(model, HUGE, training=training, **workload).peak["cpu"]
    materialize(model)
    assert predicted == pytest.approx(measured_peak(model, args, kwargs, training), rel=0.05)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", MODELS)
def test_place_and_dry_run_of_the_same_inference_agree(kind, attn):
    model = _deferred(kind, attn)
    workload, args, kwargs = _workload(kind, training=False)
    predicted = place(model, HUGE, **workload).peak["cpu"]
    shapes = [tuple(a.shape) if a.is_floating_point() else a for a in args]
    table = dry_run(model.eval(), *shapes, **kwargs)
    assert predicted == pytest.approx(table.loc["", "peak_forward_bytes"], rel=0.05)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_an_inference_plan_agrees_with_dry_run_in_eval_mode_whatever_mode_the_model_is_in(attn):
    config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000,
                                     n_positions=256)  # fmt: skip
    config._attn_implementation = attn
    with meta_init():
        model = transformers.GPT2LMHeadModel(config)  # in training mode, as built
    predicted = place(model, HUGE, batch=4, seq_len=256).peak["cpu"]
    table = dry_run(model.eval(), (4, 256), use_cache=True)
    assert predicted == pytest.approx(table.loc["", "peak_forward_bytes"], rel=0.05)


def test_a_training_plan_for_gpt_bigcode_on_the_cpu_does_not_fit_where_the_step_does_not():
    # Dropout in its attention: the CPU runs SDPA's math kernel, which keeps the scores.
    model = _deferred("gpt_bigcode")
    workload, args, kwargs = _workload("gpt_bigcode", training=True)
    predicted = place(model, HUGE, training=True, **workload).peak["cpu"]
    materialize(model)
    real = measured_peak(model, args, kwargs, training=True)
    model_again = _deferred("gpt_bigcode")
    assert not place(model_again, {"cpu": int(0.95 * real)}, training=True, **workload).fits
    assert predicted == pytest.approx(real, rel=0.05)


def test_an_inference_plan_of_a_model_in_training_mode_says_it_is_for_eval_mode():
    # The case: GPT-BigCode, batch 8 x 1024, sdpa; its eager forward in training mode
    # (dropout on) runs the math kernel and needs several times the plan.
    config = transformers.GPTBigCodeConfig(n_embd=256, n_layer=2, n_head=8, vocab_size=1000,
                                           n_positions=1024)  # fmt: skip
    with meta_init():
        model = transformers.GPTBigCodeForCausalLM(config)
    plan = place(model, {"cpu": "300MiB"}, batch=8, seq_len=1024)
    assert plan.fits and model.training
    assert any("call model.eval() before inference" in note for note in plan.notes)
    assert place(model.eval(), {"cpu": "300MiB"}, batch=8, seq_len=1024).notes == []


def test_an_absent_gpu_in_bfloat16_is_planned_with_the_math_kernel_and_says_so():
    model = _deferred("llama")
    plan = place(model, {"cuda:0": "8GiB"}, batch=8, seq_len=512, precision="bf16")
    (note,) = plan.notes
    assert "compute capability 8.0" in note and "attention='fused'" in note
    fused = place(model, {"cuda:0": "8GiB"}, batch=8, seq_len=512, precision="bf16",
                  attention="fused")  # fmt: skip
    scores = 8 * 4 * 512 * 512 * 2  # [batch, heads, queries, keys] in bfloat16
    assert fused.notes == [] and plan.peak["cuda:0"] - fused.peak["cuda:0"] >= scores


def test_float32_on_an_absent_gpu_is_planned_with_the_memory_efficient_kernel():
    model = _deferred("llama").eval()
    plan = place(model, {"cuda:0": "8GiB"}, batch=8, seq_len=512)
    fused = place(model, {"cuda:0": "8GiB"}, batch=8, seq_len=512, attention="fused")
    math = place(model, {"cuda:0": "8GiB"}, batch=8, seq_len=512, attention="math")
    assert plan.notes == [] and plan.peak == fused.peak
    assert math.peak["cuda:0"] > plan.peak["cuda:0"] + 8 * 4 * 512 * 512 * 4


def test_a_head_size_only_older_gpus_take_fused_is_planned_with_the_math_kernel_and_said():
    config = _config("llama", "sdpa")
    config.hidden_size, config.head_dim = 4 * 62, 62  # not a multiple of 4 (memory-efficient)
    with meta_init():
        model = transformers.LlamaForCausalLM(config).eval()
    plan = place(model, {"cuda:0": "8GiB"}, batch=2, seq_len=256)
    math = place(model, {"cuda:0": "8GiB"}, batch=2, seq_len=256, attention="math")
    (note,) = plan.notes
    assert plan.peak == math.peak and "head size 62 in float32" in note


def test_a_plan_over_a_gpu_and_the_host_costs_the_math_kernel_the_host_runs_and_says_so():
    model = _deferred("gpt2")  # dropout 0.1 in its attention: the CPU's flash kernel takes none
    plan = place(model, {"cuda:0": "1GiB", "cpu": "8GiB"}, batch=2, seq_len=64, training=True)
    assert any("because cpu runs it" in note and "cuda:0" in note for note in plan.notes)


def test_flash_attention_2_in_the_config_is_costed_as_a_fused_kernel():
    model = _deferred("llama").eval()
    fused = place(model, {"cuda:0": "8GiB"}, batch=2, seq_len=256, precision="bf16",
                  attention="fused")  # fmt: skip
    model.config._attn_implementation_internal = "flash_attention_2"  # flash-attn not installed
    plan = place(model, {"cuda:0": "8GiB"}, batch=2, seq_len=256, precision="bf16")
    assert plan.peak == fused.peak and plan.notes == []
    assert model.config._attn_implementation == "flash_attention_2"


@pytest.mark.parametrize(("attention", "error"), [(1, TypeError), ("flash", ValueError)])
def test_attention_takes_auto_fused_or_math(attention, error):
    with pytest.raises(error, match="'auto'"):
        place(_deferred("llama"), HUGE, seq_len=8, attention=attention)


def test_a_mixture_of_experts_training_step_is_traced_with_the_dry_runs_routing():
    # Its routing reads values and makes value-shaped tensors: the dry run's answers them.
    config = transformers.MixtralConfig(hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=1000,
                                        num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    with meta_init():
        model = transformers.MixtralForCausalLM(config)
    plan = place(model, HUGE, batch=2, seq_len=64, training=True)
    assert plan.notes == []
    materialize(model)
    ids = torch.randint(0, 1000, (2, 64))
    measured = measured_peak(model, (ids,), {"labels": ids}, training=True)
    assert plan.peak["cpu"] == pytest.approx(measured, rel=0.05)


class CausalBlock(torch.nn.Module):
    """Self-attention through SDPA with a boolean causal mask its forward makes (no device
    given), and attention dropout."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(width, 3 * width), torch.nn.Linear(
            width, width), heads  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        p = 0.1 if self.training else 0.0
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return x + self.out(a.transpose(1, 2).reshape(b, n, d))


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 64)
        self.blocks = torch.nn.Sequential(CausalBlock(), CausalBlock())
        self.head = torch.nn.Linear(64, 100)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.blocks(self.embed(ids)))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def test_a_training_step_whose_forward_makes_a_mask_without_a_device_is_traced_whole():
    torch.manual_seed(0)
    with meta_init():
        model = TinyLM()
    plan = place(model, HUGE, inputs={"ids": (2, 128), "labels": (2, 128)}, training=True)
    assert plan.notes == []
    materialize(model)
    ids = torch.randint(0, 100, (2, 128))
    measured = measured_peak(model, (), {"ids": ids, "labels": ids}, training=True)
    assert plan.peak["cpu"] == pytest.approx(measured, rel=0.05)
