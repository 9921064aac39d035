"""The dry run's reuse of a measured repeated block: the same figures as tracking every op.

``place`` measures the first of identical decoder layers op by op and reuses its figures for
the others (``estimates/forward/reuse.py``). Every figure the run leaves on every module must
equal the run that tracks every block, on architectures where blocks are identical (Llama),
alternate (Gemma2's sliding and full layers), change at a depth (Qwen2's window layers), route
tokens by value (Mixtral: never reused) or leave views whose bases die a collection later
(GPT-2); and a block that differs in anything but its index is measured on its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import meta_init, place
from jupyter_metainit.estimates.dry_run import run_forward
from jupyter_metainit.estimates.forward import reuse
from jupyter_metainit.estimates.memory import DRY_RUN_ATTR

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300)  # fmt: skip


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _mistral_sliding():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=16))


def _gemma2():
    config = transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=16)
    return transformers.Gemma2ForCausalLM(config)


def _qwen2_window_layers():
    config = transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16,
                                      max_window_layers=2)  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def _mixtral():
    config = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=300)
    return transformers.GPT2LMHeadModel(config)


# model, whether some block is reused (for inference, then training)
MODELS = {
    "llama": (_llama, True, True),
    "mistral_sliding": (_mistral_sliding, True, True),
    "gemma2": (_gemma2, True, True),
    "qwen2_window_layers": (_qwen2_window_layers, True, True),
    "mixtral": (_mixtral, False, False),
    "gpt2": (_gpt2, True, True),
}


def _records(model: nn.Module) -> dict:
    out = {}
    for name, module in model.named_modules():
        record = dict(module.__dict__.get(DRY_RUN_ATTR) or {})
        if "run" in record:
            record["run"] = {k: v for k, v in record["run"].items() if k != "seconds"}
        out[name] = record
    return out


@pytest.fixture
def applied(monkeypatch):
    """How many blocks were reused without a mismatch (wraps the package's own method)."""
    count = {"reused": 0}
    original = reuse.BlockReuse._apply

    def counting(self, running):
        original(self, running)
        count["reused"] += 1

    monkeypatch.setattr(reuse.BlockReuse, "_apply", counting)
    return count


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("seq_len", [8, 40])  # under and over the sliding window
def test_reusing_blocks_leaves_the_figures_of_tracking_every_op(name, training, seq_len,
                                                                applied):  # fmt: skip
    make, reused_inference, reused_training = MODELS[name]
    torch.manual_seed(0)
    with meta_init():
        model = make()
    model.train(training)
    kwargs = {"use_cache": not training}
    figures = {}
    for reuse_repeats in (False, True):
        run_forward(model, (2, seq_len), flops=False, reuse_repeats=reuse_repeats, **kwargs)
        figures[reuse_repeats] = _records(model)
    assert figures[True] == figures[False]
    assert (applied["reused"] > 0) == (reused_training if training else reused_inference)


@pytest.mark.parametrize("name", ["llama", "gemma2", "mixtral"])
def test_place_plans_the_same_with_and_without_reuse(name, monkeypatch):
    make = MODELS[name][0]
    devices = {"cuda:0": 300_000, "cuda:1": 1 << 30, "cpu": 1 << 36}
    plans = []
    for reuse_repeats in (True, False):
        if not reuse_repeats:  # the planner's dry run, every block tracked
            monkeypatch.setattr(reuse.BlockReuse, "pre", lambda self, *a: None)
        torch.manual_seed(0)
        with meta_init():
            model = make()
        plan = place(model, devices, batch=2, seq_len=40)
        plans.append((plan.peak, plan.device_map, [p[3] for p in plan.parts]))
    assert plans[0] == plans[1]


class _Block(nn.Module):
    def __init__(self, layer_idx: int, scale: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale  # not an index: blocks with another scale are measured themselves
        self.linear = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(self.norm(x))
        return x + h.repeat(1, self.scale, 1)[:, : x.shape[1]]


class _Stack(nn.Module):
    def __init__(self, scales: list[int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(_Block(i, s) for i, s in enumerate(scales))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("scales", [[1, 1, 1, 1], [1, 3, 1, 3], [1, 1, 5, 1]])
def test_a_block_differing_in_a_plain_attribute_is_measured_on_its_own(scales, applied):
    with meta_init():
        model = _Stack(scales)
    figures = {}
    for reuse_repeats in (False, True):
        run_forward(model, (2, 8), flops=False, reuse_repeats=reuse_repeats)
        figures[reuse_repeats] = _records(model)
    assert figures[True] == figures[False]
    assert applied["reused"] == len(scales) - len(set(scales))


class _Growing(nn.Module):
    """Identical blocks whose forward depends on state outside them: a dict they share (a
    dict attribute's contents are restored after each run, so a second run starts alike)."""

    def __init__(self, calls: dict[str, int]) -> None:
        super().__init__()
        self.calls = calls  # the same dict in every block
        self.linear = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls["n"] = self.calls.get("n", 0) + 1
        h = self.linear(self.norm(x)).repeat(1, self.calls["n"], 1)
        return x + h.mean(dim=1, keepdim=True)


def test_a_reused_block_that_runs_unlike_its_twin_makes_the_run_start_over(applied):
    def model() -> nn.Module:
        with meta_init():
            stack = _Stack([1, 1, 1])
            calls: dict[str, int] = {}
            stack.layers = nn.ModuleList(_Growing(calls) for _ in range(3))
        return stack

    full, reused = model(), model()
    run_forward(full, (2, 8), flops=False)
    run_forward(reused, (2, 8), flops=False, reuse_repeats=True)
    assert _records(reused) == _records(full)
    assert applied["reused"] == 0  # the mismatch was caught, every block tracked again
