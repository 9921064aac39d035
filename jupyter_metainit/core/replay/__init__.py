"""Replay: running a recording for real, exactly as eager code would have.

The replay stage also serves recording's value reads: importing it installs
:class:`ReplayValueReader` as recording's
:mod:`~jupyter_metainit.core.record.value_reader` (recording sits below replay and does not
import it).
"""

from __future__ import annotations

from jupyter_metainit.core.record.value_reader import use_value_reader
from jupyter_metainit.core.replay.replay import ReplayValueReader

use_value_reader(ReplayValueReader())
