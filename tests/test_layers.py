"""The package's layers import downwards only, and the core pulls in no Jupyter or pandas.

Also the layout's rules: the core's stages import in order, the upper layers use only the core's
public face, no import circle (imports inside functions included), no two modules share a file
name; modules, functions or folders past the size a newcomer reads comfortably are reported as
warnings (advisory, not failures).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import warnings

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jupyter_metainit"
# The core's stages, lowest first: a module imports its own folder, lower stages and core.errors.
STAGES = ("runtime", "rng", "record", "replay", "materialize")
# What an upper layer (any top-level subpackage but core) may import from the core.
CORE_FACE = {"jupyter_metainit.core", "jupyter_metainit.core.errors"}
# Sizes a newcomer reads comfortably. Advisory: going over is reported in the test
# run's warnings summary, not a failure, so that concepts, not line counts, shape the code.
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_FOLDER_MODULES = 12


class SizeAdvisory(UserWarning):
    """A module, function or folder over the size a newcomer reads comfortably."""


def _advise(what: str, found: object) -> None:
    if found:
        warnings.warn(f"{what}: {found}", SizeAdvisory, stacklevel=2)


# layer -> layers it may import
ALLOWED = {
    "core": {"core"},
    "estimates": {"core", "estimates"},
    "distributed": {"core", "distributed"},
    "plan": {"core", "estimates", "plan"},
    "saving": {"core", "saving"},
    "inspection": {"core", "inspection"},
    "jupyter": {"core", "estimates", "plan", "saving", "inspection", "jupyter"},
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


def test_every_top_level_subpackage_says_which_layers_it_may_import():
    # A new layer (plan, saving, ...) is checked only once it is in ALLOWED.
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert subpackages <= set(ALLOWED), f"add to ALLOWED: {sorted(subpackages - set(ALLOWED))}"


def test_core_has_no_jupyter_or_pandas_imports():
    banned = {"IPython", "ipywidgets", "anywidget", "pandas", "jupyter_client", "traitlets"}
    for path in (PACKAGE / "core").rglob("*.py"):
        for mod in _imports(path):
            assert mod.split(".")[0] not in banned, f"{path.name} imports {mod}"


def test_the_core_imports_torch_and_numpy_and_the_rest_only_when_used():
    # What the README says: torch and numpy at import; safetensors (checkpoints) and tqdm
    # (progress=True) only inside the functions that need them; transformers (a model's tensors
    # in its files' layout) too.
    allowed = set(sys.stdlib_module_names) | {"torch", "numpy", "jupyter_metainit"}
    when_used = {"safetensors", "tqdm", "transformers"}
    found = []
    for path in (PACKAGE / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        at_import = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names} - allowed:
                if top not in when_used or id(node) in at_import:
                    found.append(f"{path.relative_to(PACKAGE)} imports {top}")
    assert not found, found


def test_importing_the_package_loads_neither_pandas_nor_ipython():
    code = "import sys, jupyter_metainit; print('pandas' in sys.modules, 'IPython' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_public_names_resolve():
    import jupyter_metainit

    for name in jupyter_metainit.__all__:
        assert getattr(jupyter_metainit, name) is not None


# --- stages, layers and sizes: who may import whom, and how big a module grows ---------------


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported_modules(name: str) -> set[str]:
    """The package modules `name` imports anywhere in its file (inside functions too).

    `from pkg import mod` counts as importing the module `pkg.mod`; a name that is not a module
    counts as importing `pkg`. The parent packages an import runs implicitly are not counted
    (every module would otherwise import the package face that imports it).
    """
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {target for target in found if target in MODULES and target != name}


def _stage(name: str) -> int | None:
    """Rank of a core module: errors lowest, then the stages, then the core's face."""
    parts = name.split(".")
    if parts[:2] != ["jupyter_metainit", "core"]:
        return None
    if len(parts) == 2:
        return len(STAGES)  # core/__init__: the public face, above every stage
    if parts[2] == "errors":
        return -1
    return STAGES.index(parts[2]) if parts[2] in STAGES else None


def test_core_stages_import_only_their_own_folder_lower_stages_and_errors():
    upward = []
    for name in MODULES:
        rank = _stage(name)
        if rank is None or rank == len(STAGES):
            continue
        for target in _imported_modules(name):
            target_rank = _stage(target)
            if target_rank is not None and target_rank > rank:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports pointing up the stage order:\n" + "\n".join(sorted(upward))


def test_every_core_module_sits_in_a_stage_folder_or_is_errors():
    # A new core folder must be placed in STAGES, or the stage-order test cannot check it.
    unplaced = [name for name in MODULES if name.startswith("jupyter_metainit.core.")]
    unplaced = [name for name in unplaced if _stage(name) is None]
    assert not unplaced, f"core modules outside the stages {STAGES}: {unplaced}"


def test_no_two_modules_share_a_file_name():
    # A module is named by what it holds, so its file name alone finds it (``__init__.py`` aside):
    # three ``devices.py`` once held three different things.
    paths: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            paths.setdefault(path.name, []).append(path.relative_to(PACKAGE).as_posix())
    shared = {name: sorted(found) for name, found in paths.items() if len(found) > 1}
    assert not shared, f"modules sharing a file name (rename each by what it holds): {shared}"


def test_upper_layers_import_only_the_core_face_and_its_errors():
    upper = {path.parent.name for path in PACKAGE.glob("*/__init__.py")} - {"core"}
    private = []
    for name, path in MODULES.items():
        if name.split(".")[1:2] and name.split(".")[1] in upper:
            for node in ast.walk(ast.parse(path.read_text())):
                named = []
                if isinstance(node, ast.Import):
                    named = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    named = [node.module]
                for module in named:
                    if module.startswith("jupyter_metainit.core") and module not in CORE_FACE:
                        private.append(f"{name} imports {module}")
    assert not private, "upper layers reaching into the core:\n" + "\n".join(sorted(private))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_cycle_finder_finds_a_circle_and_ignores_a_chain():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_among_package_modules_function_level_imports_included():
    graph = {name: _imported_modules(name) for name in MODULES}
    circles = _cycles(graph)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_modules_over_400_lines_are_reported():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: lines for name, lines in long.items() if lines > MAX_MODULE_LINES}
    _advise(f"modules over {MAX_MODULE_LINES} lines", long)


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from `def` to the function's end, less its docstring."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_functions_over_80_lines_excluding_their_docstring_are_reported():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _function_lines(node)
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({lines} lines)")
    _advise(f"functions over {MAX_FUNCTION_LINES} lines", ", ".join(sorted(long)))


def test_folders_over_12_modules_are_reported():
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]:
        count = len(list(folder.glob("*.py")))
        if count > MAX_FOLDER_MODULES:
            crowded[folder.relative_to(PACKAGE.parent).as_posix()] = count
    _advise(f"folders over {MAX_FOLDER_MODULES} modules", crowded)
