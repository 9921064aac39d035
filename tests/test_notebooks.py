"""The notebooks in ``notebooks/``: stored cleared, and run top to bottom on a real kernel.

Each notebook is executed once per test module by ``nbclient`` on the ``python3`` kernel of
this environment (the venv's ipykernel; the set-up installs it with
``python -m ipykernel install --sys-prefix``), then the tests read the outputs that matter.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["quickstart", "lazy_modules", "custom_modules", "checkpoints", "values"]
CELL_TIMEOUT_S = 300
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def execute(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    return notebook


def load(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


def cell_with(notebook: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    (cell,) = [c for c in notebook.cells if c.cell_type == "code" and source in c.source]
    return cell


def text(cell: nbformat.NotebookNode) -> str:
    """Everything a cell printed or displayed as plain text, without colour codes."""
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            parts.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            parts.append("\n".join(output.traceback))
    return _ANSI.sub("", "\n".join(parts))


def mimes(cell: nbformat.NotebookNode) -> list[str]:
    return [m for o in cell.outputs if "data" in o for m in o.data]


@pytest.fixture(scope="module")
def quickstart():
    return execute(load("quickstart"))


@pytest.fixture(scope="module")
def lazy_modules():
    return execute(load("lazy_modules"))


@pytest.fixture(scope="module")
def custom_modules():
    return execute(load("custom_modules"))


@pytest.fixture(scope="module")
def checkpoints():
    return execute(load("checkpoints"))


@pytest.fixture(scope="module")
def values():
    return execute(load("values"))


# --------------------------------------------------------------------------- stored form


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_with_outputs_cleared(name):
    notebook = load(name)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert "widgets" not in notebook.metadata
    assert notebook.metadata.kernelspec.name == "python3"


def test_kernel_is_this_environment():
    notebook = new_notebook(cells=[new_code_cell("import sys\nprint(sys.prefix)")])
    execute(notebook)
    assert text(notebook.cells[0]).strip() == sys.prefix


# --------------------------------------------------------------------------- quickstart


def test_quickstart_builds_70b_deferred_and_shows_the_tree(quickstart):
    cell = cell_with(quickstart, "%%meta_init")
    assert "model: LlamaForCausalLM, 70.6 B parameters, 131 GiB, deferred\n" in text(cell)
    assert WIDGET_MIME in mimes(cell)


def test_quickstart_shows_the_memory_table(quickstart):
    cell = cell_with(quickstart, "%meta_table model --depth 2")
    assert "<table" in next(o.data["text/html"] for o in cell.outputs if "data" in o)


def test_quickstart_materializes_one_layer(quickstart):
    out = text(cell_with(quickstart, "%materialize model.model.layers[0]"))
    assert "materialized model.model.layers[0]: LlamaDecoderLayer, 856 M parameters" in out
    assert ", cpu in " in out


def test_quickstart_runs_the_layer_on_a_real_input(quickstart):
    out = text(cell_with(quickstart, "out = layer(hidden"))
    assert "output: (1, 8, 8192) torch.bfloat16 cpu" in out


def test_quickstart_dematerializes_the_layer(quickstart):
    out = text(cell_with(quickstart, "%dematerialize model.model.layers[0]"))
    assert "dematerialized model.model.layers[0]" in out and "deferred" in out
    assert "all 80 layers deferred again" in text(cell_with(quickstart, "is_deferred(m)"))


# --------------------------------------------------------------------------- lazy modules


def test_lazy_dry_run_infers_shapes(lazy_modules):
    out = text(cell_with(lazy_modules, "print(net.head[0])"))
    assert "in_features=1024, out_features=256" in out


def test_lazy_table_shows_output_shapes(lazy_modules):
    cell = cell_with(lazy_modules, "%meta_table net")
    html = next(o.data["text/html"] for o in cell.outputs if "data" in o)
    assert "output" in html and "<table" in html


def test_lazy_materialize_equals_eager(lazy_modules):
    out = text(cell_with(lazy_modules, "%materialize net"))
    assert "weights identical: True | outputs identical: True" in out


# --------------------------------------------------------------------------- custom modules


def test_custom_meta_init_equals_eager(custom_modules):
    out = text(cell_with(custom_modules, "%materialize net"))
    assert re.search(r"(\d+)/\1 tensors identical to eager", out)


def test_custom_meta_device_loses_the_init(custom_modules):
    out = text(cell_with(custom_modules, "on_meta.to_empty"))
    match = re.search(r"(\d+)/(\d+) tensors identical to eager", out)
    assert match and match[1] != match[2]


def test_custom_torch_skip_init_needs_a_device_argument(custom_modules):
    out = text(cell_with(custom_modules, "torch.nn.utils.skip_init(Net)"))
    assert "torch.nn.utils.skip_init:" in out and "device" in out


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_opens_deferred_under_meta_init(checkpoints):
    cell = cell_with(checkpoints, "%%meta_init")
    assert "model: LlamaForCausalLM, 4.82 M parameters, 18.4 MiB, deferred" in text(cell)
    assert WIDGET_MIME in mimes(cell)
    table = text(cell_with(checkpoints, 'table[["type"'))
    assert "checkpoint" in table and "mixed" in table


def test_checkpoint_layer_materializes_from_the_files_and_runs(checkpoints):
    out = text(cell_with(checkpoints, "same weights as an eager"))
    assert "same weights as an eager from_pretrained: True" in out
    assert "model.layers.1  deferred  checkpoint" in out and "model.layers.2       cpu" in out
    assert "equal to eager: True" in text(cell_with(checkpoints, "%materialize model.model.rotary"))


def test_checkpoint_layer_is_freed_again(checkpoints):
    out = text(cell_with(checkpoints, "%dematerialize model.model.layers[2]"))
    assert "dematerialized model.model.layers[2]" in out


# --------------------------------------------------------------------------- values


def test_values_finds_gpt2_depth_scaled_and_llama_not_at_every_layer(values):
    out = text(cell_with(values, "expected = 0.02 / math.sqrt(2 * depth)"))
    assert "0.02 / sqrt(2 x 48) = 0.00204" in out
    for name in ("GPT-2 attn.c_proj", "GPT-2 mlp.c_proj"):
        assert re.search(rf"{name} +std 0\.0020\d to 0\.0020\d in 48 layers: depth-scaled", out)
    for name in ("Llama o_proj", "Llama down_proj"):
        assert re.search(rf"{name} +std 0\.0\d+ to 0\.0\d+ in 48 layers: not depth-scaled", out)
    assert "still deferred: True" in out


def test_values_draws_the_std_along_the_depth(values):
    cell = cell_with(values, 'title="std of the residual projections')
    svg = next(o.data["image/svg+xml"] for o in cell.outputs if "data" in o)
    assert svg.count("<polyline") == 5 and "Llama down_proj" in svg


def test_values_fine_tune_leaves_the_frozen_blocks_equal_and_moves_the_rest(values):
    out = text(cell_with(values, "diff = compare("))
    assert re.search(r"equal +38", out) and re.search(r"differ +38", out)
    moved = text(cell_with(values, "moved = {"))
    assert re.search(r"mlp\.c_proj +0\.0000 0\.0000 0\.0000 0\.[1-9]", moved)
    assert "image/svg+xml" in mimes(cell_with(values, "moved = {"))


# --------------------------------------------------------------------------- failing cell


def test_failing_meta_init_cell_stops_the_run_with_one_traceback():
    notebook = new_notebook(
        cells=[
            new_code_cell("%load_ext jupyter_metainit\nimport torch"),
            new_code_cell("%%meta_init\nm = torch.nn.Linear(2, 2)\n\nboom = 1 / 0"),
            new_code_cell("after = True"),
        ]
    )
    with pytest.raises(CellExecutionError) as info:
        execute(notebook)
    failed = notebook.cells[1]
    errors = [o for o in failed.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "ZeroDivisionError"
    shown = text(failed)
    assert shown.count("Traceback (most recent call last)") == 1
    assert "----> 4 boom = 1 / 0" in shown
    assert "ZeroDivisionError" in str(info.value)
    assert notebook.cells[2].execution_count is None
