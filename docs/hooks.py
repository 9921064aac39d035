"""MkDocs hooks of the documentation site (named in mkdocs.yml; not a page).

- The example notebooks stay where the set-up, the tests and users open them (``notebooks/``);
  the site takes them from there instead of keeping copies under ``docs/``.
- The architecture page shows ``ARCHITECTURE.md`` at the repository root once that file exists,
  and its own short text until then. Its links to repository files outside ``docs/`` (source
  files, the README) are not pages of the site, so they become the file's path in plain text
  instead of failing the strict build.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
ARCHITECTURE = REPO_ROOT / "ARCHITECTURE.md"
DOCS = REPO_ROOT / "docs"
# A Markdown link (not an image) with a relative target: [text](target) or [text](target#anchor).
_RELATIVE_LINK = re.compile(
    r"(?<!!)\[([^\]]+)\]\((?![a-z][a-z0-9+.-]*:|#|/)([^)#\s]+)(#[^)\s]*)?\)"
)


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


# After include-markdown (priority 0): it has made the included file's links relative to the page.
@event_priority(-100)
def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri != "architecture.md" or not ARCHITECTURE.is_file():
        return markdown

    def outside_docs_as_text(link: re.Match[str]) -> str:
        text, target = link.group(1), link.group(2)
        path = (DOCS / target).resolve()
        if path.is_relative_to(DOCS):
            return link.group(0)
        shown = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else target
        return text if text.strip("`") == shown else f"{text} (`{shown}`)"

    return _RELATIVE_LINK.sub(outside_docs_as_text, markdown)
