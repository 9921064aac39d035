"""Sharded materialization: FSDP2 / DTensor shards of a deferred model, made on each rank.

Imports only the core and ``torch``; ``torch.distributed`` is needed at call time.
"""

from __future__ import annotations

from jupyter_metainit.distributed._sharded import WholeTensorWarning, materialize_sharded

__all__ = ["WholeTensorWarning", "materialize_sharded"]
