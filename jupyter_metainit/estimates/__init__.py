"""What each part of a model costs: memory table, dry run, fit check and summary."""

from __future__ import annotations

from jupyter_metainit.estimates.dry_run import dry_run
from jupyter_metainit.estimates.fit import fits
from jupyter_metainit.estimates.memory import MemoryTable, memory_table
from jupyter_metainit.estimates.render import render_html, to_text
from jupyter_metainit.estimates.summary import summary

__all__ = ["MemoryTable", "dry_run", "fits", "memory_table", "render_html", "summary", "to_text"]
