"""Whole-model materialization is bit-identical to eager construction with the same seed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from _twins import assert_same, eager_and_deferred
from torch import nn

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init


def assert_exact(ctor, seed=0):
    eager, deferred = eager_and_deferred(ctor, seed=seed)
    state = torch.get_rng_state()
    materialize(deferred)
    assert torch.equal(state, torch.get_rng_state())
    assert not is_deferred(deferred)
    assert_same(eager, deferred)
    return eager, deferred


TORCH_MODULES = {
    "linear": lambda: nn.Linear(7, 5),
    "bilinear": lambda: nn.Bilinear(3, 4, 5),
    "conv1d": lambda: nn.Conv1d(3, 6, 3, groups=3),
    "conv2d": lambda: nn.Conv2d(3, 8, 3, padding=1),
    "conv3d": lambda: nn.Conv3d(2, 4, 2),
    "conv_transpose2d": lambda: nn.ConvTranspose2d(4, 2, 3, stride=2),
    "batchnorm": lambda: nn.BatchNorm2d(8),
    "groupnorm": lambda: nn.GroupNorm(2, 8),
    "layernorm": lambda: nn.LayerNorm(16),
    "rmsnorm": lambda: nn.RMSNorm(16),
    "instancenorm": lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
    "embedding": lambda: nn.Embedding(20, 8, padding_idx=3),
    "embedding_bag": lambda: nn.EmbeddingBag(20, 8),
    "rnn": lambda: nn.RNN(6, 8, num_layers=2),
    "lstm": lambda: nn.LSTM(6, 8, num_layers=2, bidirectional=True, proj_size=4),
    "gru": lambda: nn.GRU(6, 8, batch_first=True),
    "lstm_cell": lambda: nn.LSTMCell(6, 8),
    "mha": lambda: nn.MultiheadAttention(16, 4, kdim=8, vdim=8),
    "transformer_encoder": lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32), 2),
    "transformer": lambda: nn.Transformer(16, 2, 1, 1, 32),
    "prelu": lambda: nn.PReLU(4),
    "loss_with_weight": lambda: nn.CrossEntropyLoss(weight=torch.rand(5)),
    "adaptive_softmax": lambda: nn.AdaptiveLogSoftmaxWithLoss(16, 40, [10, 20]),
}


@pytest.mark.parametrize("name", sorted(TORCH_MODULES))
def test_torch_nn_module(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_exact(TORCH_MODULES[name])


def test_custom_init_functions():
    class Inits(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.empty(6, 4))
            self.b = nn.Parameter(torch.empty(5, 5))
            self.c = nn.Parameter(torch.empty(8, 8))
            self.d = nn.Parameter(torch.empty(4, 4))
            nn.init.orthogonal_(self.a)
            nn.init.trunc_normal_(self.b, std=0.02)
            nn.init.sparse_(self.c, 0.5)
            nn.init.xavier_normal_(self.d)
            with torch.no_grad():
                self.c[:, :3].normal_()
                self.d.data.mul_(0.5)

    assert_exact(Inits)


def test_lazy_modules_after_a_dry_run_equal_the_eager_dry_run():
    def ctor_and_run(ctx):
        m = nn.Sequential(nn.LazyConv2d(4, 3), nn.Flatten(), nn.LazyLinear(5))
        with ctx():
            m(torch.ones(2, 3, 8, 8))
        return m

    eager, m = eager_and_deferred(lambda: ctor_and_run(torch.no_grad))
    assert m[2].weight.shape == (5, 144) and is_deferred(m)
    materialize(m)
    for a, b in zip(eager.state_dict().values(), m.state_dict().values(), strict=True):
        assert torch.equal(a, b)


transformers = pytest.importorskip("transformers")


def _cfg(cls, **kw):
    return lambda: cls(**kw)


TRANSFORMERS = {
    "llama": lambda: transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)),
    "gpt2": lambda: transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0)),
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=128)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=128, d_kv=16)),
    "mistral": lambda: transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128)),
    "qwen2": lambda: transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)),
    "mixtral": lambda: transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, num_local_experts=4)),
    "vit": lambda: transformers.ViTModel(transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=32, patch_size=8)),
    "whisper": lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=128,
        num_mel_bins=16, max_source_positions=32, max_target_positions=32, pad_token_id=1,
        bos_token_id=2, eos_token_id=2, decoder_start_token_id=2)),
    "clip": lambda: transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, vocab_size=128, bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, image_size=32, patch_size=8),
        projection_dim=32)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_transformers_model(name):
    transformers.logging.set_verbosity_error()
    _eager, deferred = assert_exact(TRANSFORMERS[name])
    if name in ("llama", "qwen2"):
        assert deferred.lm_head.weight is deferred.model.embed_tokens.weight


class _NormWarmUp(nn.Module):
    """Runs a train-mode batch through its norms in ``__init__``, as warm-up code does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn1d = nn.BatchNorm1d(3)
        self.bn2d = nn.BatchNorm2d(3)
        self.inorm = nn.InstanceNorm1d(3, track_running_stats=True)
        self.bn1d(self.lin(torch.randn(4, 3)))
        self.bn2d(torch.randn(2, 3, 4, 4))
        self.inorm(torch.randn(2, 3, 5))


def test_train_mode_forward_in_init_updates_norm_running_stats_as_eager():
    eager, _ = assert_exact(_NormWarmUp)
    assert not torch.equal(eager.bn1d.running_mean, torch.zeros(3))  # the batch was counted


def test_norm_running_stats_materialized_alone_equal_eager():
    eager, deferred = eager_and_deferred(_NormWarmUp)
    materialize(deferred.inorm)
    materialize(deferred.bn2d)
    assert torch.equal(deferred.inorm.running_var, eager.inorm.running_var)
    assert torch.equal(deferred.bn2d.running_mean, eager.bn2d.running_mean)


_FRESH_FROM_PARAMETER = {
    "ones_like": lambda p: torch.ones_like(p),
    "zeros_like": lambda p: torch.zeros_like(p),
    "rand_like": lambda p: torch.rand_like(p),
    "randn_like": lambda p: torch.randn_like(p),
    "randint_like": lambda p: torch.randint_like(p, 5),
    "empty_like": lambda p: torch.empty_like(p),
    "full_like": lambda p: torch.full_like(p, 2.0),
    "new_ones": lambda p: p.new_ones(2),
    "new_zeros": lambda p: p.new_zeros(2),
    "new_empty": lambda p: p.new_empty(2),
    "new_full": lambda p: p.new_full((2,), 1.0),
    "new_tensor": lambda p: p.new_tensor([1.0, 2.0]),
    "ones_like_requires_grad": lambda p: torch.ones_like(p, requires_grad=True),
    "randn_requires_grad": lambda p: torch.randn(3, requires_grad=True),
    "tensor_requires_grad": lambda p: torch.tensor([1.0], requires_grad=True),
}


@pytest.mark.parametrize("name", sorted(_FRESH_FROM_PARAMETER))
def test_fresh_tensor_made_from_a_parameter_requires_grad_as_eager(name):
    make = _FRESH_FROM_PARAMETER[name]
    expected, got = eager_and_deferred(lambda: make(nn.Parameter(torch.randn(3, 4))))
    assert (got.requires_grad, got.is_leaf) == (expected.requires_grad, expected.is_leaf)
    materialize(got)
    assert (got.requires_grad, got.is_leaf) == (expected.requires_grad, expected.is_leaf)


_SIZE_ONE_LAYOUTS = {
    "(1,3,3) strides (3,3,1)": lambda: torch.randn(3, 3).unsqueeze(0),
    "(2,2,1,1) strides (2,1,2,1)": lambda: torch.randn(2, 2, 1, 1).as_strided(
        (2, 2, 1, 1), (2, 1, 2, 1)
    ),
    "(1,2,1,2) strides (2,2,4,1)": lambda: torch.randn(4).as_strided((1, 2, 1, 2), (2, 2, 4, 1)),
    "(2,2,1) strides (2,1,2)": lambda: torch.randn(4).as_strided((2, 2, 1), (2, 1, 2)),
}
_ELEMENTWISE = {
    "mul": lambda x: x * 2,
    "add": lambda x: x + x,
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "where": lambda x: torch.where(x > 0, x, -x),
    "empty_like": torch.empty_like,
    "zeros_like": torch.zeros_like,
    "rand_like": torch.rand_like,
    "to_float64": lambda x: x.double(),
}


@pytest.mark.parametrize("layout", sorted(_SIZE_ONE_LAYOUTS))
@pytest.mark.parametrize("op", sorted(_ELEMENTWISE))
def test_elementwise_output_strides_on_size_one_dims_equal_eager(op, layout):
    make, fn = _SIZE_ONE_LAYOUTS[layout], _ELEMENTWISE[op]
    expected, got = eager_and_deferred(lambda: fn(make().clone()))
    assert got.stride() == expected.stride()
    materialize(got)
    assert got.stride() == expected.stride()
    if op != "empty_like":
        assert torch.equal(got, expected)


# Where a tensor's first values come from: data the user hands over (kept in the recording),
# a factory, a random factory, or bytes of a file.
_SOURCES = {
    "tensor": lambda path: torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "as_tensor": lambda path: torch.as_tensor([1.0, 2.0, 3.0, 4.0]),
    "from_numpy": lambda path: torch.from_numpy(np.arange(4, dtype=np.float32)),
    "asarray": lambda path: torch.asarray(np.arange(4, dtype=np.float32)),
    "new_tensor": lambda path: torch.zeros(1).new_tensor([1.0, 2.0, 3.0, 4.0]),
    "zeros": lambda path: torch.zeros(4),
    "randn": lambda path: torch.randn(4),
    "file": lambda path: torch.load(path, mmap=True, weights_only=True)["t"],
}
_READS = {
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t.tolist(),
    "bool": lambda t: bool(t[0] > -100),
}


def _written_and_read(
    source: str, reads: tuple[str, ...], path, read: list
) -> dict[str, torch.Tensor]:
    """In-place writes on a tensor from ``source``, its values read between them (``reads``,
    one after each write, what they give appended to ``read``), a snapshot taken midway and a
    draw made after."""
    t = _SOURCES[source](path)
    steps = [
        lambda: t.add_(torch.randn(4)),
        lambda: t.mul_(2),
        lambda: t[1:3].sub_(1),  # through a view
    ]
    snapshot = None
    for i, step in enumerate(steps):
        step()
        if i < len(reads):
            read.append(_READS[reads[i]](t))
        if i == 1:
            snapshot = t.clone()
    return {"t": t, "snapshot": snapshot, "after": torch.randn(2)}


_READ_PATTERNS = [(), ("item",), ("tolist", "bool"), ("item", "item", "tolist")]


@pytest.fixture
def saved_four(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"t": torch.arange(4, dtype=torch.float32)}, path)
    return path


@pytest.mark.parametrize("reads", _READ_PATTERNS, ids="-".join)
@pytest.mark.parametrize("source", sorted(_SOURCES))
@pytest.mark.parametrize("how", ["whole", "parts", "again_after_free"])
def test_in_place_writes_with_value_reads_between_them_equal_eager(source, reads, how, saved_four):
    expected_read, read = [], []
    torch.manual_seed(0)
    eager = _written_and_read(source, reads, saved_four, expected_read)
    torch.manual_seed(0)
    with meta_init():
        got = _written_and_read(source, reads, saved_four, read)
    assert read == expected_read
    if how == "parts":
        for name in ("snapshot", "after", "t"):
            materialize(got[name])
    else:
        materialize(list(got.values()), keep_cache=how == "again_after_free")
    if how == "again_after_free":
        dematerialize(list(got.values()))
        materialize(list(got.values()))
    for name, value in eager.items():
        assert torch.equal(got[name], value), name


class _Counter(nn.Module):
    """Counts in a buffer made from Python data, reading it after every step."""

    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.tensor(0))
        for _ in range(3):
            self.n += 1
            if self.n.item() > 100:
                break


def test_a_counter_buffer_read_while_counting_equals_eager():
    assert_exact(_Counter)


def _foreach_add(first: torch.Tensor, second: torch.Tensor) -> None:
    torch._foreach_add_([first, second], 1.0)


def _batch_norm_stats(first: torch.Tensor, second: torch.Tensor) -> None:
    nn.functional.batch_norm(torch.randn(4, 3), first, second, training=True)


# Ops that write several tensors at once: reading one of them replays the op whole.
_MULTI_WRITES = {"foreach_add_": _foreach_add, "batch_norm_running_stats": _batch_norm_stats}


@pytest.mark.parametrize("op", sorted(_MULTI_WRITES))
@pytest.mark.parametrize("source", ["tensor", "zeros"])
def test_reading_one_tensor_an_op_wrote_leaves_the_others_it_wrote_as_eager(op, source):
    def build():
        make = _SOURCES[source]
        first, second = make(None)[:3].clone(), make(None)[:3].clone() + 1
        read = []
        for _ in range(2):
            _MULTI_WRITES[op](first, second)
            read.append(first.tolist())  # replays the op, which writes `second` too
            read.append(second.tolist())
        return [first, second], read

    torch.manual_seed(0)
    expected, expected_read = build()
    torch.manual_seed(0)
    with meta_init():
        got, read = build()
    assert read == expected_read
    materialize(got)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("source", ["tensor", "as_tensor", "from_numpy"])
def test_training_a_tensor_made_from_user_data_then_forcing_a_free_rematerializes_the_original(
    source,
):
    with meta_init():
        t = _SOURCES[source](None)
    materialize(t, keep_cache=True)
    original = t.clone()
    with torch.no_grad():
        t.mul_(3)  # training: the recording must not see it
    dematerialize(t, force=True)
    materialize(t)
    assert torch.equal(t, original)
