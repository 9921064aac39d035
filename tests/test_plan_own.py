"""place() with tensors a module holds itself next to its children (BART's final_logits_bias, a
ViT's cls_token and pos_embed): those tensors are a small part of their own, not a reason to
keep the whole module in one part."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init, place
from jupyter_metainit.plan import Placement

transformers = pytest.importorskip("transformers")

TWO = {"cuda:0": "2MiB", "cuda:1": "2MiB"}


def _bart(width: int = 64, vocab: int = 500) -> nn.Module:
    """A small deferred BART (seed 0): its root holds ``final_logits_bias``."""
    config = transformers.BartConfig(
        d_model=width, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
        vocab_size=vocab, max_position_embeddings=width,
    )  # fmt: skip
    torch.manual_seed(0)
    with meta_init():
        return transformers.BartForConditionalGeneration(config)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyViT(nn.Module):
    """A ViT's layout: the class token and position embedding sit on the root."""

    def __init__(self, dim: int = 64, patches: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, dim))
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(depth)))
        self.head = nn.Linear(dim, 10)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.blocks(x)[:, 0])


def _vit(deferred: bool = True) -> TinyViT:
    torch.manual_seed(0)
    if not deferred:
        return TinyViT()
    with meta_init():
        return TinyViT()


VIT_DEVICES = {"cuda:0": "100KiB", "cuda:1": "100KiB"}


def test_bart_is_split_over_two_devices_with_its_final_logits_bias_as_a_part_of_its_own():
    model = _bart()
    plan = place(model, TWO, batch=2, seq_len=32)
    assert set(plan.device_map.values()) == set(TWO)
    assert ("final_logits_bias", "tensors of BartForConditionalGeneration") in [
        (name, kind) for name, kind, _, _ in plan.parts
    ]
    assert is_deferred(model)


# accelerate's check warns about keys naming tensors, which its own maps use too
@pytest.mark.filterwarnings("ignore:The following device_map keys do not match")
def test_the_device_map_covers_every_tensor_once_and_dispatch_model_runs_on_it():
    from accelerate import dispatch_model

    plan = place(_bart(), TWO, batch=2, seq_len=32)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(_bart().config).eval()
    for name in model.state_dict():
        covering = [k for k in plan.device_map if name == k or name.startswith(k + ".")]
        assert len(covering) == 1, name
    ids = torch.randint(4, 500, (1, 8))
    expected = model(ids).logits
    dispatched = dispatch_model(model, device_map=dict.fromkeys(plan.device_map, "cpu"))
    assert torch.equal(dispatched(ids).logits, expected)


def test_pinning_barts_decoder_puts_all_of_it_on_that_device():
    model = _bart()
    plan = place(model, TWO, batch=2, seq_len=32, pin={"model.decoder": "cuda:1"})
    decoder = [d for name, _, d, _ in plan.parts if name.startswith("model.decoder")]
    assert decoder and set(decoder) == {"cuda:1"}
    assert plan.device_map["model.decoder"] == "cuda:1"


def test_a_vit_with_its_tokens_on_the_root_is_split_and_its_tokens_run_first():
    plan = place(_vit(), VIT_DEVICES, inputs=[(2, 3, 16, 16)])
    names = [name for name, _, _, _ in plan.parts]
    assert names[0] == "cls_token, pos_embed" and "" not in names
    assert set(plan.device_map.values()) == set(VIT_DEVICES)
    tokens = plan.parts[0][3]
    assert tokens.weights == (1 + 17) * 64 * 4 and tokens.transient == 0


def test_training_a_vit_gives_its_tokens_no_saved_activations_of_their_own():
    plan = place(_vit(), VIT_DEVICES, inputs=[(2, 3, 16, 16)], training=True)
    tokens = plan.parts[0][3]
    assert tokens.saved == 0 and tokens.grads == (1 + 17) * 64 * 4
    assert plan.notes == []


@pytest.mark.parametrize("build", [_vit, _bart], ids=["vit", "bart"])
def test_materializing_a_plan_with_own_tensors_gives_eagers_values(build):
    model = build()
    if isinstance(model, TinyViT):
        plan = place(model, VIT_DEVICES, inputs=[(2, 3, 16, 16)])
        eager = _vit(deferred=False)
    else:
        plan = place(model, TWO, batch=2, seq_len=32)
        torch.manual_seed(0)
        eager = transformers.BartForConditionalGeneration(model.config)
    # this machine's stand-in for the two GPUs: two names of the CPU, one group each
    cpus = {"cuda:0": "cpu", "cuda:1": "cpu:0"}
    assert {"final_logits_bias", "cls_token"} & set(plan.device_map)  # named one by one
    materialize(model, placement=Placement.from_device_map(
        {name: cpus[d] for name, d in plan.device_map.items()}))  # fmt: skip
    expected = eager.state_dict()
    for name, value in model.state_dict().items():
        assert not is_deferred(value) and torch.equal(value, expected[name]), name


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_barts_predicted_peak_is_within_5_percent_of_a_real_run_on_the_cpu(training):
    from tests.test_plan import _measured_peak

    model = _bart(width=128, vocab=1000)
    predicted = place(model, {"cpu": "1GiB"}, batch=4, seq_len=64, training=training).peak["cpu"]
    materialize(model)
    measured = _measured_peak(model, torch.randint(4, 1000, (4, 64)), training)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_an_fsdp_plan_of_bart_shards_its_blocks_and_counts_every_weight_once():
    from jupyter_metainit.estimates.memory import subtree_bytes

    model = _bart()
    plan = place(model, {"cuda": "80GiB"}, batch=2, seq_len=32, training=True,
                 strategy="fsdp", world_size=4)  # fmt: skip
    assert plan.units[-1] == "" and "model.decoder.layers.1" in plan.units
    assert sum(costs.weights for _, _, _, costs in plan.parts) == subtree_bytes(model)[""]


def test_a_failure_after_the_own_tensors_were_made_leaves_them_deferred_too():
    model = _vit()
    plan = place(model, VIT_DEVICES, inputs=[(2, 3, 16, 16)])
    cpus = {"cuda:0": "cpu", "cuda:1": "cpu:0"}
    placement = Placement.from_device_map({n: cpus[d] for n, d in plan.device_map.items()})
    assert next(iter(placement.device_map)) == "cls_token"  # made in the first group

    def cancel_in_the_last_group(done, total):
        if done > total * 0.9:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        materialize(model, placement=placement, progress=cancel_in_the_last_group)
    assert all(is_deferred(t) for t in model.state_dict().values())


def test_a_pin_inside_a_repeated_block_names_the_block_to_pin_instead():
    with pytest.raises(ValueError) as caught:
        place(_bart(), TWO, batch=2, seq_len=32, pin={"model.decoder.layers.0.fc1": "cuda:1"})
    message = str(caught.value)
    assert "'model.decoder.layers.0.fc1' lies inside 'model.decoder.layers.0'" in message
    assert "pin 'model.decoder.layers.0' instead" in message and "''" not in message


def test_a_pin_inside_a_model_kept_whole_says_the_whole_model():
    model = _vit()
    with pytest.raises(ValueError) as caught:
        place(model, VIT_DEVICES, inputs=[(2, 3, 16, 16)], no_split=["TinyViT"],
              pin={"head": "cuda:1"})  # fmt: skip
    message = str(caught.value)
    assert "lies inside the whole model" in message and "pin the whole model instead" in message
    assert "''" not in message


class ReadsAValue(nn.Module):
    """One layer whose forward reads a value of its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight * self.weight.abs().max().item()


class LeavesItsDevice(ReadsAValue):
    """One layer whose forward copies to the CPU: it cannot run on shape-only (meta) tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).cpu()


def test_a_training_step_that_reads_values_is_measured_with_the_dry_runs_answers():
    with meta_init():
        model = ReadsAValue()
    plan = place(model, {"cpu": "1GiB"}, inputs=[(4, 8)], training=True)
    assert plan.notes == []
    assert plan.parts[0][3].saved > 0


def test_a_note_about_an_estimate_names_the_part_and_says_why_in_words():
    with meta_init():
        model = LeavesItsDevice()
    plan = place(model, {"cpu": "1GiB"}, inputs=[(4, 8)], training=True)
    step, note = plan.notes
    assert step.startswith("the training step could not run on shape-only tensors")
    assert note.startswith("the whole model: what it keeps for the backward pass is estimated")
    assert "could not run again on shape-only tensors" in note
    assert "Error" not in note.split("(")[0]


def test_the_widgets_seq_len_refusal_states_the_limit():
    from jupyter_metainit.jupyter.widget import explore

    model = _bart()
    w = explore(model)
    w.place("cuda:0=2MiB, cuda:1=2MiB", seq_len=10**9)
    assert "from 1 to 1,048,576, not 1000000000" in w.notice["text"]
    assert w.plan == {}
