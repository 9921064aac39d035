"""The package's layers import downwards only, and the core pulls in no Jupyter or pandas."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jupyter_metainit"
# layer -> layers it may import
ALLOWED = {
    "core": {"core"},
    "estimates": {"core", "estimates"},
    "distributed": {"core", "distributed"},
    "jupyter": {"core", "estimates", "jupyter"},
    "save": {"core", "save"},
}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_point_downwards(layer):
    for path in (PACKAGE / layer).rglob("*.py"):
        for mod in _imports(path):
            if mod.startswith("jupyter_metainit."):
                target = mod.split(".")[1]
                assert target in ALLOWED[layer], f"{path.name} imports {mod}"


def test_core_has_no_jupyter_or_pandas_imports():
    banned = {"IPython", "ipywidgets", "anywidget", "pandas", "jupyter_client", "traitlets"}
    for path in (PACKAGE / "core").rglob("*.py"):
        for mod in _imports(path):
            assert mod.split(".")[0] not in banned, f"{path.name} imports {mod}"


def test_importing_the_package_loads_neither_pandas_nor_ipython():
    code = "import sys, jupyter_metainit; print('pandas' in sys.modules, 'IPython' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_names_resolve():
    import jupyter_metainit

    for name in jupyter_metainit.__all__:
        assert getattr(jupyter_metainit, name) is not None
