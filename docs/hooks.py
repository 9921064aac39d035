"""MkDocs hooks of the documentation site (named in mkdocs.yml; not a page).

- The example notebooks stay where the set-up, the tests and users open them (``notebooks/``);
  the site takes them from there instead of keeping copies under ``docs/``.
- The architecture page shows ``ARCHITECTURE.md`` at the repository root once that file exists,
  and its own short text until then.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
ARCHITECTURE = REPO_ROOT / "ARCHITECTURE.md"


# Before mkdocs-jupyter's on_files (default priority 0), so that it renders these notebooks too.
@event_priority(100)
def on_files(files: Files, config: MkDocsConfig) -> Files:
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(
            File(
                f"notebooks/{notebook.name}",
                src_dir=str(REPO_ROOT),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files


def on_page_read_source(page: Page, config: MkDocsConfig) -> str | None:
    # include-markdown (run on the page's Markdown afterwards) rewrites the file's relative links.
    if page.file.src_uri == "architecture.md" and ARCHITECTURE.is_file():
        return '{% include-markdown "../ARCHITECTURE.md" %}\n'
    return None
