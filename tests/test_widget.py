"""The model tree widget's kernel side, without a browser: messages in, state out."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
import traitlets
from _models import llama70b_on_meta
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core import tensor_state
from jupyter_metainit.jupyter.row_schema import ROW
from jupyter_metainit.jupyter.widget import (
    SAVED_NOTE_STYLE,
    ModuleTreeWidget,
    explore,
    widgets_of,
)


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
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied


@pytest.fixture
def net():
    with meta_init():
        return Net()


@pytest.fixture
def watching(shell) -> None:
    """Widgets told when the shell runs a cell (a click waits for the cell's end)."""
    shell.run_cell("from jupyter_metainit.jupyter.widget import watch_cells; watch_cells()")


def rows(w: ModuleTreeWidget) -> dict[str, list]:
    """Qualified name -> row of the synced tree."""
    nodes = w.tree["nodes"]
    names: list[str] = []
    for row in nodes:
        parent, local = row[ROW["parent"]], row[ROW["name"]]
        names.append("" if parent < 0 else (local if parent == 0 else f"{names[parent]}.{local}"))
    return dict(zip(names, nodes, strict=True))


def test_tree_lists_every_module_once(net):
    w = explore(net)
    assert list(rows(w)) == [n for n, _ in net.named_modules()]


def test_tied_weights_count_once(net):
    w = explore(net)
    root = rows(w)[""]
    unique = {id(p): p for p in net.parameters()}.values()
    assert root[ROW["params"]] == sum(p.numel() for p in unique)
    assert root[ROW["bytes"]] == sum(p.numel() * p.element_size() for p in unique)


def test_deferred_model_reads_deferred(net):
    assert {
        r[ROW["state"]] for r in rows(explore(net)).values() if r[ROW["own"]] or r[ROW["params"]]
    } == {"deferred"}


def test_repeated_blocks_are_marked(net):
    r = rows(explore(net))
    assert (r["layers.0"][ROW["rep_i"]], r["layers.0"][ROW["rep_n"]]) == (0, 3)
    assert (r["layers.2"][ROW["rep_i"]], r["layers.2"][ROW["rep_n"]]) == (2, 3)


def test_selected_is_normalized(net):
    w = explore(net)
    w.selected = ["layers.1.mlp", "layers.1", "norm"]
    assert w.selected == ["layers.1", "norm"]
    w.selected = ["layers.0", "layers.1", "layers.2"]
    assert w.selected == ["layers"]


def test_unknown_selection_is_refused(net):
    w = explore(net)
    with pytest.raises(traitlets.TraitError):
        w.selected = ["nope"]


def test_selection_totals(net):
    w = explore(net)
    w.selected = ["layers.0"]
    expected = sum(p.numel() for p in net.layers[0].parameters())
    assert w.selection["params"] == expected
    w.dtype = "bfloat16"
    assert w.selection["bytes_as"] == w.selection["bytes"] // 2


def test_materialize_message_materializes_only_the_selection(net):
    w = explore(net)
    sent = []
    w.send = sent.append  # observe the patches the page would get
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["layers.1"]})
    assert w.wait(60)
    assert w.error == ""
    assert {tensor_state(p) for p in net.layers[1].parameters()} == {"cpu"}
    assert {tensor_state(p) for p in net.layers[0].parameters()} == {"deferred"}
    r = rows(w)
    assert (r["layers.1"][ROW["state"]], r["layers"][ROW["state"]], r[""][ROW["state"]]) == (
        "cpu",
        "mixed",
        "mixed",
    )
    assert r["layers.0"][ROW["state"]] == "deferred"
    assert w.busy == ""
    assert w.progress[0] == w.progress[1] > 0
    assert "model.layers[1]" in w.status


def test_patch_holds_only_changed_rows(net):
    w = explore(net)
    sent = []
    w.send = sent.append
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["norm"]})
    w.wait(60)
    (patch,) = sent
    changed = {w.tree["nodes"][node][ROW["name"]] for node, *_ in patch["nodes"]}
    assert patch["kind"] == "patch"
    assert changed == {"norm", ""}


def test_free_message_dematerializes(net):
    w = explore(net)
    w.selected = ["norm"]
    w.materialize("cpu")
    w.free()
    assert w.error == ""
    assert {tensor_state(p) for p in net.norm.parameters()} == {"deferred"}
    assert rows(w)["norm"][ROW["state"]] == "deferred"


def test_unknown_names_are_refused_visibly(net):
    w = explore(net)
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["__import__('os')"]})
    assert w.busy == ""
    assert "not a module of this model" in w.notice["text"] and w.error == ""


def test_unknown_device_is_refused(net):
    w = explore(net)
    w.handle_action({"action": "materialize", "device": "cuda:7", "names": ["norm"]})
    assert "not a device this kernel can use" in w.notice["text"]
    assert {tensor_state(p) for p in net.norm.parameters()} == {"deferred"}


def test_unknown_action_is_refused(net):
    w = explore(net)
    w.handle_action({"action": "exec", "code": "print(1)"})
    assert "Unknown action" in w.notice["text"]


def test_cancel_leaves_the_model_as_it_was(net):
    w = explore(net)
    report = w._progress

    def click_cancel(done: int, total: int) -> None:  # Cancel arrives mid-way
        w.handle_action({"action": "cancel"})
        report(done, total)

    w._progress = click_cancel
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["layers"]})
    w.wait(60)
    assert w.status.startswith("Cancelled")
    assert w.error == ""
    assert {tensor_state(p) for p in net.layers.parameters()} == {"deferred"}
    assert rows(w)["layers"][ROW["state"]] == "deferred"


def test_error_is_shown_and_model_unchanged(net):
    w = explore(net)
    w.dtype = "float16"
    w.rng = "fast"

    def boom(done: int, total: int) -> None:
        raise MemoryError("simulated")

    w._progress = boom
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["layers.0"]})
    w.wait(60)
    assert w.error.startswith("Out of memory")
    assert "left as it was" in w.error
    assert {tensor_state(p) for p in net.layers[0].parameters()} == {"deferred"}


def test_cuda_button_reason_without_gpu(net):
    w = explore(net)
    if not torch.cuda.is_available():
        assert w.devices == []
        assert w.no_cuda_reason


def test_table_html_for_selection(net):
    w = explore(net)
    w.selected = ["layers.0"]
    w.show_table = True
    assert "<table" in w.table_html
    assert "attn" in w.table_html
    w.show_table = False
    assert w.table_html == ""


def test_first_message_is_small_for_a_70b_model():
    model = llama70b_on_meta()
    w = explore(model)
    assert len(w.tree["nodes"]) > 1000
    assert len(json.dumps(w.get_state(), default=str).encode()) <= 500_000
    assert w.tree["nodes"][0][ROW["params"]] == sum(p.numel() for p in model.parameters())


def test_not_a_module_is_refused():
    with pytest.raises(TypeError):
        explore(torch.zeros(3))


def test_plain_text_repr_summarizes_the_model():
    with meta_init():
        m = torch.nn.Sequential(torch.nn.Linear(40, 4), torch.nn.Linear(4, 2))
    assert repr(explore(m)) == "ModuleTreeWidget(Sequential: 174 params, 696 B, deferred)"


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds: the widget follows a change from a timer thread.

    ``timeout`` only keeps a broken test from hanging; it is no figure (a loaded machine is not
    a slow widget), so it is generous."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_follows_a_materialization_made_in_code(net):
    w = explore(net)
    materialize(net.layers[1])
    assert wait_until(lambda: rows(w)["layers.1"][ROW["state"]] == "cpu")
    assert rows(w)["layers"][ROW["state"]] == "mixed"


def test_follows_a_dematerialization_and_another_widget(net):
    w1, w2 = explore(net), explore(net)
    w1.selected = ["norm"]
    w1.materialize("cpu")
    assert wait_until(lambda: rows(w2)["norm"][ROW["state"]] == "cpu")
    w1.free()
    assert wait_until(lambda: rows(w2)["norm"][ROW["state"]] == "deferred")


def test_widgets_of_finds_the_widgets_showing_a_model(net):
    w = explore(net)
    assert w in widgets_of(net) and w in widgets_of(net.layers[0])
    w.close()
    assert w not in widgets_of(net)


def test_progress_total_is_the_selection_in_its_dtype_and_never_changes(net):
    w = explore(net)
    w.dtype = "bfloat16"
    w.selected = ["layers"]
    seen = []
    w.observe(lambda change: seen.append(list(change["new"])), "progress")
    w.materialize("cpu")
    totals = {total for _, total in seen if total}
    assert totals == {w.selection["bytes_as"]}  # known from the first report, in bf16
    done = [d for d, _ in seen]
    assert done == sorted(done)  # never decreases
    assert seen[-1][0] == seen[-1][1]


def test_a_refused_click_is_a_notice_and_the_action_message_stays(net):
    w = explore(net)
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["layers"]})
    w.handle_action({"action": "free", "names": ["layers"]})  # a second click while busy
    w.wait(60)
    assert "Still busy" in w.notice["text"]
    assert w.error == "" and w.status.startswith("Materialized model.layers on cpu")


def test_materializing_again_as_another_dtype_casts_in_place(net):
    w = explore(net)
    w.selected = ["layers.0"]
    w.materialize("cpu")
    weight = net.layers[0].attn.weight
    w.dtype = "bfloat16"
    w.materialize("cpu")
    assert net.layers[0].attn.weight is weight and weight.dtype == torch.bfloat16
    assert rows(w)["layers.0"][ROW["dtype"]] == "bf16" and "as bfloat16" in w.status


def test_the_page_cannot_write_kernel_owned_traits(net):
    w = explore(net)
    w.set_state({"busy": "materialize cpu", "devices": [{"name": "cuda:9", "label": "x"}]})
    assert w.busy == "" and "cuda:9" not in [d["name"] for d in w.devices]
    assert "kernel owns it" in w.notice["text"]
    w.set_state({"selected": ["no.such.module"]})
    assert w.selected == [] and "not a module of this model" in w.notice["text"]


def test_a_malformed_device_is_refused_visibly(net):
    w = explore(net)
    w.handle_action({"action": "materialize", "device": {"type": "cuda"}, "names": ["norm"]})
    assert "not a device" in w.notice["text"] and w.busy == ""
    w.handle_action(["not", "a", "dict"])
    assert "malformed" in w.notice["text"]


def test_tied_tensors_are_named_and_shares_add_up(net):
    w = explore(net)
    r = rows(w)
    index = {name: i for i, name in enumerate(r)}
    assert r["embed"][ROW["tied"]] == [index["head"]] and r["head"][ROW["tied"]] == [index["embed"]]
    kids = [r[name][ROW["share_bytes"]] for name in ("embed", "layers", "norm", "head")]
    assert (
        sum(kids) == r[""][ROW["share_bytes"]] == r[""][ROW["bytes"]]
    )  # the tied weight is attributed once
    w.selected = ["embed"]
    assert w.selection["also"] == ["head"]


def test_rows_show_dtype_and_the_target_device_of_deferred_parts():
    with meta_init(device="cuda"):
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    r = rows(explore(m))
    assert (
        r["0"][ROW["dtype"]] == "fp32"
        and r["1"][ROW["dtype"]] == "bf16"
        and r[""][ROW["dtype"]] == "mixed"
    )
    assert r[""][ROW["state"]] == "deferred" and r[""][ROW["target"]] == "cuda:0"


def test_table_is_compact_unless_asked_for_in_full(net):
    w = explore(net)
    w.show_table = True
    assert "train_fp32" not in w.table_html and "params" in w.table_html
    w.table_full = True
    assert "train" in w.table_html


def test_rows_say_which_parts_come_from_a_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    save_file({"weight": torch.randn(4, 4)}, str(tmp_path / "w.safetensors"))
    with meta_init():
        m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
        m[0].weight = nn.Parameter(load_file(str(tmp_path / "w.safetensors"))["weight"])
    r = rows(explore(m))
    assert (
        r["0"][ROW["source"]] == "checkpoint"
        and r["1"][ROW["source"]] == ""
        and r[""][ROW["source"]] == "mixed"
    )


def test_tensor_attributes_count_in_the_tree_once_and_views_of_weights_not_at_all():
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False)  # 64 bytes
            self.lin.w_t = self.lin.weight.t()  # a view of the weight: nothing
            self.tables = {"k": torch.zeros(1000, 1000), "rows": [torch.ones(25)]}
            self.k_again = self.tables["k"]

    with meta_init():
        m = Cached()
    root = rows(explore(m))[""]
    assert root[ROW["params"]] == 16 and root[ROW["bytes"]] == 64 + 4_000_000 + 100


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_materialize_by_default_targets_the_recorded_device_and_refuses_a_missing_one():
    with meta_init(device="cuda:1"):
        lin = nn.Sequential(nn.Linear(2, 2))
    w = explore(lin)
    w.selected = ["0"]
    w.materialize()
    assert "recorded for cuda:1" in w.error and "device='cpu'" in w.error
    assert is_deferred(lin)
    w.materialize("cpu")
    assert w.error == "" and not is_deferred(lin)


# ---------------------------------------------------------------------------- memory


@pytest.mark.parametrize("file_watch", ["1", "0"], ids=["file-watch-on", "file-watch-off"])
def test_a_closed_widget_keeps_neither_itself_nor_its_model_alive(file_watch, monkeypatch):
    import gc
    import weakref

    monkeypatch.setenv("ANYWIDGET_HMR", file_watch)

    # anywidget reads the file-watch setting when a widget class is made
    class Watched(ModuleTreeWidget):
        _esm = ModuleTreeWidget._esm
        _css = ModuleTreeWidget._css

    with meta_init():
        model = Net()
    w = Watched(model)
    w.selected = ["norm"]
    w.materialize("cpu")
    model_ref, widget_ref = weakref.ref(model), weakref.ref(w)
    w.close()
    del w, model
    gc.collect()
    assert widget_ref() is None
    assert model_ref() is None


def test_an_open_widget_whose_output_was_replaced_does_not_keep_its_model_alive():
    import gc
    import weakref

    # re-running a %%meta_init cell: the old widget stays open in ipywidgets' registry
    # (nothing closes it), the name now holds a new model
    with meta_init():
        model = Net()
    old = explore(model)
    model_ref = weakref.ref(model)
    with meta_init():
        model = Net()
    explore(model)
    gc.collect()
    assert model_ref() is None
    assert "model gone" in repr(old)


def test_a_widget_whose_model_is_gone_says_so_and_does_nothing():
    import gc

    with meta_init():
        model = Net()
    w = explore(model)
    w.selected = ["norm"]
    del model
    gc.collect()
    w.materialize("cpu")
    assert "is gone" in w.error and "explore(model)" in w.error
    assert w.busy == ""
    w.refresh()
    assert "is gone" in w.error


def test_a_kernel_that_exits_does_not_tell_its_widgets_their_model_was_freed():
    # IPython empties the namespace at exit, freeing every model: that is the kernel going,
    # which the page says itself, not "no name refers to it any more".
    script = """
import atexit, builtins
atexit.register(lambda: print("model_gone", builtins.w.model_gone))  # runs last
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("import builtins\\nfrom torch import nn\\n"
               "from jupyter_metainit.jupyter.widget import explore\\n"
               "m = nn.Linear(2, 2)\\nbuiltins.w = explore(m)")
"""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "model_gone False" in out.stdout, out.stdout + out.stderr


def test_a_widget_turns_its_actions_off_as_soon_as_its_model_is_freed():
    # the page greys every action on `model_gone` (as when the kernel is gone): a second click
    # must not clear the message and do nothing
    with meta_init():
        model = Net()
    w = explore(model)
    del model
    gc.collect()
    assert w.model_gone and "is gone" in w.error


@pytest.mark.parametrize("change", ["delete", "replace", "add"])
def test_a_module_changed_under_the_tree_turns_the_actions_off_and_says_which(change):
    with meta_init():
        model = Net()
    w = explore(model)
    if change == "delete":
        del model.layers[0]
    elif change == "replace":
        model.norm = nn.LayerNorm(16)
    else:
        model.extra = nn.Linear(2, 2)
    w.materialize("cpu")  # whole model: never "busy" for good
    assert w.busy == "" and w.model_gone and "changed since this tree was drawn" in w.error
    assert is_deferred(model.embed.weight) and is_deferred(model.layers[-1])  # nothing was done


@pytest.mark.usefixtures("watching")
def test_a_cell_that_deletes_a_module_turns_the_actions_off_when_it_ends(shell):
    with meta_init():
        model = Net()
    shell.user_ns["model"] = model
    w = explore(model)
    assert shell.run_cell("del model.layers[1]").success
    assert w.model_gone and "(`model.layers[1]` was added, removed or replaced)" in w.error


def test_an_action_that_fails_unexpectedly_leaves_the_widget_idle_and_says_so(net):
    w = explore(net)
    w._actions.launch("save", lambda: 1 / 0, ())
    assert w.wait(10)
    assert w.busy == "" and "ZeroDivisionError" in w.error


# ---------------------------------------------------------------------------- fast values


def test_rows_mark_parts_holding_fast_rng_values(net):
    w = explore(net)
    w.selected = ["layers.0"]
    w.rng = "fast"
    w.materialize("cpu")
    assert rows(w)["layers.0"][ROW["values"]] == "fast"
    assert rows(w)["layers"][ROW["values"]] == "fast"  # every real tensor under it is fast
    assert rows(w)["layers.1"][ROW["values"]] == ""


def test_a_fast_materialize_says_in_its_message_that_values_are_not_eagers(net):
    w = explore(net)
    w.selected = ["layers.0"]
    w.rng = "fast"
    w.materialize("cpu")
    assert "with RNG fast" in w.status and "not those eager code gives" in w.status


def test_the_message_names_the_tied_modules_an_action_changed_too(net):
    w = explore(net)
    w.selected = ["embed"]
    w.materialize("cpu")
    assert "Tied to it, so changed too: model.head." in w.status
    w.free()
    assert "Tied to it, so changed too: model.head." in w.status


def test_an_exact_materialize_regenerates_fast_values_exactly_and_says_so():
    torch.manual_seed(0)
    eager = Net()
    torch.manual_seed(0)
    with meta_init():
        model = Net()
    w = explore(model)
    w.selected = ["layers.0"]
    w.rng = "fast"
    w.materialize("cpu")
    assert not torch.equal(model.layers[0].attn.weight, eager.layers[0].attn.weight)
    w.selected = ["layers"]
    w.rng = "exact"
    w.materialize("cpu")
    assert w.error == ""
    assert "Re-generated" in w.status and "exact" in w.status
    for name, p in model.layers.named_parameters():
        assert torch.equal(p, dict(eager.layers.named_parameters())[name]), name
    assert rows(w)["layers.0"][ROW["values"]] == ""


def test_materialize_from_code_then_free_says_one_thing():
    with meta_init():
        model = Net()
    w = explore(model)
    w.selected = ["norm"]
    materialize(model.norm)  # no keep_cache: cannot be freed, and nothing else changes
    w.free()
    assert "Nothing was changed" in w.error
    assert "changed state" not in w.error


# ---------------------------------------------------------------------------- fits


def test_selection_summary_says_whether_it_fits_the_cpu():
    from jupyter_metainit.estimates.fit import device_budget

    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(1_000_000, 1_000_000, bias=False))
    w = explore(model)
    w.selected = ["0"]
    assert w.selection["fit"]["cpu"]["fits"] is True
    w.selected = ["1"]  # 4 TB in float32
    fit = w.selection["fit"]["cpu"]
    assert fit["fits"] is False and fit["need"] == 4 * 10**12
    assert abs(fit["free"] - device_budget("cpu")) < 2**30


def test_the_kernel_refuses_a_materialize_from_code_that_cannot_fit_in_the_pages_words():
    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(1_000_000, 1_000_000, bias=False))
    w = explore(model)
    w.selected = ["1"]  # 4 TB in float32
    page_says = w.selection["fit"]["cpu"]["why"]
    w.materialize("cpu")
    assert is_deferred(model[1]) and w.busy == "" and w.error == "" and w.status == ""
    assert w.notice["text"] == page_says
    assert page_says.startswith("Does not fit: the selection needs 3.64 TiB, ")
    assert page_says.endswith(" on cpu. Select less, pick a smaller dtype or free something first.")


def test_the_kernel_refuses_a_page_message_for_a_part_too_big_even_when_it_is_not_ticked():
    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(1_000_000, 1_000_000, bias=False))
    w = explore(model)
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["1"]})
    assert is_deferred(model[1]) and w.busy == ""
    assert w.notice["text"].startswith("Does not fit: the selection needs 3.64 TiB")
    w.selected = ["1"]
    w.notice = {"id": 0, "text": ""}
    w.materialize()  # each tensor's recorded device (the CPU here): refused the same way
    assert is_deferred(model[1]) and w.notice["text"].startswith("Does not fit")


def test_the_fit_counts_the_chosen_dtype_and_what_is_already_there():
    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    w = explore(model)
    w.selected = [""]
    w.dtype = "bfloat16"
    assert w.selection["fit"]["cpu"]["need"] == 2 * (64 + 8) * 2
    w.selected = ["0"]
    w.materialize("cpu")
    w.selected = [""]
    assert w.selection["fit"]["cpu"]["need"] == 2 * (64 + 8)


def test_the_saved_output_says_what_it_was_and_how_to_get_a_live_tree(net):
    data, _metadata = explore(net)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    for mime in ("text/plain", "text/html"):
        assert "Net: 3.28 K params" in data[mime], mime
        assert "Run the cell again" in data[mime], mime


@pytest.mark.parametrize("state", [None, ["selected"], "selected", 3])
def test_a_page_update_with_a_malformed_state_is_a_notice(net, state):
    w = explore(net)
    w._handle_msg({"content": {"data": {"method": "update", "state": state}}, "buffers": []})
    assert "malformed" in w.notice["text"]
    assert w.selected == []


def test_a_page_update_of_an_unknown_trait_is_a_notice(net):
    w = explore(net)
    w._handle_msg(
        {"content": {"data": {"method": "update", "state": {"no_such": 1}}}, "buffers": []}
    )
    assert "no such trait" in w.notice["text"]


# ---------------------------------------------------------------------------- smaller points


def test_a_change_made_elsewhere_clears_the_last_message(net):
    from jupyter_metainit import dematerialize

    w = explore(net)
    w.selected = ["norm"]
    w.materialize("cpu")
    assert w.status.startswith("Materialized")
    dematerialize(net.norm)  # as %dematerialize in a later cell
    assert wait_until(lambda: w.status == "")


def test_the_table_says_which_module_it_shows(net):
    w = explore(net, name="net")
    w.show_table = True
    assert "Memory table of net (whole model)" in w.table_html
    w.selected = ["layers.1"]
    assert "Memory table of net.layers[1]" in w.table_html


@pytest.mark.usefixtures("watching")
def test_a_click_that_frees_waits_for_the_running_cell_to_end(shell):
    with meta_init():
        net = Net()
    shell.user_ns["w"] = w = explore(net)
    w.selected = ["norm"]
    w.materialize("cpu")
    # the page's Free arrives on another thread while a cell uses the weights
    cell = (
        "import threading\n"
        "from jupyter_metainit.core import tensor_state\n"
        "msg = {'action': 'free', 'names': ['norm'], 'id': 1}\n"
        "t = threading.Thread(target=w._on_msg, args=(w, msg, []))\n"
        "t.start(); t.join()\n"
        "during = {tensor_state(p) for p in w.module.norm.parameters()}\n"
        "phase = w.phase"
    )
    assert shell.run_cell(cell).success
    assert shell.user_ns["during"] == {"cpu"}
    assert "running cell" in shell.user_ns["phase"]
    assert w.wait(60)
    assert {tensor_state(p) for p in net.norm.parameters()} == {"deferred"}
    assert w.busy == "" and "Freed model.norm" in w.status


@pytest.mark.usefixtures("watching")
def test_cancel_drops_a_click_that_waits_for_the_running_cell(shell):
    with meta_init():
        net = Net()
    shell.user_ns["w"] = w = explore(net)
    w.selected = ["norm"]
    cell = (
        "w._on_msg(w, {'action': 'materialize', 'device': 'cpu', 'names': ['norm'], 'id': 1}, [])\n"
        "queued = w.busy\n"
        "w._on_msg(w, {'action': 'cancel', 'id': 2}, [])"
    )
    assert shell.run_cell(cell).success
    assert shell.user_ns["queued"] == "materialize cpu"
    assert w.wait(60)
    assert w.busy == "" and "Cancelled before it ran" in w.status
    assert {tensor_state(p) for p in net.norm.parameters()} == {"deferred"}


def test_a_sliced_tensor_attribute_counts_its_whole_storage_in_the_tree_as_in_the_table():
    from jupyter_metainit.estimates import memory_table

    class Sliced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False)  # 64 bytes
            self.part = torch.zeros(1000)[:10]  # keeps all 4000 bytes alive

    model = Sliced()
    root = rows(explore(model))[""]
    assert root[ROW["bytes"]] == 64 + 4000 == memory_table(model).loc["", "total_bytes"]


# ---------------------------------------------------------------- plan and save (issues 23, 24)
class LM(nn.Module):
    """A tiny language model: token ids in, logits out (what place() plans a workload for)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = x + block.mlp(torch.relu(block.attn(x)))[..., :16]
        return self.head(self.norm(x))


def _lm() -> LM:
    torch.manual_seed(0)
    with meta_init():
        return LM()


TWO_GPUS = "cuda:0=24KiB, cuda:1=24KiB"  # planned, not used: planning allocates nothing


def test_a_plan_gives_each_row_its_device_and_each_device_its_peak_against_capacity():
    model = _lm()  # the widget holds its model weakly
    w = explore(model)
    w.place(TWO_GPUS, batch=2, seq_len=8)
    assert w.error == "" and w.status.startswith("Planned in")
    assert [d["name"] for d in w.plan["devices"]] == ["cuda:0", "cuda:1"]
    assert all(0 < d["peak"] <= d["capacity"] == 24 * 1024 for d in w.plan["devices"])
    where = dict(zip(rows(w), w.plan["nodes"], strict=True))
    assert where["embed"] == 0 and where["head"] == 1
    assert where[""] == -2  # the whole model spans both devices


def test_a_plan_that_does_not_fit_marks_the_devices_over_capacity_and_says_what_would_fit():
    model = _lm()  # the widget holds its model weakly
    w = explore(model)
    w.place("cuda:0=4KiB, cuda:1=4KiB", batch=2, seq_len=8)
    assert not w.plan["fits"] and "does not fit" in w.plan["headline"]
    assert [d["fits"] for d in w.plan["devices"]] == [False, False]
    assert w.status == "" and "does NOT fit" in w.error and "under the plan bar" in w.error
    assert any("offloading to host memory fits" in a for a in w.plan["advice"])


def test_a_plan_without_devices_is_a_notice_and_plans_nothing():
    model = _lm()  # the widget holds its model weakly
    w = explore(model)
    w.place("  ", seq_len=8)
    assert "Type the devices" in w.notice["text"]
    assert w.plan == {} and w.busy == ""


def test_pinning_the_selected_part_plans_the_rest_around_it():
    model = _lm()  # the widget holds its model weakly
    w = explore(model)
    w.place(TWO_GPUS, batch=2, seq_len=8)
    w.selected = ["head"]
    w.pin("cuda:0")
    assert w.error == ""
    assert w.plan["pins"] == {"head": "cuda:0"}
    assert w.plan["device_map"]["head"] == "cuda:0"
    assert dict(zip(rows(w), w.plan["nodes"], strict=True))["head"] == 0


def test_materialize_plan_puts_every_part_on_its_device_with_eagers_values():
    torch.manual_seed(0)
    eager = LM()
    model = _lm()
    w = explore(model)
    w.place("cpu=1GiB", batch=2, seq_len=8)
    w.materialize_plan()
    assert w.error == "" and "Materialized the plan" in w.status
    assert w.progress[0] == w.progress[1] > 0  # one progress total, reached
    for name, value in eager.state_dict().items():
        got = model.state_dict()[name]
        assert tensor_state(got) == "cpu" and torch.equal(got, value), name


def test_the_plans_precision_is_its_own_control_and_materialize_plan_follows_it():
    torch.manual_seed(0)
    eager = LM().to(torch.bfloat16)
    model = _lm()  # float32
    w = explore(model)
    w.place("cpu=1GiB", batch=2, seq_len=8)
    as_built = w.plan["devices"][0]["peak"]
    w.place("cpu=1GiB", batch=2, seq_len=8, precision="bf16")
    assert w.error == "" and w.plan["request"]["precision"] == "bf16"
    assert w.plan["devices"][0]["peak"] < as_built  # two bytes a weight, not four
    w.materialize_plan()
    assert "as bfloat16 (the plan's precision)" in w.status, w.status
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_precision_the_plan_bar_does_not_offer_is_refused_with_the_choices():
    model = _lm()
    w = explore(model)
    w.place("cpu=1GiB", seq_len=8, precision="int3")
    assert w.notice["text"] == (
        "Refused: Precision must be as built, bf16, fp32 or bf16-mixed, not 'int3'."
    )
    assert w.plan == {}


class Bf16OnlyKernel(nn.Module):
    """A layer whose kernel takes bfloat16 only, as torch._grouped_mm's meta kernel (MoE
    experts) does: its error words are that kernel's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(
            x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16,
            lambda: (
                f"Expected inputs of BF16 type but got mat_a.dtype={x.dtype} and "
                f"mat_b.dtype={self.weight.dtype}."
            ),
        )
        return x @ self.weight


def test_a_plan_stopped_by_a_bf16_only_kernel_says_why_and_what_to_do_in_words():
    with meta_init():
        model = nn.Sequential(Bf16OnlyKernel())
    w = explore(model)
    w.place("cpu=1GiB", inputs="(2, 8)", training=True)
    assert w.error.startswith(
        "Could not plan: the dry run of the workload reached a kernel of this model that takes "
        "only bfloat16 inputs (MoE experts' grouped matmul is one), and the model is float32"
    ), w.error
    assert "Build the model in bfloat16 (%%meta_init --dtype bfloat16)" in w.error
    assert "(the kernel said: Expected inputs of BF16 type but got mat_a.dtype" in w.error


def test_materialize_plan_refuses_a_device_this_kernel_lacks_and_changes_nothing():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this kernel has the planned devices")
    model = _lm()
    w = explore(model)
    w.place(TWO_GPUS, batch=2, seq_len=8)
    w.materialize_plan()
    assert "cannot use" in w.notice["text"]
    assert all(is_deferred(t) for t in model.state_dict().values())


def test_save_writes_the_selected_subtree_and_says_what_was_written(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    eager = LM()
    model = _lm()
    w = explore(model)
    w.selected = ["layers.1"]
    w.save(str(tmp_path / "block"))
    assert w.error == "" and "model.safetensors" in w.status and "layers[1]" in w.status
    saved = load_file(tmp_path / "block" / "model.safetensors")
    assert saved.keys() == eager.layers[1].state_dict().keys()
    for name, value in eager.layers[1].state_dict().items():
        assert torch.equal(saved[name], value), name
    assert all(is_deferred(t) for t in model.state_dict().values())  # saving changes nothing


def test_save_over_a_checkpoint_asks_first_and_replaces_it_when_asked_again(tmp_path):
    from safetensors.torch import load_file

    model = _lm()
    w = explore(model)
    w.save(str(tmp_path))
    (tmp_path / "notes.txt").write_text("mine")
    before = (tmp_path / "model.safetensors").read_bytes()
    w.dtype = "bfloat16"
    w.save(str(tmp_path))
    assert "already holds a checkpoint" in w.notice["text"] and "Save again" in w.notice["text"]
    assert (tmp_path / "model.safetensors").read_bytes() == before
    w.save(str(tmp_path))
    assert w.error == "" and "notes.txt" not in w.status  # it names what it wrote
    saved = load_file(tmp_path / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_save_says_when_parts_hold_fast_values(tmp_path):
    model = _lm()
    w = explore(model)
    w.selected, w.rng = ["layers.1"], "fast"
    w.materialize("cpu")
    w.selected, w.rng = [], "exact"
    w.save(str(tmp_path))
    assert w.error == "" and "hold RNG fast values (not eager's)" in w.status


def test_save_to_a_path_it_cannot_write_says_so_in_the_users_words(tmp_path):
    (tmp_path / "a_file").write_text("")
    model = _lm()
    w = explore(model)
    w.save(str(tmp_path / "a_file" / "ckpt"))
    assert w.error.startswith(f"Could not save: cannot write to {tmp_path / 'a_file' / 'ckpt'}")
    assert ".saving" not in w.error
    assert "Nothing was written. The model was left as it was." in w.error


def test_save_refuses_an_empty_path_with_a_notice():
    model = _lm()  # the widget holds its model weakly
    w = explore(model)
    w.save("")
    assert "Type the directory to save to" in w.notice["text"] and w.status == ""


class _OwnAndChild(nn.Module):
    """A module with a tensor of its own next to a child: a plan may part them."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(64, 64))
        self.c = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x) + self.p.sum()


def test_a_module_whose_own_tensor_goes_elsewhere_shows_several_devices():
    with meta_init():
        model = nn.Sequential(_OwnAndChild(), nn.Linear(64, 4))
    w = explore(model)
    w.place("cuda:0=20KiB, cuda:1=40KiB", inputs="(2, 64)")
    assert w.plan["device_map"]["0.p"] == "cuda:0" and w.plan["device_map"]["0.c"] == "cuda:1"
    where = dict(zip(rows(w), w.plan["nodes"], strict=True))
    assert where["0"] == -2 and where["0.c"] == 1


def test_a_tied_part_shows_the_device_of_the_tensor_it_shares():
    model = _lm()
    model.head.weight = model.embed.weight
    w = explore(model)
    w.place(TWO_GPUS, batch=2, seq_len=8)
    where = dict(zip(rows(w), w.plan["nodes"], strict=True))
    assert where["head"] == where["embed"] == 0


def test_a_model_that_takes_images_is_planned_from_the_inputs_shapes():
    with meta_init():
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(4))
    model(torch.zeros(1, 3, 10, 10, device="meta"))  # the lazy layer learns its size
    w = explore(model)
    w.place("cpu=1GiB", inputs="(2, 3, 10, 10)")
    assert w.error == "" and w.status.startswith("Planned in")
    assert w.plan["request"]["inputs"] == [(2, 3, 10, 10)] and w.plan["fits"]


def test_inputs_that_are_not_shapes_are_refused_with_an_example():
    model = _lm()  # the widget holds its model weakly
    w = explore(model)
    w.place("cpu=1GiB", inputs="224x224")
    assert "Inputs must be shapes" in w.notice["text"] and "(8, 3, 224, 224)" in w.notice["text"]


def test_a_plan_place_refuses_says_why_and_keeps_the_last_plan():
    model = _lm()
    w = explore(model)
    w.place(TWO_GPUS, batch=2, seq_len=8)
    before = w.plan
    w.place(TWO_GPUS, batch=2, seq_len=None)  # the bar's Seq len left empty
    assert "Enter a Seq len" in w.notice["text"] and "Inputs" in w.notice["text"]
    assert w.plan == before and w.busy == ""


@pytest.mark.usefixtures("watching")
def test_a_plan_click_waits_for_the_running_cell_to_end(shell):
    model = _lm()
    shell.user_ns["w"] = w = explore(model)
    cell = (
        "msg = {'action': 'plan', 'devices': 'cpu=1GiB', 'batch': 2, 'seq_len': 8, 'id': 1}\n"
        "w._on_msg(w, msg, [])\n"
        "during = (w.busy, w.phase, w.plan)"
    )
    assert shell.run_cell(cell).success
    busy, phase, plan = shell.user_ns["during"]
    assert busy == "plan" and "running cell" in phase and plan == {}
    assert w.wait(60)
    assert w.error == "" and [d["name"] for d in w.plan["devices"]] == ["cpu"]


def test_displaying_the_widget_puts_a_note_in_words_before_the_live_tree(net, shell):
    from IPython.utils.capture import capture_output

    w = explore(net)
    with capture_output() as out:
        w._ipython_display_()
    note, tree = (o.data for o in out.outputs)
    assert "Net: 3.28 K params" in note["text/html"] and "Run the cell again" in note["text/html"]
    assert "application/vnd.jupyter.widget-view+json" not in note
    assert tree["application/vnd.jupyter.widget-view+json"]["model_id"] == w.model_id
    # its own rules: the note or the tree, never "model not found" (tests/test_widget_browser.py)
    assert note["text/html"].startswith(f"<style>{SAVED_NOTE_STYLE}</style>")


def test_a_cancelled_save_leaves_nothing_at_the_path(tmp_path):
    with meta_init():
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])  # 128 MiB to write
    w = explore(model)
    path = tmp_path / "ckpt"
    w.save(str(path), wait=False)
    w.handle_action({"action": "cancel"})
    assert w.wait(120)
    assert w.status.startswith("Cancelled") and "nothing was written" in w.status
    assert not path.exists() and list(tmp_path.iterdir()) == []
