"""``jupyter_metainit.stats``: every tensor's statistics, exact against float64 torch on the eager
tensors, for deferred, checkpoint-backed, partly real and real models, in bounded memory, the
model and the global generator left as they were."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init, stats
from jupyter_metainit.inspection import pipeline

transformers = pytest.importorskip("transformers")

from _twins import eager_and_deferred  # noqa: E402

from tests._models import llama_config  # noqa: E402

EXACT = ("numel", "min", "max", "absmax", "zeros", "nan", "inf")
CLOSE = ("mean", "std", "l2")


def reference(t: torch.Tensor) -> dict[str, float]:
    """The statistics by float64 torch on the whole tensor at once."""
    x = t.detach().cpu()
    x = (torch.view_as_real(x) if x.is_complex() else x).double().reshape(-1)
    kept = x[~torch.isnan(x)]
    lo, hi = (kept.min().item(), kept.max().item()) if kept.numel() else (math.nan, math.nan)
    return {
        "numel": t.numel(), "mean": x.mean().item(),
        "std": x.std(correction=0).item() if x.numel() else math.nan,
        "min": lo, "max": hi, "absmax": max(abs(lo), abs(hi)),
        "l2": torch.linalg.vector_norm(x).item(), "zeros": int((x == 0).sum()),
        "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum()),
    }  # fmt: skip


def _same(ours: float, ref: float, exact: bool) -> bool:
    if math.isnan(ref):
        return math.isnan(ours)
    if exact or math.isinf(ref):
        return ours == ref
    return abs(ours - ref) <= 1e-9 * abs(ref) + 1e-300


def assert_matches(table, tensors: dict[str, torch.Tensor]) -> None:
    """Each row of ``table`` agrees with :func:`reference` on the eager tensor of that name:
    exactly for the extremes and counts, to 1e-9 relative for mean, std and l2."""
    assert list(table.index) == list(tensors)
    for name, t in tensors.items():
        ref, row = reference(t), table.loc[name]
        for column in EXACT + CLOSE:
            assert _same(float(row[column]), float(ref[column]), column in EXACT), (
                f"{name}.{column}: {row[column]!r} != {ref[column]!r}"
            )


def _llama(tie: bool = True):
    return transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=tie))


def _untied_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def test_a_deferred_model_gives_the_statistics_of_eager_construction():
    eager, deferred = eager_and_deferred(_llama)
    assert_matches(stats(deferred), _untied_state(eager))


def test_a_real_model_gives_the_statistics_of_its_tensors():
    torch.manual_seed(0)
    model = _llama()
    assert_matches(stats(model), _untied_state(model))


def test_a_model_opened_under_meta_init_is_read_from_its_files(tmp_path):
    torch.manual_seed(0)
    _llama().save_pretrained(tmp_path)
    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with meta_init():
        opened = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert_matches(stats(opened), _untied_state(eager))
    assert all(is_deferred(p) for p in opened.parameters())


def test_a_partly_materialized_model_gives_real_and_deferred_values_alike():
    eager, deferred = eager_and_deferred(_llama)
    materialize(deferred.model.layers[0])
    layer = deferred.model.layers[0].mlp.up_proj.weight
    pointer = layer.data_ptr()
    assert_matches(stats(deferred), _untied_state(eager))
    assert not is_deferred(deferred.model.layers[0]) and is_deferred(deferred.model.layers[1])
    assert layer.data_ptr() == pointer


def test_a_checkpoint_path_is_read_as_its_tensors(tmp_path):
    torch.manual_seed(0)
    model = _llama(tie=False)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    table = stats(tmp_path)
    assert_matches(table.loc[list(model.state_dict())], model.state_dict())


def test_the_model_stays_deferred_and_the_global_generator_untouched():
    _, deferred = eager_and_deferred(_llama)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    stats(deferred, bins=4)
    stats(deferred, per="module")
    assert torch.equal(torch.get_rng_state(), state)
    assert all(is_deferred(t) for t in deferred.state_dict().values())


def test_every_dtype_and_special_value_is_counted_exactly():
    torch.manual_seed(0)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 2.5, -3.0])
    tensors = {
        "offset": torch.randn(300_000, dtype=torch.float64) * 1e-3 + 1e4,  # sum**2/n cancels
        "f32": torch.randn(300_003),  # more than one chunk, an odd tail
        "bf16": torch.randn(1000, 300).bfloat16(),
        "f16": (torch.randn(5000) * 100).half(),
        "special": special,
        "special_bf16": special.bfloat16(),
        "all_nan": torch.full((10,), float("nan")),
        "int64": torch.randint(-5, 5, (1000,)),
        "int8": torch.randint(-128, 127, (1000,), dtype=torch.int8),
        "bool": torch.rand(1000) > 0.5,
        "transposed": torch.randn(30, 40).t(),
        "scalar": torch.tensor(-7.0),
        "empty": torch.empty(0, 3),
        "complex": torch.randn(100, dtype=torch.complex64),
    }
    assert_matches(stats(tensors), tensors)


def test_signed_zeros_are_counted_in_every_float_width_without_nan_beside_them():
    # The zeros are found on the bit patterns (-0.0 is the smallest signed one), and not
    # looked for where the extremes leave no room for one.
    values = torch.tensor([-0.0, 0.0, -0.0, 1.5, -2.0, 3.0])
    widths = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
    tensors = {str(dtype): values.to(dtype) for dtype in widths}
    tensors["negative_zeros_only"] = torch.tensor([-0.0, -0.0, 1.0]).bfloat16()
    tensors["positive"] = torch.rand(1000) + 0.5
    tensors["negative"] = -torch.rand(1000) - 0.5
    table = stats(tensors)
    assert_matches(table, tensors)
    assert list(table["zeros"]) == [3] * len(widths) + [2, 0, 0]


def test_a_tied_weight_is_one_row_under_its_first_name():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    table = stats(model)
    assert list(table.index) == ["0.weight"]
    assert table.loc["0.weight", "tied"] == "1.weight"


def test_per_module_sums_numel_and_l2_takes_absmax_and_counts_a_tie_once():
    eager, deferred = eager_and_deferred(_llama)
    tensors, modules = stats(deferred), stats(deferred, per="module")
    layer = tensors[tensors.index.str.startswith("model.layers.1.")]
    row = modules.loc["model.layers.1"]
    assert row["numel"] == layer["numel"].sum() and row["absmax"] == layer["absmax"].max()
    assert row["l2"] == pytest.approx(math.sqrt((layer["l2"] ** 2).sum()), rel=1e-12)
    whole = torch.cat([t.double().reshape(-1) for t in _untied_state(eager).values()])
    root = modules.loc[""]
    assert root["numel"] == whole.numel() and root["depth"] == 0
    assert root["std"] == pytest.approx(whole.std(correction=0).item(), rel=1e-9)
    assert modules.loc["lm_head", "l2"] == modules.loc["model.embed_tokens", "l2"]


def test_depth_keeps_the_modules_at_most_that_deep():
    _, deferred = eager_and_deferred(_llama)
    table = stats(deferred, per="module", depth=3)
    assert list(table.index[:4]) == ["", "model", "model.embed_tokens", "model.layers"]
    assert table["depth"].max() == 3 and "model.layers.0" in table.index
    assert "model.layers.0.mlp" not in table.index


def test_histograms_count_each_tensors_values_in_equal_bins_between_min_and_max():
    torch.manual_seed(0)
    tensors = {"w": torch.randn(300_000), "special": torch.tensor([1.0, float("inf"), 3.0, 2.0])}
    table = stats(tensors, bins=16)
    w = tensors["w"].double()
    expected = torch.histc(w, 16, w.min().item(), w.max().item()).numpy().astype(np.int64)
    assert np.array_equal(table.loc["w", "histogram"], expected)
    assert table.loc["special", "histogram_range"] == (1.0, 3.0)
    assert table.loc["special", "histogram"].sum() == 3


def test_progress_ends_at_the_total_bytes():
    _, deferred = eager_and_deferred(_llama)
    seen = []
    stats(deferred, progress=lambda done, total: seen.append((done, total)))
    total = sum(t.nbytes for t in _untied_state(deferred).values())
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_cancelling_progress_callback_stops_and_leaves_the_model_deferred(monkeypatch):
    # internal size, no setting:
    monkeypatch.setattr(pipeline, "BATCH_BYTES", 1 << 10)  # many batches: cancel in the middle
    eager, deferred = eager_and_deferred(_llama)
    calls = []

    def cancel(done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stats(deferred, progress=cancel)
    assert all(is_deferred(t) for t in deferred.state_dict().values())
    assert_matches(stats(deferred), _untied_state(eager))


def test_many_small_batches_give_the_same_statistics(monkeypatch):
    # internal size, no setting:
    monkeypatch.setattr(pipeline, "BATCH_BYTES", 1 << 10)  # two batches alive, buffers reused
    eager, deferred = eager_and_deferred(_llama)
    assert_matches(stats(deferred), _untied_state(eager))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per": "layer"}, "per= takes 'tensor' or 'module'"),
        ({"bins": 8, "per": "module"}, "bins= gives a histogram per tensor"),
        ({"bins": 0}, "bins= takes a whole number"),
        ({"depth": 1}, "depth= chooses module rows"),
        ({"depth": -1, "per": "module"}, "depth= takes a whole number"),
    ],
)
def test_a_bad_option_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stats(nn.Linear(2, 2), **kwargs)


def test_something_that_is_not_a_model_is_a_clear_error():
    with pytest.raises(TypeError, match="stats\\(\\) takes a module, a dict of tensors"):
        stats([torch.ones(2)])


def test_a_tensor_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="weight has no values to read: it is on PyTorch"):
        stats(model)


def test_a_path_holding_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no checkpoint"):
        stats(tmp_path)


_PEAK_SCRIPT = """
import torch
from torch import nn
from jupyter_metainit import meta_init, stats
with meta_init():
    model = nn.Sequential(*[nn.Linear(5120, 4096, bias=False) for _ in range(8)])  # 8 x 80 MiB
stats(nn.Linear(2, 2))  # the worker threads started
def kib(field):  # this process's memory: VmRSS now, VmHWM its peak since the reset
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
before = kib("VmRSS:") * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
stats(model)
after = kib("VmHWM:") * 1024
print(after - before)
"""


def test_peak_memory_follows_the_largest_tensor_not_the_model():
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True,
                         check=True)  # fmt: skip
    growth = int(out.stdout.split()[-1])
    tensor = 5120 * 4096 * 4
    assert growth <= 2 * tensor + (200 << 20), f"peak grew by {growth >> 20} MiB"  # model: 640


def test_the_measuring_workers_run_torch_on_one_thread_each():
    # Each worker is one of the parallel measurers: a torch op of its own starting a team of
    # threads would oversubscribe the cores (and spin them idle between chunks).
    stats({"w": torch.randn(1000)})
    workers = pipeline.Chunks(threading.Event(), pipeline.Progress(None, 0, "")).pool
    assert workers.submit(torch.get_num_threads).result() == 1


def test_a_file_that_is_no_safetensors_file_is_named_in_the_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file"):
        stats(bad)


def test_a_lazy_parameter_before_its_forward_pass_says_to_run_one():
    with meta_init():
        model = nn.Sequential(nn.LazyLinear(4))
    with pytest.raises(ValueError, match=r"before its first forward pass.*run the model once"):
        stats(model)
