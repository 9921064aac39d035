"""TEMPORARY old import path, kept only until ``materialize/`` and ``distributed/`` (owned by
another helper) import these names from ``jupyter_metainit.core.replay`` instead; then delete
this module. Nothing new may import it.
"""

from __future__ import annotations

from jupyter_metainit.core.replay import (
    Plan,
    Progress,
    Run,
    compute_values,
    execute,
    noting_whole_intermediates,
    plan,
    real_view,
)

_Run = Run

__all__ = [
    "Plan",
    "Progress",
    "compute_values",
    "execute",
    "noting_whole_intermediates",
    "plan",
    "real_view",
]
