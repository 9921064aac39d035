from __future__ import annotations

import pytest
import torch
import transformers
from _models import llama_config
from accelerate.commands.estimate import estimate_training_usage
from accelerate.utils import compute_module_sizes
from torch import nn

from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.estimates import fits, memory_table, summary
from jupyter_metainit.estimates.fit import parse_bytes


def model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))  # 40,400 B + 4,040 B


def test_parse_bytes_reads_binary_and_decimal_units():
    assert parse_bytes("24GiB") == 24 * 1024**3
    assert parse_bytes("80 GB") == 80 * 1000**3
    assert parse_bytes(1234) == 1234


def test_fits_marks_subtrees_within_budget():
    result = fits(model(), budget=10_000)
    assert list(result["fits"]) == [False, False, True]
    assert result.loc["1", "headroom_bytes"] == 10_000 - 4_040


def test_fits_takes_materialization_dtype_into_account():
    result = fits(model(), budget=25_000, dtype=torch.bfloat16)
    assert list(result["fits"]) == [True, True, True]
    assert result.loc["", "total_bytes"] == 44_440 // 2


def test_fits_cpu_budget_is_available_host_memory():
    result = fits(model(), device="cpu")
    assert result.attrs["budget_bytes"] > 0
    assert bool(result.loc["", "fits"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_fits_without_gpu_asks_for_a_budget():
    with pytest.raises(ValueError, match="budget="):
        fits(model(), device="cuda:0")


def test_fits_from_a_config_directory(tmp_path):
    cfg = llama_config(architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    result = fits(str(tmp_path), budget="1MiB")
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(cfg)
    assert result.loc["", "total_bytes"] == compute_module_sizes(reference)[""]


def test_summary_gives_params_largest_leaf_and_training():
    text = summary(model())
    assert text.startswith("Sequential: 11,110 params")
    assert "largest leaf 0 (Linear, 39.5 KiB)" in text
    usage = estimate_training_usage(44_440, "float32")
    assert max(usage.values()) == 177_760 and "fp32 174 KiB" in text


def test_summary_reports_bytes_per_dtype():
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert "80 B float32" in summary(mixed) and "40 B bfloat16" in summary(mixed)


def test_summary_accepts_a_table():
    table = memory_table(model(), dtype="int8")
    assert "10.8 KiB int8" in summary(table)


def test_fits_counts_tensors_kept_as_plain_attributes():
    from jupyter_metainit import meta_init

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.cache = {"table": torch.zeros(1000, 1000)}

    with meta_init():
        m = Cached()
    assert not fits(m, budget=1_000_000).loc["", "fits"]


@pytest.mark.parametrize("budget", [-5, 0, "-1GiB", True, float("inf")])
def test_a_budget_that_is_no_memory_size_is_a_clear_error(budget):
    with pytest.raises((ValueError, TypeError), match=r"budget|memory size"):
        fits(nn.Linear(2, 2), budget=budget)


def test_summary_of_none_asks_whether_the_model_was_built():
    with pytest.raises(TypeError, match=r"summary\(\) takes an nn.Module .* not NoneType"):
        summary(None)


def test_fits_of_a_missing_local_path_says_it_does_not_exist():
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        fits("/tmp/no-such-model-dir/nope.safetensors", budget="1GiB")


def test_fits_of_a_weights_file_asks_for_the_model_directory(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="directory"):
        fits(str(weights), budget="1GiB")


@pytest.mark.parametrize("budget", [None, "1GiB"])
def test_fits_with_an_unknown_device_name_lists_the_valid_forms(budget):
    with pytest.raises(ValueError, match="'cuda:0'"):
        fits(model(), device="gpu", budget=budget)


@pytest.mark.parametrize("word", ["model", "gpt2", "llama-7b"])
def test_fits_of_a_word_that_is_neither_a_directory_nor_org_name_is_refused_at_once(
    tmp_path, monkeypatch, word
):
    monkeypatch.chdir(tmp_path)  # no directory of that name here: nothing to ask the hub
    with pytest.raises(ArgumentError, match=rf"no directory '{word}' here, and a hub name "):
        fits(word, budget="1GiB")


def test_fits_of_a_word_naming_a_directory_reads_that_directory(tmp_path, monkeypatch):
    llama_config(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "mymodel")
    monkeypatch.chdir(tmp_path)
    assert fits("mymodel", budget="1MiB").loc["", "total_bytes"] > 0
