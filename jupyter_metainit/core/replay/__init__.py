"""Replay: running a recording for real, exactly as eager code would have.

Where to look: ``planning`` (which recorded ops a set of tensors needs), ``run`` (the engine that
executes a plan), ``random_modes`` (exact and fast random values: the two strategies the engine
calls), ``parallel`` (which ops may run on threads of their own), ``shards`` (generating only the
part of a fill a shard is cut from), ``current_values`` (value reads while recording; the
values ``save`` and ``stats`` compute a batch at a time, into memory a ``Recycler`` hands
on), ``read_cache`` (the cache of values those reads computed), ``steps`` (what a replay
tells of its progress, also from inside a long op).

The replay stage also serves recording's value reads: importing it installs
:class:`~jupyter_metainit.core.replay.current_values.ReplayValueReader` as recording's
:mod:`~jupyter_metainit.core.record.value_reader` (recording sits below replay and does not
import it). The names below are the stage's face for the stages above it.
"""

from __future__ import annotations

from jupyter_metainit.core.record.value_reader import use_value_reader
from jupyter_metainit.core.replay.current_values import (
    ReplayValueReader,
    compute_values,
    values_to_write,
)
from jupyter_metainit.core.replay.planning import Plan, plan
from jupyter_metainit.core.replay.realized import real_view
from jupyter_metainit.core.replay.recycler import Recycler
from jupyter_metainit.core.replay.run import Run, execute
from jupyter_metainit.core.replay.shards import noting_whole_intermediates
from jupyter_metainit.core.replay.steps import Progress

__all__ = [
    "Plan",
    "Progress",
    "Recycler",
    "Run",
    "compute_values",
    "execute",
    "noting_whole_intermediates",
    "plan",
    "real_view",
    "values_to_write",
]

use_value_reader(ReplayValueReader())
