"""The core: deferred construction, recording, exact replay and in-place materialization.

No Jupyter imports here: scripts, distributed launchers and the notebook layer share it.
"""

from __future__ import annotations

from jupyter_metainit.core.materialize.materialize import (
    clear_meta_init_cache,
    dematerialize,
    is_deferred,
    materialize,
    tensor_source,
    tensor_state,
    tensor_values,
)
from jupyter_metainit.core.materialize.skip_init import skip_init
from jupyter_metainit.core.record.context import is_meta_init, meta_init
from jupyter_metainit.core.record.tensor import DeferredTensor

__all__ = [
    "DeferredTensor",
    "clear_meta_init_cache",
    "dematerialize",
    "is_deferred",
    "is_meta_init",
    "materialize",
    "meta_init",
    "skip_init",
    "tensor_source",
    "tensor_state",
    "tensor_values",
]
