"""Build PyTorch models of any size without allocating them; materialize exactly the parts you need.

The core (``meta_init``, ``materialize``, ...) imports only ``torch`` and ``numpy``. The
estimates (pandas) and the Jupyter layer (IPython, anywidget) load on first use, so scripts and
distributed launchers pay for neither.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from jupyter_metainit.core import (
    at_meta_init_edges,
    clear_meta_init_cache,
    dematerialize,
    is_deferred,
    is_meta_init,
    materialize,
    meta_init,
    skip_init,
)
from jupyter_metainit.core.errors import (
    ArgumentError,
    ArgumentTypeError,
    BusyError,
    DeferredDataError,
    MaterializationError,
    MetaInitError,
    NotEnoughMemoryError,
    UnsupportedOperatorError,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BusyError",
    "DeferredDataError",
    "MaterializationError",
    "MetaInitError",
    "ModuleTreeWidget",
    "NotEnoughMemoryError",
    "UnsupportedOperatorError",
    "clear_meta_init_cache",
    "compare",
    "dematerialize",
    "dry_run",
    "explore",
    "fits",
    "is_deferred",
    "is_meta_init",
    "load_ipython_extension",
    "materialize",
    "memory_table",
    "meta_init",
    "place",
    "save",
    "skip_init",
    "stats",
    "summary",
    "unload_ipython_extension",
    "widgets_of",
]

_LAZY = {
    "memory_table": "jupyter_metainit.estimates",
    "dry_run": "jupyter_metainit.estimates",
    "fits": "jupyter_metainit.estimates",
    "summary": "jupyter_metainit.estimates",
    "place": "jupyter_metainit.plan",
    "explore": "jupyter_metainit.jupyter.widget",
    "ModuleTreeWidget": "jupyter_metainit.jupyter.widget",
    "widgets_of": "jupyter_metainit.jupyter.widget",
    "load_ipython_extension": "jupyter_metainit.jupyter.magics",
    "unload_ipython_extension": "jupyter_metainit.jupyter.magics",
    "save": "jupyter_metainit.saving",
    "stats": "jupyter_metainit.inspection",
    "compare": "jupyter_metainit.inspection",
}


def _divert_save_pretrained() -> None:
    """A deferred transformers model's ``save_pretrained`` writes eager's files through
    ``save``: installed when deferred models can first exist, never at import (see
    ``saving/hook.py``). Runs at every outermost ``meta_init`` edge, so it stays cheap."""
    global _diverted
    if not _diverted and "transformers.modeling_utils" in sys.modules:
        from jupyter_metainit.saving.hook import install_save_pretrained

        _diverted = install_save_pretrained()


_diverted = False
at_meta_init_edges(_divert_save_pretrained)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jupyter_metainit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
