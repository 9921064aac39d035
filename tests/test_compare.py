"""``jupyter_metainit.compare``: two models, state dicts or checkpoints, tensor by tensor, against
float64 torch on the eager tensors, streamed pairwise in bounded memory."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from jupyter_metainit import compare, is_deferred, meta_init, save

transformers = pytest.importorskip("transformers")

from _twins import eager_and_deferred  # noqa: E402

from tests._models import llama_config  # noqa: E402


def _llama(tie: bool = False):
    return transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=tie))


def _reference(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    x, y = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    return {
        "max_abs_diff": (x - y).abs().max().item(),
        "rel_l2": (torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(x)).item(),
        "cosine": (x @ y / (torch.linalg.vector_norm(x) * torch.linalg.vector_norm(y))).item(),
    }


def _all_equal(table) -> bool:
    return bool((table["status"] == "equal").all() and table["equal"].all())


def test_a_deferred_model_equals_its_eager_twin():
    eager, deferred = eager_and_deferred(_llama)
    table = compare(deferred, eager)
    assert _all_equal(table) and list(table.index) == list(eager.state_dict())
    assert (table["max_abs_diff"] == 0).all() and (table["rel_l2"] == 0).all()


def test_a_fine_tune_differs_by_what_float64_torch_measures():
    torch.manual_seed(0)
    base = _llama()
    tuned = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(1)
    for name in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        tuned[name] += 1e-3 * torch.randn_like(tuned[name])
    table = compare(base, tuned)
    changed = table[table["status"] == "differ"]
    assert list(changed.index) == ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    for name in changed.index:
        ref = _reference(base.state_dict()[name], tuned[name])
        row = table.loc[name]
        assert row["max_abs_diff"] == ref["max_abs_diff"] and not row["equal"]
        assert row["rel_l2"] == pytest.approx(ref["rel_l2"], rel=1e-9)
        assert row["cosine"] == pytest.approx(ref["cosine"], rel=1e-9)
    assert (table.drop(changed.index)["status"] == "equal").all()


def test_names_on_one_side_and_shapes_and_dtypes_that_differ_are_told():
    a = {"w": torch.ones(3), "only_a": torch.ones(2), "shape": torch.ones(4), "cast": torch.ones(2)}
    b = {"w": torch.ones(3), "only_b": torch.ones(2), "shape": torch.ones(2, 2),
         "cast": torch.tensor([1.0, 3.0], dtype=torch.float64)}  # fmt: skip
    table = compare(a, b)
    assert list(table.index) == ["w", "only_a", "shape", "cast", "only_b"]
    assert list(table["status"]) == ["equal", "only in a", "shape differs", "dtype differs",
                                     "only in b"]  # fmt: skip
    assert table.loc["cast", "max_abs_diff"] == 2.0 and not table.loc["cast", "equal"]
    assert math.isnan(table.loc["shape", "rel_l2"]) and math.isnan(table.loc["shape", "numel"])


def test_a_conversion_is_measured_against_its_source_across_dtypes():
    torch.manual_seed(0)
    source = {"w": torch.randn(1000, 300)}
    converted = {"w": source["w"].bfloat16()}
    row = compare(source, converted).loc["w"]
    ref = _reference(source["w"], converted["w"])
    assert row["status"] == "dtype differs" and row["max_abs_diff"] == ref["max_abs_diff"]
    assert row["rel_l2"] == pytest.approx(ref["rel_l2"], rel=1e-9)


def test_equal_means_the_same_bits():
    a = {"zero": torch.tensor([0.0, 1.0]), "nan": torch.tensor([float("nan"), 1.0])}
    b = {"zero": torch.tensor([-0.0, 1.0]), "nan": torch.tensor([float("nan"), 1.0])}
    table = compare(a, b)
    assert not table.loc["zero", "equal"] and table.loc["zero", "max_abs_diff"] == 0.0
    assert table.loc["nan", "equal"] and table.loc["nan", "status"] == "equal"


def test_checkpoint_paths_of_every_kind_equal_the_model_they_hold(tmp_path):
    torch.manual_seed(0)
    model = _llama()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    save(model, tmp_path / "dcp", format="dcp")
    index = tmp_path / "shards" / "model.safetensors.index.json"
    for path in (
        tmp_path / "one" / "model.safetensors",
        tmp_path / "shards",
        index,
        tmp_path / "dcp",
    ):
        table = compare(model, path)
        assert _all_equal(table), path
        assert sorted(table.index) == sorted(model.state_dict()), path


def test_a_tied_weight_the_checkpoint_keeps_once_equals_its_twin(tmp_path):
    torch.manual_seed(0)
    with meta_init():
        model = _llama(tie=True)
    save(model, tmp_path / "seed")  # lm_head.weight is embed_tokens': written once
    for a, b in ((model, tmp_path / "seed"), (tmp_path / "seed", model)):
        table = compare(a, b)
        assert _all_equal(table)
        assert sorted(table.index) == sorted(model.state_dict())
    assert is_deferred(model)


@pytest.mark.parametrize("arch", ["gpt_neox", "mixtral"])
def test_a_model_transformers_converts_in_memory_equals_its_save_pretrained(arch, tmp_path):
    # GPT-NeoX's lm_head is written as embed_out; Mixtral's fused experts are written split.
    if arch == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=100, tie_word_embeddings=False,
        )  # fmt: skip
    else:
        config = _mixtral_config()
    eager, deferred = eager_and_deferred(
        lambda: transformers.AutoModelForCausalLM.from_config(config)
    )
    eager.save_pretrained(tmp_path)
    for model in (eager, deferred):
        assert _all_equal(compare(model, tmp_path))
        assert _all_equal(compare(tmp_path, model))
    assert is_deferred(deferred)


def _mixtral_config():
    return transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, vocab_size=100,
    )  # fmt: skip


def test_a_subtree_of_a_model_transformers_fuses_equals_its_part_of_the_files(tmp_path):
    eager, deferred = eager_and_deferred(
        lambda: transformers.AutoModelForCausalLM.from_config(_mixtral_config())
    )
    eager.save_pretrained(tmp_path)  # the fused experts are written split, under other names
    table = compare(deferred, tmp_path, modules="model.layers.0.mlp")
    assert _all_equal(table)
    assert sorted(table.index) == sorted(
        [f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
         for e in range(4) for w in ("w1", "w2", "w3")]
        + ["model.layers.0.mlp.gate.weight"]  # only renamed: under the model's name
    )  # fmt: skip
    assert is_deferred(deferred)


def test_a_subtree_of_a_dict_leaves_the_other_sides_other_tensors_out():
    eager, deferred = eager_and_deferred(_llama)
    table = compare(deferred, eager.state_dict(), modules=["model.layers.1"])
    assert sorted(table.index) == sorted(
        k for k in eager.state_dict() if k.startswith("model.layers.1.")
    )
    assert _all_equal(table)


def test_modules_that_a_does_not_have_are_a_clear_error():
    from jupyter_metainit import ArgumentError

    with pytest.raises(ArgumentError, match=r"'model\.layer\.0' is no submodule of a"):
        compare(_llama(), _llama(), modules=["model.layer.0"])


def test_a_model_opened_under_meta_init_is_read_from_its_files_and_stays_deferred(tmp_path):
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path / "base")
    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    with meta_init():
        opened = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    torch.manual_seed(5)
    state = torch.get_rng_state()
    assert _all_equal(compare(opened, eager))
    assert all(is_deferred(p) for p in opened.parameters())
    assert torch.equal(torch.get_rng_state(), state)


def test_progress_ends_at_both_sides_bytes_and_raising_cancels():
    eager, deferred = eager_and_deferred(_llama)
    seen = []
    compare(deferred, eager, progress=lambda done, total: seen.append((done, total)))
    total = 2 * sum(t.nbytes for t in eager.state_dict().values())
    assert seen[-1] == (total, total)

    def cancel(done, total):
        raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        compare(deferred, eager, progress=cancel)
    assert all(is_deferred(t) for t in deferred.state_dict().values())


def test_something_that_is_not_a_model_is_a_clear_error():
    with pytest.raises(TypeError, match="compare\\(\\): b takes a module"):
        compare(nn.Linear(2, 2), 3)


def test_a_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="compare\\(\\): a: no such file"):
        compare(tmp_path / "nothing", nn.Linear(2, 2))


_PEAK_SCRIPT = """
import torch
from torch import nn
from jupyter_metainit import compare, meta_init
def model(seed):
    torch.manual_seed(seed)
    with meta_init():
        return nn.Sequential(*[nn.Linear(4096, 2048, bias=False) for _ in range(16)])  # 16 x 32 MiB
a, b = model(0), model(1)
compare(nn.Linear(2, 2), nn.Linear(2, 2))  # the worker threads started
def kib(field):  # this process's memory: VmRSS now, VmHWM its peak since the reset
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
before = kib("VmRSS:") * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
compare(a, b)
after = kib("VmHWM:") * 1024
print(after - before)
"""


def test_peak_memory_follows_the_largest_pair_not_the_models():
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True,
                         check=True)  # fmt: skip
    growth = int(out.stdout.split()[-1])
    pair = 2 * 4096 * 2048 * 4
    assert growth <= 2 * pair + (200 << 20), f"peak grew by {growth >> 20} MiB"  # models: 1 GiB


_PATHS_SCRIPT = """
import torch
from jupyter_metainit import compare
compare({{"w": torch.ones(2)}}, {{"w": torch.ones(2)}})  # the worker threads started
def kib(field):  # this process's memory: VmRSS now, VmHWM its peak since the reset
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
before = kib("VmRSS:") * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
table = compare({a!r}, {b!r})
after = kib("VmHWM:") * 1024
assert (table["status"] == "differ").all()
print(after - before)
"""


def test_comparing_two_checkpoint_directories_follows_the_largest_pair(tmp_path):
    from safetensors.torch import save_file

    for side, offset in (("a", 0.0), ("b", 0.5)):
        (tmp_path / side).mkdir()
        for i in range(16):  # 16 x 32 MiB a side, one file each
            values = {f"w{i}": torch.full((4096, 2048), i + offset)}
            save_file(values, str(tmp_path / side / f"part{i:02d}.safetensors"))
    script = _PATHS_SCRIPT.format(a=str(tmp_path / "a"), b=str(tmp_path / "b"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)  # fmt: skip
    growth = int(out.stdout.split()[-1])
    pair = 2 * 4096 * 2048 * 4
    assert growth <= 2 * pair + (200 << 20), f"peak grew by {growth >> 20} MiB"  # files: 1 GiB


def test_two_sides_without_a_common_name_are_said_to_share_none():
    a = {"layer.weight": torch.ones(2)}
    b = {"model.layer.weight": torch.ones(2)}
    with pytest.warns(UserWarning, match="no tensor name is in both a and b"):
        table = compare(a, b)
    assert list(table["status"]) == ["only in a", "only in b"]
