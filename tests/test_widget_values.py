"""The widget's *Values* (kernel side): stats of the ticked rows on the worker thread."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from jupyter_metainit import meta_init, stats
from jupyter_metainit.core import tensor_state
from jupyter_metainit.jupyter.tree_widget.values import HISTOGRAM_BINS, MODULE_FIELDS
from jupyter_metainit.jupyter.widget import explore


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Linear(16, 32)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.norm = nn.LayerNorm(16)


def deferred_net() -> Net:
    torch.manual_seed(0)
    with meta_init():
        return Net()


def eager_net() -> Net:
    torch.manual_seed(0)
    return Net()


def module_row(w, name: str) -> dict:
    node = w._tree.index[name]
    row = next(r for r in w.values["modules"] if r[0] == node)
    return dict(zip(MODULE_FIELDS, row[1:], strict=True))


def tensor_row(w, name: str) -> list:
    return next(r for r in w.values["tensors"] if r[0] == name)


def test_values_of_the_whole_model_are_eagers_stats_and_the_model_stays_deferred():
    net = deferred_net()
    w = explore(net)
    w.measure_values()
    assert w.error == "", w.error
    assert w.status.startswith("Measured the values of model")
    assert {tensor_state(t) for t in net.state_dict().values()} == {"deferred"}
    eager = stats(eager_net())
    for name, row in eager.iterrows():
        got = tensor_row(w, name)
        assert got[1] == w._tree.index[name.rpartition(".")[0]]
        assert got[2:8] == [row[f] for f in MODULE_FIELDS]
        assert len(got[10]) == HISTOGRAM_BINS and sum(got[10]) == row["numel"]


def test_values_rows_aggregate_per_module_as_stats_per_module():
    net = deferred_net()
    w = explore(net)
    w.measure_values()
    eager = stats(eager_net(), per="module")
    for name in ("", "layers", "layers.1", "layers.1.mlp", "norm"):
        assert module_row(w, name) == {f: eager.loc[name, f] for f in MODULE_FIELDS}


def test_values_of_ticked_rows_measure_only_them():
    net = deferred_net()
    w = explore(net)
    w.selected = ["layers.2"]
    w.measure_values()
    assert w.values["scope"] == ["layers.2"]
    assert sorted(r[0] for r in w.values["tensors"]) == [
        "layers.2.attn.bias", "layers.2.attn.weight", "layers.2.mlp.bias", "layers.2.mlp.weight",
    ]  # fmt: skip
    nodes = {r[0] for r in w.values["modules"]}
    assert nodes == {w._tree.index[n] for n in ("layers.2", "layers.2.attn", "layers.2.mlp")}


def test_values_cancelled_publish_nothing_and_leave_the_model_deferred():
    net = deferred_net()
    w = explore(net)
    report = w._progress

    def click_cancel(done: int, total: int, phase: str = "") -> None:
        w.handle_action({"action": "cancel"})
        report(done, total, phase)

    w._progress = click_cancel
    w.measure_values()
    assert w.status.startswith("Cancelled"), (w.status, w.error)
    assert w.values == {}
    assert {tensor_state(t) for t in net.state_dict().values()} == {"deferred"}


def test_values_count_nan_and_inf_and_send_them_as_json_nulls():
    net = eager_net()
    with torch.no_grad():
        net.norm.weight[0] = math.nan
        net.norm.bias[1] = math.inf
    w = explore(net)
    w.measure_values()
    norm = module_row(w, "norm")
    assert (norm["nan"], norm["inf"], norm["std"]) == (1, 1, None)
    assert "2 NaN or infinite values" in w.status


def test_values_say_one_nan_value_in_the_singular():
    net = eager_net()
    with torch.no_grad():
        net.norm.weight[0] = math.nan
    w = explore(net)
    w.selected = ["norm"]
    w.measure_values()
    assert "the model unchanged. 1 NaN or infinite value (flagged in red)." in w.status
    assert ": 2 tensors in " in w.status


def test_values_refuse_unknown_names_from_the_page():
    net = deferred_net()
    w = explore(net)
    w.handle_action({"action": "values", "names": ["nope"]})
    assert w.busy == ""
    assert "nope" in w.notice["text"]
    assert w.values == {} and w.error == ""


@pytest.mark.parametrize("names", ["layers", [1], {"a": 1}])
def test_values_refuse_malformed_names(names):
    net = deferred_net()
    w = explore(net)
    w.handle_action({"action": "values", "names": names})
    assert w.busy == "" and w.values == {} and w.error == ""
    assert w.notice["text"]


def kinds(w) -> dict[str, str]:
    """Qualified module name -> its row's colour (the worst kind under it)."""
    names = {node: name for name, node in w._tree.index.items()}
    return {names[r[0]]: r[1] for r in w.comparison["modules"]}


def test_compare_with_a_variable_colours_rows_by_how_much_they_differ(shell):
    net = deferred_net()
    other = eager_net()
    with torch.no_grad():
        other.layers[1].mlp.weight.mul_(2)  # large
        other.layers[2].attn.weight.add_(other.layers[2].attn.weight * 1e-6)  # tiny
    shell.user_ns["tuned"] = other
    w = explore(net)
    w.compare_with("tuned")
    assert w.error == "", w.error
    got = kinds(w)
    assert (got["layers.0"], got["layers.1.mlp"], got["layers.2.attn"]) == (
        "equal",
        "large",
        "tiny",
    )
    assert got[""] == "large" and got["layers"] == "large"
    assert {tensor_state(t) for t in net.state_dict().values()} == {"deferred"}
    row = next(r for r in w.comparison["tensors"] if r[0] == "layers.1.mlp.weight")
    assert row[2:5] == ["large", "differ", 1.0]  # rel_l2 of 2x - x over x: exactly 1
    assert w.status.startswith("Compared model (the whole model) with tuned")


def compared_with_not_finite(shell):
    """A widget compared with a state dict whose ``norm.bias`` is ones (the model's is zeros:
    rel_l2 inf) and whose ``layers.1.mlp.bias`` holds a NaN (rel_l2 NaN)."""
    state = {k: v.clone() for k, v in eager_net().state_dict().items()}
    state["norm.bias"].fill_(1.0)
    state["layers.1.mlp.bias"][0] = math.nan
    state["layers.2.mlp.weight"].mul_(3)  # a finite large difference beside them
    shell.user_ns["odd"] = state
    shell.user_ns["net"] = net = deferred_net()  # the widget holds its model weakly
    w = explore(net)
    w.compare_with("odd")
    assert w.error == "", w.error
    return w


def largest_rel_l2(w) -> dict[str, object]:
    names = {node: name for name, node in w._tree.index.items()}
    return {names[r[0]]: r[3] for r in w.comparison["modules"]}


def test_compare_sends_an_infinite_rel_l2_as_inf_and_its_parents_take_it(shell):
    w = compared_with_not_finite(shell)
    assert tensor_row_of(w, "norm.bias")[2:5] == ["large", "differ", "inf"]
    assert largest_rel_l2(w)["norm"] == "inf"


def test_compare_sends_a_nan_rel_l2_as_nan_and_it_ranks_above_every_number(shell):
    w = compared_with_not_finite(shell)
    assert tensor_row_of(w, "layers.1.mlp.bias")[2:6] == ["large", "differ", "nan", "nan"]
    largest = largest_rel_l2(w)
    assert (largest["layers.1.mlp"], largest["layers"], largest[""]) == ("nan", "nan", "nan")
    assert largest["layers.2"] == pytest.approx(2.0)  # 3x - x over x


def tensor_row_of(w, name: str) -> list:
    return next(r for r in w.comparison["tensors"] if r[0] == name)


def test_compare_with_a_checkpoint_path_marks_missing_and_reshaped_tensors(tmp_path):
    from safetensors.torch import save_file

    net = deferred_net()
    state = {k: v.clone() for k, v in eager_net().state_dict().items()}
    del state["norm.bias"]
    state["layers.0.attn.bias"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    w = explore(net)
    w.compare_with(str(tmp_path / "model.safetensors"))
    assert w.error == "", w.error
    got = kinds(w)
    assert (got["norm"], got["layers.0.attn"], got["embed"]) == ("missing", "shape", "equal")


def test_compare_of_the_ticked_rows_leaves_the_rest_out(shell):
    net = deferred_net()
    shell.user_ns["same"] = eager_net()
    w = explore(net)
    w.selected = ["layers.1"]
    w.compare_with("same")
    assert sorted(r[0] for r in w.comparison["tensors"]) == [
        "layers.1.attn.bias", "layers.1.attn.weight", "layers.1.mlp.bias", "layers.1.mlp.weight",
    ]  # fmt: skip
    assert {r[2] for r in w.comparison["tensors"]} == {"equal"}


def test_compare_with_a_home_relative_directory_expands_the_tilde_as_save_does(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HOME", str(tmp_path))
    net = deferred_net()
    w = explore(net)
    w.save("~/seed")
    w.compare_with("~/seed")
    assert w.error == "", w.error
    assert w.comparison["other"] == str(tmp_path / "seed")
    assert {r[2] for r in w.comparison["tensors"]} == {"equal"}


def test_compare_with_a_dcp_directory_reads_it(tmp_path):
    net = deferred_net()
    w = explore(net)
    w.save(str(tmp_path / "dcp"), format="dcp")
    with torch.no_grad():
        net.norm.weight.mul_(2)  # recorded: the model now differs from what was saved
    w.compare_with(str(tmp_path / "dcp"))
    assert w.error == "", w.error
    assert (kinds(w)["norm"], kinds(w)["embed"]) == ("large", "equal")


def not_a_checkpoint(tmp_path, what: str) -> str:
    if what == "empty directory":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty")
    if what == "text file":
        (tmp_path / "notes.txt").write_text("hello")
        return str(tmp_path / "notes.txt")
    if what == "broken safetensors":
        (tmp_path / "model.safetensors").write_bytes(b"not a safetensors header")
        return str(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    return str(tmp_path / "model.safetensors.index.json")  # an index naming no tensor


@pytest.mark.parametrize(
    "what", ["empty directory", "text file", "broken safetensors", "empty index"]
)
def test_compare_refuses_a_path_that_holds_no_checkpoint_in_one_line(tmp_path, what):
    path = not_a_checkpoint(tmp_path, what)
    net = deferred_net()
    w = explore(net)
    w.handle_action({"action": "compare", "other": path})
    assert w.busy == "" and w.comparison == {} and w.error == ""
    text = w.notice["text"]
    assert text.startswith(f"{path} holds no checkpoint") and "\n" not in text, text
    assert text.endswith("Nothing was compared."), text


def test_compare_refuses_a_missing_path_naming_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    net = deferred_net()
    w = explore(net)
    w.handle_action({"action": "compare", "other": "~/gone/ckpt"})
    text = w.notice["text"]
    assert w.busy == "" and w.comparison == {}
    assert f"no such file or directory ({tmp_path}/gone/ckpt)" in text and "\n" not in text


def test_a_refused_compare_takes_the_earlier_comparisons_colours_off(shell, tmp_path):
    shell.user_ns["net"] = net = deferred_net()
    shell.user_ns["tuned"] = eager_net()
    w = explore(net)
    w.compare_with("tuned")
    assert w.comparison["modules"]
    w.compare_with(not_a_checkpoint(tmp_path, "broken safetensors"))
    assert "nothing was compared" in w.notice["text"].lower()
    assert w.comparison.get("modules") is None


@pytest.mark.parametrize("other", ["", "nowhere/at/all", "x" * 5000, 3, "not_a_model"])
def test_compare_refuses_what_is_neither_a_model_nor_a_path(shell, other):
    shell.user_ns["not_a_model"] = 42
    net = deferred_net()
    w = explore(net)
    w.handle_action({"action": "compare", "other": other})
    assert w.busy == "" and w.comparison == {} and w.error == ""
    assert "nothing was compared" in w.notice["text"].lower()


def test_values_of_tensors_edited_in_a_later_cell_are_cleared_saying_why(shell):
    w = measured_eager_net(shell)
    shell.run_cell("import torch\nwith torch.no_grad():\n    net.layers[1].mlp.weight[0, 0] += 0.5")
    assert w.values.get("modules") is None
    assert w.status.startswith("Values cleared: the model's tensors changed")


def measured_eager_net(shell):
    """An eager net, its widget's Values measured, cells watched: ``net`` in the notebook."""
    from jupyter_metainit.jupyter.cell_watch import watch_cells

    watch_cells(shell)
    net = eager_net()
    shell.user_ns["net"] = net
    w = explore(net)
    w.measure_values()
    assert w.values["modules"]
    return w


def test_values_of_real_tensors_unchanged_outlive_later_cells(shell):
    w = measured_eager_net(shell)
    shell.run_cell("x = net.layers[1].mlp.weight.data.clone()\ny = net.norm.weight.sum()")
    assert w.values["modules"]


def test_values_of_a_parameter_given_new_data_are_cleared(shell):
    w = measured_eager_net(shell)
    shell.run_cell("import torch\nnet.layers[1].mlp.weight.data = torch.zeros(32, 16)")
    assert w.values.get("modules") is None
    assert w.status.startswith("Values cleared: the model's tensors changed")


@pytest.mark.parametrize("write", ["copy_(torch.zeros(32, 16))", "mul_(2)", "[0, 0] = 1.5"])
def test_values_of_a_parameter_written_in_place_through_data_are_cleared(shell, write):
    w = measured_eager_net(shell)
    assign = write.startswith("[")
    shell.run_cell(f"import torch\nnet.layers[1].mlp.weight.data{'' if assign else '.'}{write}")
    assert w.values.get("modules") is None
    assert w.status.startswith("Values cleared: the model's tensors changed")


def test_a_comparison_whose_tensors_are_unchanged_outlives_later_cells(shell):
    from jupyter_metainit.jupyter.cell_watch import watch_cells

    watch_cells(shell)
    net = deferred_net()
    shell.user_ns["tuned"] = eager_net()
    w = explore(net)
    w.compare_with("tuned")
    shell.run_cell("x = 1")
    assert w.comparison["modules"]
    shell.run_cell("from jupyter_metainit import materialize\nmaterialize(tuned)")
    assert w.comparison["modules"]  # the other side is not the widget's model
    shell.user_ns["net"] = net
    shell.run_cell("materialize(net, rng='fast')")  # other values than the ones compared
    assert w.comparison.get("modules") is None
    assert w.status.startswith("Compare cleared")


def test_materialize_after_values_says_what_it_did_then_that_values_were_cleared(shell):
    net = deferred_net()
    shell.user_ns["net"] = net
    w = explore(net)
    w.measure_values()
    w.rng = "fast"  # other values than the ones measured
    w.selected = [""]
    w.materialize("cpu")
    assert w.values.get("modules") is None
    assert w.status.startswith("Materialized model")
    assert w.status.endswith(
        "Values cleared: the model's tensors changed since they were "
        "measured (materialized, freed or edited). Measure again to see the new values."
    )


def test_free_after_compare_says_what_it_did_then_that_compare_was_cleared(shell):
    net = deferred_net()
    shell.user_ns["net"] = net
    w = explore(net)
    w.selected = [""]
    w.materialize("cpu")
    shell.user_ns["tuned"] = eager_net()
    w.compare_with("tuned")
    assert w.comparison["modules"]
    w.selected = ["layers.1"]
    w.free()
    assert w.comparison.get("modules") is None
    assert w.status.startswith("Freed model.layers[1] (deferred again) in ")
    assert "Compare cleared" in w.status


def test_compare_of_a_model_transformers_renames_with_its_files_is_all_equal(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=100, tie_word_embeddings=False,
    )  # fmt: skip
    with meta_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)  # lm_head.weight is written as embed_out.weight
    w = explore(model)
    w.compare_with(str(tmp_path))
    assert w.error == "", w.error
    assert set(kinds(w).values()) == {"equal"}
    assert "lm_head.weight" in {r[0] for r in w.comparison["tensors"]}


def test_compare_of_a_ticked_row_transformers_renames_with_its_files_is_equal(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=100, tie_word_embeddings=False,
    )  # fmt: skip
    with meta_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)  # lm_head.weight is written as embed_out.weight
    w = explore(model)
    w.selected = ["lm_head"]
    w.compare_with(str(tmp_path))
    assert w.error == "", w.error
    assert [r[:4] for r in w.comparison["tensors"]] == [
        ["lm_head.weight", w._tree.index["lm_head"], "equal", "equal"]
    ]


def test_compare_of_ticked_fused_experts_with_their_split_files_colours_their_row(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, vocab_size=100,
    )  # fmt: skip
    with meta_init():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)  # the fused experts are written split, one file per expert
    w = explore(model)
    w.selected = ["model.layers.1.mlp.experts"]
    w.compare_with(str(tmp_path))
    assert w.error == "", w.error
    experts = w._tree.index["model.layers.1.mlp.experts"]
    assert len(w.comparison["tensors"]) == 12  # 4 experts x w1, w2, w3
    assert {(r[1], r[2]) for r in w.comparison["tensors"]} == {(experts, "equal")}
    assert kinds(w)["model.layers.1.mlp.experts"] == "equal"
