"""The documentation site: ``mkdocs build --strict`` (warnings are errors) and what it must show.

The site is built once per module into a temporary folder, as CI does, with the notebooks
executed as configured in ``mkdocs.yml``; the tests then read the built HTML.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"
BUILD_TIMEOUT_S = 300

if not CONFIG.is_file():  # an sdist ships the tests but not the documentation sources
    pytest.skip("mkdocs.yml is not in this checkout", allow_module_level=True)

# The guide pages (nav titles in mkdocs.yml) and where they are built.
PAGES = {
    "index.html": "jupyter_metainit",
    "getting-started/index.html": "Getting started",
    "notebook-workflow/index.html": "The notebook workflow",
    "estimates/index.html": "What does it cost?",
    "exactness/index.html": "Exactness and RNG modes",
    "checkpoints/index.html": "Checkpoints",
    "sharded/index.html": "Sharded materialization",
    "limits/index.html": "Known limits",
    "values/index.html": "Look at the values",
    "api/index.html": "Core API",
    "performance/index.html": "Performance",
    "architecture/index.html": "Architecture",
}
NOTEBOOKS = ["quickstart", "checkpoints", "lazy_modules", "custom_modules", "values"]


def _text(page: Path) -> str:
    """The page's visible text: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def _build(root: Path, out: Path, **env: str) -> Path:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", **env}  # Material's banner is no warning
    config = root / "mkdocs.yml"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(ROOT, tmp_path_factory.mktemp("site"))


def test_the_site_builds_strictly_with_every_guide_page(site: Path):
    missing = [path for path in PAGES if not (site / path).is_file()]
    assert missing == []


def test_every_guide_page_has_its_title(site: Path):
    for path, title in PAGES.items():
        assert "<h1" in (site / path).read_text(encoding="utf-8"), path
        assert title in _text(site / path), path


def test_the_api_page_shows_materialize_with_its_docstring(site: Path):
    text = _text(site / "api/index.html")
    assert "jupyter_metainit.materialize" in text
    assert "Turn deferred tensors real, in place, with the values eager construction gives." in text


def test_the_api_page_shows_the_lazily_imported_public_names(site: Path):
    text = _text(site / "api/index.html")
    for name in ["memory_table", "dry_run", "fits", "summary", "explore", "widgets_of"]:
        assert f"jupyter_metainit.{name}" in text, name
    assert "jupyter_metainit.ModuleTreeWidget" in text
    assert "jupyter_metainit.distributed.materialize_sharded" in text


def test_the_api_page_documents_functions_not_the_submodules_of_the_same_name(site: Path):
    # estimates.dry_run and estimates.summary are both a submodule and the function it defines.
    page = (site / "api/index.html").read_text(encoding="utf-8")
    assert 'id="jupyter_metainit.dry_run"' in page
    assert "jupyter_metainit.dry_run.dry_run" not in page
    assert "jupyter_metainit.summary.summary" not in page


def test_the_api_page_shows_sphinx_roles_as_code(site: Path):
    text = _text(site / "api/index.html")
    assert re.findall(r":(?:func|class|meth|attr):", text) == []


def test_the_api_page_names_no_internal_module(site: Path):
    text = _text(site / "api/index.html")
    assert re.findall(r"jupyter_metainit(?:\.\w+)*\._\w+", text) == []
    assert "jupyter_metainit.core." not in text and "jupyter_metainit.estimates." not in text


def test_the_notebook_workflow_page_shows_both_widget_screenshots(site: Path):
    page = (site / "notebook-workflow/index.html").read_text(encoding="utf-8")
    for image in ["widget-jupyterlab4-light-1400.png", "widget-notebook7-dark-700.png"]:
        assert (site / "img" / image).is_file()
    assert "img/widget-jupyterlab4-light-1400.png" in page
    assert "img/widget-notebook7-dark-700.png" in page


def test_every_example_notebook_is_a_page(site: Path):
    for name in NOTEBOOKS:
        assert (site / "notebooks" / name / "index.html").is_file(), name


def test_the_quickstart_page_shows_the_outputs_of_its_run(site: Path):
    text = _text(site / "notebooks/quickstart/index.html")
    assert "materialized model.model.layers[0]: LlamaDecoderLayer, 856 M parameters" in text
    assert "all 80 layers deferred again" in text


def test_the_architecture_page_shows_ARCHITECTURE_md_with_links_outside_the_site_as_paths(
    tmp_path: Path,
):
    # A copy of the documentation sources with an ARCHITECTURE.md at its root, built without
    # running the notebooks.
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(CONFIG, root / "mkdocs.yml")
    for folder in ["docs", "notebooks", "jupyter_metainit"]:
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "ARCHITECTURE.md").write_text(
        "# Layers of the package\n\n"
        "The core is in [`jupyter_metainit/core`](jupyter_metainit/core/__init__.py); its limits"
        " are [listed](docs/limits.md#random-numbers).\n"
    )
    site = _build(root, tmp_path / "site", METAINIT_DOCS_EXECUTE="false")
    page = (site / "architecture/index.html").read_text(encoding="utf-8")
    assert "Layers of the package" in page
    assert (
        "<code>jupyter_metainit/core</code> (<code>jupyter_metainit/core/__init__.py</code>)"
        in page
    )
    assert '<a href="../limits/#random-numbers">listed</a>' in page


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_a_landing_page_of_at_most_250_lines():
    assert len(_readme().splitlines()) <= 250


def test_every_relative_link_of_the_readme_points_to_a_file_that_exists():
    # The README is read on the forge, outside the site: mkdocs does not check its links.
    targets = re.findall(r"\]\((?![a-z]+:)([^)#\s]+)(?:#[^)\s]*)?\)", _readme())
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_the_readme_and_getting_started_give_the_same_set_up_commands():
    getting_started = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    commands = re.findall(r"^bash scripts/setup\.sh.*$", _readme(), flags=re.MULTILINE)
    assert len(commands) == 2
    assert all(command in getting_started for command in commands)
