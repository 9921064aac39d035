from __future__ import annotations

import pytest
import torch
import transformers
from _models import LLAMA_70B, llama_config
from accelerate.commands.estimate import estimate_training_usage
from accelerate.utils import compute_module_sizes
from torch import nn

from jupyter_metainit.estimates import memory_table


class Tied(nn.Module):
    """Hand-computable: a tied embedding/head, a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)  # 40 params
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once
        self.norm = nn.LayerNorm(4)  # 8 params
        self.register_buffer("pos", torch.arange(6), persistent=False)  # int64: 48 bytes
        self.register_buffer("scale", torch.ones(3))  # float32: 12 bytes


def tiny_llama(tie: bool = True) -> nn.Module:
    cfg = llama_config(tie_word_embeddings=tie)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def test_hand_computed_root_counts_tied_weight_once():
    row = memory_table(Tied()).loc[""]
    assert (row["params"], row["param_bytes"]) == (48, 192)
    assert (row["buffer_bytes"], row["nonpersistent_bytes"], row["total_bytes"]) == (12, 48, 252)
    assert row["shared_bytes"] == 0
    assert row["dtypes"] == "float32, int64"


def test_hand_computed_rows_report_bytes_shared_outside():
    table = memory_table(Tied())
    assert table.loc["emb", "total_bytes"] == 160 and table.loc["emb", "shared_bytes"] == 160
    assert table.loc["head", "params"] == 40 and table.loc["head", "shared_bytes"] == 160
    assert table.loc["norm", "shared_bytes"] == 0 and table.loc["norm", "params"] == 8


def test_buffer_shared_between_modules_counted_once():
    a, b = nn.Module(), nn.Module()
    shared = torch.zeros(5)
    a.register_buffer("x", shared)
    b.register_buffer("x", shared)
    root = nn.Sequential(a, b)
    table = memory_table(root)
    assert table.loc["", "buffer_bytes"] == 20
    assert table.loc["0", "shared_bytes"] == 20 and table.loc["1", "shared_bytes"] == 20


def test_module_reachable_twice_gets_a_row_per_path():
    shared = nn.Linear(4, 4)
    root = nn.Module()
    root.a, root.b = shared, shared
    table = memory_table(root)
    assert list(table.index) == ["", "a", "b"]
    assert table.loc["", "params"] == 20
    assert table.loc["b", "params"] == 20 and table.loc["b", "shared_bytes"] == 80


def test_rows_in_tree_order_root_first():
    model = tiny_llama()
    table = memory_table(model)
    assert list(table.index) == [name for name, _ in model.named_modules()]
    assert table.loc["model.layers", "children"] == 2
    assert table.loc["model.layers.1.mlp", "depth"] == 4


def test_params_match_torch_count_with_tied_weights():
    model = tiny_llama(tie=True)
    table = memory_table(model)
    assert table.loc["", "params"] == sum(p.numel() for p in model.parameters())
    assert table.loc["", "params_trainable"] == table.loc["", "params"]


@pytest.mark.parametrize("tie", [True, False])
def test_totals_match_accelerate_compute_module_sizes(tie):
    model = tiny_llama(tie=tie)
    table = memory_table(model)
    sizes = compute_module_sizes(model)
    assert table.loc["", "total_bytes"] == sizes[""]
    unshared = table[table["shared_bytes"] == 0]
    assert all(unshared.loc[name, "total_bytes"] == sizes[name] for name in unshared.index)


def test_tied_llama_reports_shared_embedding():
    table = memory_table(tiny_llama(tie=True))
    assert table.loc["lm_head", "shared_bytes"] == 1000 * 64 * 4
    assert table.loc["model.embed_tokens", "shared_bytes"] == 1000 * 64 * 4


def test_dtype_whatif_matches_accelerate_and_leaves_model_alone():
    model = tiny_llama()
    table = memory_table(model, dtype=torch.bfloat16)
    assert table.loc["", "total_bytes"] == compute_module_sizes(model, dtype=torch.bfloat16)[""]
    assert table.loc["", "dtypes"] == "bfloat16"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_dtype_whatif_keeps_integer_buffers():
    table = memory_table(Tied(), dtype="int8")
    assert table.loc["", "param_bytes"] == 48  # 1 byte per float element
    assert table.loc["", "nonpersistent_bytes"] == 48  # int64 buffer untouched


@pytest.mark.parametrize(("dtype", "nbytes"), [("int2", 16), ("uint4", 32), ("int3", 24)])
def test_dtype_whatif_counts_torchs_sub_byte_dtypes_at_their_bits(dtype, nbytes):
    assert memory_table(nn.Linear(8, 8, bias=False), dtype=dtype).loc["", "total_bytes"] == nbytes


def test_dtype_whatif_int4_is_half_a_byte():
    assert memory_table(nn.Linear(8, 8, bias=False), dtype="int4").loc["", "total_bytes"] == 32


def test_fp32_adam_training_matches_accelerate_estimate():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    row = memory_table(model).loc[""]
    usage = estimate_training_usage(compute_module_sizes(model)[""], "float32")
    assert row["train_fp32_bytes"] == max(usage.values()) == 16 * row["params"]
    assert row["grad_fp32_bytes"] == usage["gradients"]
    assert row["optim_fp32_bytes"] == usage["optimizer"]


def test_mixed_precision_components_match_accelerate_rule():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    row = memory_table(model).loc[""]
    usage = estimate_training_usage(compute_module_sizes(model)[""], "bfloat16")
    assert row["grad_mixed_bytes"] == usage["gradients"]
    assert row["optim_mixed_bytes"] == usage["optimizer"] == max(usage.values())
    assert row["train_mixed_bytes"] == 20 * row["params"]


def test_frozen_parameters_need_no_gradients():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    row = memory_table(model).loc[""]
    assert row["params_trainable"] == 20 and row["params"] == 40
    assert row["grad_fp32_bytes"] == 80
    assert row["train_fp32_bytes"] == 4 * 40 + 4 * 20 + 8 * 20


def test_optimizer_choice_changes_state_bytes():
    model = nn.Linear(4, 4)
    assert memory_table(model, optimizer="sgd").loc["", "optim_fp32_bytes"] == 0
    assert memory_table(model, optimizer=12).loc["", "optim_fp32_bytes"] == 240


def test_depth_limits_rows_but_not_totals():
    model = tiny_llama()
    full, shallow = memory_table(model), memory_table(model, depth=1)
    assert list(shallow.index) == ["", "model", "lm_head"]
    assert shallow.loc["", "total_bytes"] == full.loc["", "total_bytes"]


def test_state_meta_for_a_meta_device_model():
    assert memory_table(tiny_llama()).loc["", "state"] == "meta"


def test_state_real_and_mixed():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    table = memory_table(model)
    assert list(table["state"]) == ["mixed", "cpu", "meta"]


def test_source_says_checkpoint_or_init(tmp_path):
    from safetensors.torch import save_file

    from jupyter_metainit import meta_init

    save_file({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, str(tmp_path / "l.st"))
    with meta_init():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        model[0].load_state_dict(load_file_for_test(tmp_path / "l.st"), assign=True)
    table = memory_table(model)
    assert list(table["source"]) == ["mixed", "checkpoint", "init"]


def load_file_for_test(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_state_under_meta_init_and_after_partial_materialize():
    from jupyter_metainit import materialize, meta_init

    with meta_init():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert memory_table(model).loc["", "state"] == "deferred"
    materialize(model[0])
    assert list(memory_table(model)["state"]) == ["mixed", "cpu", "deferred"]


def test_lazy_module_before_forward_counts_as_uninitialized():
    table = memory_table(nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2)))
    assert table.loc["0", "state"] == "uninitialized" and table.loc["0", "params"] == 0
    assert table.loc["", "params"] == 10 and table.loc["", "state"] == "mixed"


def test_seventy_b_table_has_a_row_per_module_and_counts_every_parameter_once():
    # Its time (target 0.2 s) is a figure: benchmarks/bench_estimates.py prints it.
    cfg = llama_config(LLAMA_70B)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    table = memory_table(model)
    assert len(table) == len(list(model.modules()))
    assert table.loc["", "params"] == sum(p.numel() for p in model.parameters())


class Attributes(nn.Module):
    """Tensors kept as plain attributes: a 4 MB table, a dict of them, views of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, bias=False)  # 16 bytes
        self.table = torch.zeros(1000, 1000)  # 4,000,000 bytes
        self.table_rows = self.table[:10]  # a view: no memory of its own
        self.tables = {"k": torch.zeros(250), "again": self.table}  # 1,000 bytes new
        self.lin.w_t = self.lin.weight.t()  # a view of a parameter: nothing
        self.lin.rows = [self.lin.weight[0]]


def test_tensor_attributes_count_once_per_storage_on_a_deferred_model():
    from jupyter_metainit import meta_init

    with meta_init():
        m = Attributes()
    row = memory_table(m).loc[""]
    assert (row["attribute_bytes"], row["total_bytes"]) == (4_001_000, 4_001_016)


def test_tensor_attributes_count_the_same_after_materialize():
    from jupyter_metainit import materialize, meta_init

    with meta_init():
        m = Attributes()
    materialize(m)
    table = memory_table(m)
    assert table.loc["", "total_bytes"] == 4_001_016
    assert table.loc["lin", "attribute_bytes"] == 0


def test_a_tensor_attribute_held_by_two_modules_is_shared_not_doubled():
    a, b = nn.Module(), nn.Module()
    a.cache = b.cache = torch.zeros(5)
    table = memory_table(nn.Sequential(a, b))
    assert table.loc["", "total_bytes"] == 20
    assert table.loc["0", "shared_bytes"] == 20


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"depth": "2"}, TypeError, "depth must be an int >= 0"),
        ({"depth": -1}, ValueError, "depth must be >= 0"),
        ({"depth": 1.5}, TypeError, "depth must be an int"),
        ({"optimizer": -3}, ValueError, "must be >= 0"),
        ({"optimizer": float("nan")}, ValueError, "must be >= 0"),
        ({"optimizer": True}, TypeError, "bytes per trainable parameter"),
        ({"optimizer": ["adam"]}, TypeError, "bytes per trainable parameter"),
    ],
    ids=[
        "depth_str",
        "depth_negative",
        "depth_float",
        "optim_negative",
        "optim_nan",
        "optim_bool",
        "optim_list",
    ],
)
def test_nonsense_arguments_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        memory_table(nn.Linear(2, 2), **kwargs)


def test_a_tensor_instead_of_a_module_says_to_pass_the_module():
    with pytest.raises(TypeError, match=r"memory_table\(\) takes an nn.Module .* not Tensor"):
        memory_table(torch.ones(3))


def test_values_column_says_which_parts_hold_fast_rng_values():
    from jupyter_metainit import materialize, meta_init

    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    materialize(model[0], rng="fast")
    materialize(model[1])
    table = memory_table(model)
    assert table.loc["0", "values"] == "fast"
    assert table.loc["1", "values"] == "exact"
    assert table.loc["2", "values"] == ""
    assert table.loc["", "values"] == "mixed"
    assert "values" in table.to_html_view(compact=True)


@pytest.mark.parametrize(("name", "itemsize"), [("double", 8), ("torch.float64", 8), ("fp16", 2)])
def test_memory_table_reads_any_torch_dtype_name(name, itemsize):
    table = memory_table(nn.Linear(4, 4), dtype=name)
    assert table.loc["", "total_bytes"] == 20 * itemsize
