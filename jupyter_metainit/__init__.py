"""Build PyTorch models of any size without allocating them; materialize exactly the parts you need."""

from __future__ import annotations

from jupyter_metainit.core import (
    clear_meta_init_cache,
    dematerialize,
    is_deferred,
    is_meta_init,
    materialize,
    meta_init,
    skip_init,
)

__all__ = [
    "clear_meta_init_cache",
    "dematerialize",
    "is_deferred",
    "is_meta_init",
    "materialize",
    "meta_init",
    "skip_init",
]
