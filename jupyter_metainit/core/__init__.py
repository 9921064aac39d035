"""The core: deferred construction, recording, exact replay and in-place materialization.

No Jupyter imports here: scripts, distributed launchers and the notebook layer share it.

Stages, lowest first (an import points only down this order): ``runtime`` (services every
stage shares) < ``rng`` (random streams) < ``record`` (``meta_init``: deferred tensors and their
records) < ``replay`` (records to values) < ``materialize`` (what runs when you click
Materialize, freeing, and the walker that finds a model's tensors). This module is the core's
public face; ``errors`` beside it holds the exceptions.

``__all__`` lists what users call. The upper layers (``estimates``, ``jupyter``,
``distributed``) import from here, and only from here (and ``core.errors``), also these names:

- the walker: ``own_tensors``, ``named_tensors``, ``unique_tensors``, ``counted_attributes``,
  ``storage_of`` (which tensors a module holds, and the memory under each);
- the formatter: ``format_bytes``, ``format_count``, ``format_duration``;
- the lock and events: ``busy_with`` (what holds the lock), ``events`` (the module
  ``core.runtime.events``: ``events.subscribe(callback)``, ``events.publish(kind, tensors)``);
- ``plain``: run real tensor code with every interception off;
- ``at_meta_init_edges(callback)``: run something when a thread enters or leaves its outermost
  ``meta_init`` block (the save_pretrained diversion installs itself then, not at import);
- for ``materialize_sharded``: ``iter_deferred``, ``progress_callback``,
  ``noting_whole_intermediates``;
- one parser per kind of argument (Note [One argument policy] in ``runtime/arguments``):
  ``parse_device``, ``indexed_device``, ``parse_dtype``, ``parse_size``, ``parse_path``;
- one helper per concept: ``missing_device_reason``, ``dtype_name``, ``available_memory``,
  ``is_out_of_memory``, ``local_tensor`` (a DTensor's
  local shard), ``copy_user_attributes`` (the user's attributes onto a real tensor);
- for ``save`` and ``inspection``: ``values_to_write`` (exact values of a deferred tensor or
  of a batch of them, nothing kept or swapped), ``Recycler`` (the memory it computes a batch
  into, handed on from batch to batch), ``source_files`` (the checkpoint files a deferred
  tensor reads), ``telling`` and ``copy_in_steps`` (progress, and Cancel, from inside a batch
  being generated or copied), ``in_file_layout`` (a transformers model's tensors in its
  files' layout, as ``save_pretrained`` writes them);
- ``ATEN_SCALAR_TYPES``: the argument types of ATen ops that hold no tensor.
"""

from __future__ import annotations

from jupyter_metainit.core.materialize.dematerialize import dematerialize
from jupyter_metainit.core.materialize.file_layout import in_file_layout
from jupyter_metainit.core.materialize.materialize import materialize
from jupyter_metainit.core.materialize.progress import progress_callback
from jupyter_metainit.core.materialize.queries import (
    is_deferred,
    iter_deferred,
    no_values_reason,
    source_files,
    tensor_source,
    tensor_state,
    tensor_values,
)
from jupyter_metainit.core.materialize.shadows import clear_meta_init_cache
from jupyter_metainit.core.materialize.skip_init import skip_init
from jupyter_metainit.core.materialize.user_state import copy_user_attributes
from jupyter_metainit.core.materialize.walk import (
    counted_attributes,
    local_tensor,
    named_tensors,
    own_tensors,
    storage_of,
    unique_tensors,
)
from jupyter_metainit.core.record.context import at_meta_init_edges, is_meta_init, meta_init
from jupyter_metainit.core.record.dispatch.metadata import ATEN_SCALAR_TYPES
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay import Recycler, noting_whole_intermediates, values_to_write
from jupyter_metainit.core.runtime import events
from jupyter_metainit.core.runtime.arguments import (
    ESTIMATE_ONLY_BITS,
    check_flag,
    check_floating_dtype,
    check_progress,
    dtype_name,
    indexed_device,
    missing_device_reason,
    parse_device,
    parse_dtype,
    parse_path,
    parse_size,
)
from jupyter_metainit.core.runtime.format import format_bytes, format_count, format_duration
from jupyter_metainit.core.runtime.interrupts import copy_in_steps, telling
from jupyter_metainit.core.runtime.lock import busy_with
from jupyter_metainit.core.runtime.memory_left import available_memory, is_out_of_memory
from jupyter_metainit.core.runtime.plain import plain

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

# The upper layers' face (see the docstring): public names of the core, not listed for users.
UPPER_LAYER_FACE = (
    ATEN_SCALAR_TYPES, ESTIMATE_ONLY_BITS, Recycler, at_meta_init_edges, available_memory,
    busy_with, check_flag, check_floating_dtype, check_progress, copy_in_steps,
    copy_user_attributes, counted_attributes, dtype_name, events, format_bytes, format_count,
    format_duration, in_file_layout, indexed_device, is_out_of_memory, iter_deferred, local_tensor,
    missing_device_reason, named_tensors, no_values_reason, noting_whole_intermediates, own_tensors,
    parse_device, parse_dtype, parse_path, parse_size, plain, progress_callback, source_files,
    storage_of, telling, unique_tensors, values_to_write,
)  # fmt: skip
