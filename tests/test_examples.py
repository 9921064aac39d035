"""Examples that run: every public name's docstring examples, and the README's and the docs' code.

- Each public name (``jupyter_metainit.__all__``, ``materialize_sharded``, ``plan.Placement``
  and the inspection helpers the docs show) has a docstring in one Google-style format: a first
  line saying what it is for, ``Args:`` when it takes arguments, ``Returns:`` when it returns
  something, ``Raises:`` naming the package's error classes, and an ``Examples:`` section whose
  ``>>>`` lines run here under doctest, each in a namespace of its own (the examples import what
  they use, so they can be copied as they are). ``Examples`` and not ``Example``: the API page
  (mkdocstrings, Google style) shows only the former's ``>>>`` lines as code.
- The ```` ```python ```` blocks of ``README.md`` and ``docs/*.md`` run in order, one namespace
  per page, in a temporary working directory; a page with IPython magics runs in a real
  ``InteractiveShell``. A block that cannot run here (a GPU, a download, ``torchrun``) says so
  in the Markdown, just above it: ``<!-- not run: needs a GPU -->``.
"""

from __future__ import annotations

import builtins
import dataclasses
import doctest
import importlib
import inspect
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _ipython import run

import jupyter_metainit

ROOT = Path(__file__).resolve().parents[1]

# Public names beyond the package root's ``__all__``: the API pages document them too, and the
# widget's Python API (what its class docstring offers; its other public methods are ipywidgets'
# plumbing).
EXTRA_PUBLIC = [
    "jupyter_metainit.distributed.materialize_sharded",
    "jupyter_metainit.plan.Placement",
    "jupyter_metainit.inspection.along_depth",
    "jupyter_metainit.inspection.svg_chart",
    *(
        f"jupyter_metainit.ModuleTreeWidget.{method}"
        for method in ["materialize", "free", "wait", "place", "pin", "materialize_plan", "save"]
    ),
]
PUBLIC = [f"jupyter_metainit.{name}" for name in jupyter_metainit.__all__] + EXTRA_PUBLIC

DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
SECTION = re.compile(r"^(Args|Returns|Raises|Examples?|Attributes|Yields):\s*$", re.MULTILINE)


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    if module.startswith("jupyter_metainit.ModuleTreeWidget"):  # a method of the class
        return getattr(jupyter_metainit.ModuleTreeWidget, name)
    obj = getattr(importlib.import_module(module), name)
    if inspect.ismodule(obj):  # a package named as the function it exports (``save``)
        obj = getattr(obj, name)
    return obj


def _sections(doc: str) -> dict[str, str]:
    """The Google-style sections of a docstring (``getdoc``'s dedented text): name -> body."""
    found = list(SECTION.finditer(doc))
    ends = [m.start() for m in found[1:]] + [len(doc)] * bool(found)
    return {m.group(1): doc[m.end() : end] for m, end in zip(found, ends, strict=True)}


def _public_methods(cls: type) -> list[tuple[str, Callable[..., Any]]]:
    """The methods a class defines itself (not inherited, not private), properties left out."""
    methods = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, (classmethod, staticmethod)):
            methods.append((name, value.__func__))
        elif inspect.isfunction(value):
            methods.append((name, value))
    return methods


def _takes_arguments(function: Callable[..., Any]) -> bool:
    parameters = list(inspect.signature(function).parameters.values())
    return any(p.name not in {"self", "cls"} for p in parameters)


def _returns_something(function: Callable[..., Any]) -> bool:
    annotation = inspect.signature(function).return_annotation
    return annotation not in {None, "None", inspect.Signature.empty}


def _format_problems(path: str, obj: Any) -> list[str]:
    """What the docstring of ``obj`` (named ``path``) lacks of the one format."""
    doc = inspect.getdoc(obj) or ""
    problems = []
    if not doc:
        return [f"{path}: no docstring"]
    sections = _sections(doc)
    if ">>>" not in sections.get("Examples", ""):
        problems.append(f"{path}: no Examples section with >>> lines")
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            pass  # constructed with a message, by the package
        elif dataclasses.is_dataclass(obj):
            if "Attributes" not in sections:
                problems.append(f"{path}: a dataclass without an Attributes section")
        elif "__init__" in vars(obj) and _takes_arguments(obj.__init__) and "Args" not in sections:
            problems.append(f"{path}: takes arguments but has no Args section")
        for name, method in _public_methods(obj):
            problems += _format_problems(f"{path}.{name}", method)
        return problems
    if _takes_arguments(obj) and "Args" not in sections:
        problems.append(f"{path}: takes arguments but has no Args section")
    if _returns_something(obj) and "Returns" not in sections:
        problems.append(f"{path}: returns something but has no Returns section")
    problems += _unknown_raises(path, sections.get("Raises", ""))
    return problems


def _unknown_raises(path: str, raises: str) -> list[str]:
    """Each entry of a Raises section names a package error class or a built-in exception."""
    problems = []
    for name in re.findall(r"^    (\w+):", raises, flags=re.MULTILINE):
        error = getattr(jupyter_metainit, name, None) or getattr(builtins, name, None)
        if not (inspect.isclass(error) and issubclass(error, BaseException)):
            problems.append(f"{path}: Raises names {name}, not an exception class")
    return problems


@pytest.mark.parametrize("path", PUBLIC)
def test_every_public_name_has_a_docstring_in_the_one_format(path: str):
    assert _format_problems(path, _resolve(path)) == []


@pytest.mark.parametrize("path", PUBLIC)
def test_the_docstring_examples_of_every_public_name_run(path: str):
    obj = _resolve(path)
    # globs={}: an example imports what it uses, as a user copying it would.
    tests = doctest.DocTestFinder(recurse=True).find(obj, path, globs={})
    tests = [t for t in tests if t.examples]
    assert tests, f"{path} has no >>> example"
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    for test in tests:
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()


def _api_page_docstring_options() -> dict[str, Any]:
    """The docstring options the API page parses with (mkdocs.yml's, its ``!ENV`` tags aside)."""
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)
    plugin = next(p["mkdocstrings"] for p in config["plugins"] if "mkdocstrings" in p)
    return plugin["handlers"]["python"]["options"]["docstring_options"]


@pytest.mark.parametrize("path", PUBLIC)
def test_the_api_page_reads_each_section_of_every_public_docstring(path: str, caplog):
    # Google style as griffe reads it: "Example:" would be an admonition showing the >>> lines as
    # nested quotes, a badly indented continuation a warning that fails the strict build.
    griffe = pytest.importorskip("griffe")
    sections = _sections(inspect.getdoc(_resolve(path)) or "")
    docstring = griffe.Docstring(
        inspect.getdoc(_resolve(path)),
        parser="google",
        parser_options=_api_page_docstring_options(),
    )
    with caplog.at_level("WARNING"):
        kinds = [section.kind.value for section in docstring.parse()]
    expected = {"Args": "parameters", "Returns": "returns", "Raises": "raises"}
    assert "examples" in kinds and "admonition" not in kinds
    assert [expected[s] for s in sections if s in expected] == [
        k for k in kinds if k in expected.values()
    ]
    assert [r.getMessage() for r in caplog.records] == []


def test_the_format_check_finds_a_missing_example_and_a_missing_returns():
    def undocumented(x: int) -> int:
        """Do a thing.

        Args:
            x: a number.
        """
        return x

    assert _format_problems("undocumented", undocumented) == [
        "undocumented: no Examples section with >>> lines",
        "undocumented: returns something but has no Returns section",
    ]


# --- The README's and the docs' code blocks -------------------------------------------------

PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run(?::\s*(?P<reason>.*?))?\s*-->$")


@dataclasses.dataclass
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the marker's reason ("" when the marker gives none)


def _python_blocks(text: str) -> list[Block]:
    """The page's ```python blocks, in order, with the not-run marker just above each."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) == "python":
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(above)
            reason = (marker.group("reason") or "") if marker else None
            blocks.append(Block(i + 1, "\n".join(lines[i + 1 : end]), reason))
        i = end + 1
    return blocks


def _has_magics(code: str) -> bool:
    return any(line.lstrip().startswith(("%", "!")) for line in code.splitlines())


def test_the_block_reader_finds_blocks_and_their_not_run_reasons():
    page = (
        "text\n```python\nx = 1\n```\n\n<!-- not run: needs a GPU -->\n```python\ncuda()\n```\n"
        "```bash\nls\n```\n<!-- not run -->\n```python\ny\n```\n"
    )
    blocks = _python_blocks(page)
    assert [(b.line, b.code, b.not_run) for b in blocks] == [
        (2, "x = 1", None),
        (7, "cuda()", "needs a GPU"),
        (14, "y", ""),
    ]


@pytest.mark.parametrize("page", PAGES)
def test_every_not_run_block_says_why(page: str):
    blocks = _python_blocks((ROOT / page).read_text(encoding="utf-8"))
    assert [b.line for b in blocks if b.not_run is not None and not b.not_run.strip()] == []


@pytest.mark.parametrize("page", PAGES)
def test_the_python_blocks_of_the_page_run(page: str, shell, tmp_path, monkeypatch):
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = [b for b in _python_blocks(text) if b.not_run is None]
    if not blocks:
        pytest.skip(f"{page} has no Python block to run")
    monkeypatch.chdir(tmp_path)  # what the examples write goes here
    if any(_has_magics(b.code) for b in blocks):
        _run_in_shell(page, blocks, shell)
    else:
        namespace: dict[str, Any] = {"__name__": "__main__"}
        for block in blocks:
            exec(compile(block.code, f"{page}:{block.line}", "exec"), namespace)


def _run_in_shell(page: str, blocks: list[Block], shell: Any) -> None:
    try:
        for block in blocks:
            result, out = run(shell, block.code)
            assert result.success, f"{page}, the block at line {block.line}:\n{out.stdout}"
    finally:
        if "jupyter_metainit" in shell.extension_manager.loaded:
            shell.run_cell("%unload_ext jupyter_metainit")
