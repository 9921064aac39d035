"""The package people install: sdist and wheel build, pass ``twine check``, work in a fresh venv.

The wheel test installs into a new virtual environment the way the README's set-up does
(``torch==2.13.0`` first, so pip never pulls a CUDA build), then runs the quickstart notebook
headless and a materialization that equals eager construction, with nothing from this checkout
on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import jupyter_metainit

ROOT = Path(__file__).resolve().parents[1]
# A kernel name of its own: a user-level "python3" kernel would win over the venv's.
_KERNEL = "jupyter-metainit-wheel-test"
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    # The fresh venv must see only what it installed, not a checkout on PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, (
        f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the backend (hatchling) is a test dependency, so no download per build.
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT)
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("*.whl")
    return wheel


def test_version_is_printable():
    assert jupyter_metainit.__version__.count(".") >= 2


def test_sdist_and_wheel_pass_twine_check(dist: Path):
    out = _run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    assert out.count("PASSED") == 2


def test_the_wheel_ships_licence_types_widget_and_rng_tables_but_no_tests(dist: Path):
    names = zipfile.ZipFile(_wheel(dist)).namelist()
    for expected in (
        "jupyter_metainit/py.typed",
        "jupyter_metainit/jupyter/static/widget.js",
        "jupyter_metainit/jupyter/static/widget.css",
        "jupyter_metainit/core/rng/_mt19937_jumps.bin",
        "jupyter_metainit/core/rng/_mt19937_phi.bin",
    ):
        assert expected in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n]


def test_the_wheel_metadata_declares_licence_classifiers_and_run_time_imports(dist: Path):
    wheel = zipfile.ZipFile(_wheel(dist))
    (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = wheel.read(metadata_name).decode()
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "Classifier: Topic :: Scientific/Engineering :: Artificial Intelligence" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    requires = {
        line.split()[1].split(">")[0].split("<")[0].split("=")[0].lower()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    for module in ("torch", "ipython", "anywidget", "traitlets", "pandas", "numpy", "safetensors"):
        assert module in requires, module


def test_the_sdist_ships_the_licence_and_the_front_end_source_but_no_node_modules(dist: Path):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(n.endswith("/LICENSE") for n in names)
    assert any(n.endswith("labextension/src/view.ts") for n in names)
    assert not [n for n in names if "node_modules" in n or "__pycache__" in n]


_MATERIALIZE_EQUALS_EAGER = """
import torch
from torch import nn
import jupyter_metainit
from jupyter_metainit import materialize, meta_init

assert "site-packages" in jupyter_metainit.__file__, jupyter_metainit.__file__
build = lambda: nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8))
torch.manual_seed(0)
eager = build()
torch.manual_seed(0)
with meta_init():
    model = build()
materialize(model[2])
materialize(model)
for (name, a), (_, b) in zip(model.state_dict().items(), eager.state_dict().items()):
    assert torch.equal(a, b), name
print("exact", jupyter_metainit.__version__)
"""

_RUN_QUICKSTART = """
import sys
import nbformat
from nbclient import NotebookClient

notebook = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(notebook, kernel_name=sys.argv[2], timeout=300).execute()
outputs = [o for c in notebook.cells for o in c.get("outputs", [])]
assert not [o for o in outputs if o.output_type == "error"]
print("quickstart ran,", len(outputs), "outputs")
"""


@pytest.mark.timeout(900)
def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_quickstart(dist: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    pip = (python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    # A pip recent enough to show PEP 639 licence metadata (venv bundles an older one).
    _run(*pip, "--upgrade", "pip>=25.1")
    _run(*pip, TORCH_SPEC)
    # transformers, nbclient and ipykernel: what the quickstart notebook itself needs.
    _run(*pip, _wheel(dist), "transformers", "nbclient", "ipykernel")
    _run(python, "-m", "ipykernel", "install", "--sys-prefix", "--name", _KERNEL)
    shown = _run(python, "-m", "pip", "show", "--verbose", "jupyter_metainit")
    assert "License-Expression: BSD-3-Clause" in shown
    assert "Framework :: Jupyter" in shown
    # From an empty folder, so this checkout is not importable.
    assert "exact" in _run(python, "-c", _MATERIALIZE_EQUALS_EAGER, cwd=tmp_path)
    quickstart = ROOT / "notebooks" / "quickstart.ipynb"
    env_path = tmp_path / "run_quickstart.py"
    env_path.write_text(_RUN_QUICKSTART)
    assert "quickstart ran" in _run(python, env_path, quickstart, _KERNEL, cwd=tmp_path)
