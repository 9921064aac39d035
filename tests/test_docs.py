"""The documentation site: ``mkdocs build --strict`` (warnings are errors) and what it must show.

The site is built once per module into a temporary folder, as CI does, with the notebooks
executed as configured in ``mkdocs.yml``; the tests then read the built HTML.
"""

from __future__ import annotations

import html
import os
import re
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
    "api/index.html": "Core API",
    "performance/index.html": "Performance",
    "architecture/index.html": "Architecture",
}
NOTEBOOKS = ["quickstart", "checkpoints", "lazy_modules", "custom_modules"]


def _text(page: Path) -> str:
    """The page's visible text: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a build warning
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-5000:]}"
    return out


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


def test_the_api_page_names_no_internal_module(site: Path):
    text = _text(site / "api/index.html")
    assert re.findall(r"jupyter_metainit(?:\.\w+)*\._\w+", text) == []
    assert "jupyter_metainit.core." not in text and "jupyter_metainit.estimates." not in text


def test_the_notebook_workflow_page_shows_both_widget_screenshots(site: Path):
    page = (site / "notebook-workflow/index.html").read_text(encoding="utf-8")
    for image in ["widget.png", "widget-narrow.png"]:
        assert (site / "img" / image).is_file()
    assert "img/widget-narrow.png" in page


def test_every_example_notebook_is_a_page(site: Path):
    for name in NOTEBOOKS:
        assert (site / "notebooks" / name / "index.html").is_file(), name


def test_the_quickstart_page_shows_the_outputs_of_its_run(site: Path):
    text = _text(site / "notebooks/quickstart/index.html")
    assert "materialized model.model.layers[0]: LlamaDecoderLayer, 856 M parameters" in text
    assert "all 80 layers deferred again" in text
