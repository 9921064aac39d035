"""``save``: write the values ``materialize`` would give to a checkpoint, in bounded memory.

A layer beside ``distributed``: it reads deferred tensors through the core's public face and
never changes them. Use it to make the checkpoint nobody can allocate (a seed checkpoint of a
70 B model from one machine), or to save a partly materialized model without materializing the
rest. ``format="safetensors"`` writes transformers' layout (``from_pretrained`` loads it);
``format="dcp"`` writes ``torch.distributed.checkpoint``'s (``dcp.load`` into any sharding).
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
from typing import Any

import torch

from jupyter_metainit.core import parse_dtype
from jupyter_metainit.save.layout import (
    INDEX_NAME,
    WEIGHTS_NAME,
    check_savable,
    parse_size,
    plan_layout,
    state_dict_of,
    untie,
)
from jupyter_metainit.save.writer import (
    Progress,
    publish_directory,
    staging_directory,
    write_safetensors_files,
)

__all__ = ["save"]

_FORMATS = ("safetensors", "dcp")
_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def save(
    obj: Any,
    path: str | os.PathLike,
    *,
    format: str = "safetensors",  # the word transformers and torch use
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    progress: Any = None,
) -> str:
    """Write ``obj``'s values, exactly as ``materialize`` would give them, into directory ``path``.

    Deferred, partly materialized and real tensors alike: deferred ones are computed one at a
    time (only what each depends on, on every core, on the CPU: a tensor recorded for a GPU gets
    what ``materialize(device="cpu")`` gives it) and freed once written; real ones are written
    as they are now. Nothing in ``obj`` changes: deferred tensors stay deferred.

    Args:
        obj: a module (its ``state_dict()``) or a dict of tensors.
        path: the directory to write. ``format="safetensors"``: ``model.safetensors``, or
            shards and ``model.safetensors.index.json`` (transformers' ``save_pretrained``
            layout; for a transformers model also its ``config.json`` and
            ``generation_config.json``). ``format="dcp"``: a ``torch.distributed.checkpoint``.
        max_shard_size: ``"5GB"`` (decimal units, as transformers reads them) or bytes.
        dtype: cast floating-point tensors to this dtype (or its name, 'bf16') as they are
            written.
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)``; if it
            raises (to cancel), nothing is left at ``path`` and the exception propagates.

    Returns:
        ``path`` as a string.
    """
    if format not in _FORMATS:
        raise ValueError(f"format must be 'safetensors' or 'dcp', not {format!r}")
    dtype = parse_dtype(dtype)
    destination = os.fspath(path)
    if os.path.isfile(destination):
        raise NotADirectoryError(f"save() writes a directory; {destination} is a file")
    if format == "dcp":
        from jupyter_metainit.save.dcp import save_dcp  # torch.distributed loads only for dcp

        return save_dcp(obj, destination, dtype=dtype, progress=progress)
    state, origin = state_dict_of(obj)
    check_savable(state, sharded_ok=False)
    state = untie(state, origin, obj)
    state = _original_format(obj, state)
    total_parameters = _total_parameters(obj)
    layout = plan_layout(state, parse_size(max_shard_size), dtype, total_parameters)
    bar = Progress(progress, sum(e.nbytes for es in layout.files.values() for e in es))
    try:
        with staging_directory(destination) as staging:
            _write_transformers_files(obj, staging, dtype)
            write_safetensors_files(staging, layout.files, layout.tensors, dtype, bar)
            if layout.index is not None:
                _write_index(os.path.join(staging, INDEX_NAME), layout.index)
            publish_directory(staging, destination, stale=_is_shard_file)
    finally:
        bar.close()
    return destination


def _is_shard_file(name: str) -> bool:
    return name != WEIGHTS_NAME and _SHARD_FILE.fullmatch(name) is not None


def _write_index(path: str, index: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _is_transformers_model(obj: Any) -> bool:
    return (
        isinstance(obj, torch.nn.Module)
        and hasattr(obj, "config")
        and hasattr(obj, "save_pretrained")
    )


def _total_parameters(obj: Any) -> int | None:
    return obj.num_parameters() if _is_transformers_model(obj) else None


def _original_format(obj: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 keeps some weights converted in memory (a mixture of experts' experts
    fused into one tensor) and ``save_pretrained`` writes them back in the checkpoint's original
    layout: the same conversion here. On deferred tensors it is recorded (views, splits), not
    computed: each part is computed when it is written."""
    if not _is_transformers_model(obj):
        return state
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: nothing is converted in memory
        return state
    return revert_weight_conversion(obj, state)


def _write_transformers_files(obj: Any, directory: str, dtype: torch.dtype | None) -> None:
    """What ``save_pretrained`` writes besides the weights: ``config.json`` (with the saved dtype
    and the architecture, as it sets them) and ``generation_config.json``."""
    if not _is_transformers_model(obj):
        return
    saved_dtype = dtype if dtype is not None else obj.dtype
    obj.config.dtype = str(saved_dtype).split(".")[1]
    obj.config.architectures = [type(obj).__name__.removeprefix("FSDP")]
    obj.config.save_pretrained(directory)
    if obj.can_generate():
        obj.generation_config.save_pretrained(directory)


class _CallableModule(types.ModuleType):
    """``jupyter_metainit.save`` is this package and the function: importing the package
    (``import jupyter_metainit.save``) makes Python bind the package over the lazy function on
    ``jupyter_metainit``, so calling the package calls the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        return save(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
