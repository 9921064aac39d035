"""Look at the values: statistics and comparisons of models that never fit in memory.

A layer beside ``save``: it reads tensors through the core's public face (deferred ones as the
values ``materialize`` would give, computed a batch at a time; checkpoint files on demand) and
never changes them. ``stats`` measures every tensor (or module) of one model, ``compare`` the
tensors of two, streamed on every core in bounded memory.

Modules: ``moments`` (one tensor's float64 statistics, chunk by chunk), ``sources`` (what is
read: models, dicts, checkpoint paths), ``pipeline`` (batches read while the last one is
measured, progress and cancel), ``statistics`` (``stats``), ``comparison`` (``compare``),
``charts`` (a statistic along the depth, drawn as SVG).
"""

from __future__ import annotations

from jupyter_metainit.inspection.charts import Chart, along_depth, svg_chart
from jupyter_metainit.inspection.comparison import compare
from jupyter_metainit.inspection.statistics import STAT_COLUMNS, stat_tables, stats

__all__ = ["STAT_COLUMNS", "Chart", "along_depth", "compare", "stat_tables", "stats", "svg_chart"]
