"""Plan where each part of a model goes before anything is allocated: :func:`place`.

A layer above the estimates (it runs a dry run of the workload and reads the memory table) and
below the Jupyter layer (the ``%place`` magic shows its plans).
"""

from __future__ import annotations

from jupyter_metainit.plan.placement import place
from jupyter_metainit.plan.result import Placement

__all__ = ["Placement", "place"]
