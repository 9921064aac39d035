"""A checkpoint in transformers' ``save_pretrained`` layout: what ``save(format="safetensors")``
and a deferred model's ``save_pretrained`` write.

Everything that can be refused is refused before the first byte is written; the files (weights,
index, ``config.json``, ``generation_config.json``) are written into a staging directory and put
in place only when all are complete (``saving.staging``).
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core import in_file_layout
from jupyter_metainit.saving.layout import (
    INDEX_NAME,
    WEIGHTS_NAME,
    Layout,
    check_savable,
    file_size_errors,
    parse_size,
    plan_layout,
    refuse_files_over_the_limit,
    untie,
)
from jupyter_metainit.saving.safetensors_file import file_order, header_bytes
from jupyter_metainit.saving.staging import (
    no_space_error,
    publish_directory,
    refuse_overwriting_sources,
    staging_directory,
)
from jupyter_metainit.saving.writer import Progress, write_safetensors_files

__all__ = ["mark_config", "write_checkpoint"]

_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def write_checkpoint(
    obj: Any,
    state: dict[str, torch.Tensor],
    origin: dict[str, torch.Tensor],
    destination: str,
    *,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    progress: Any,
    names: tuple[str, str] = (WEIGHTS_NAME, INDEX_NAME),
    original_format: bool = True,
    stale: Callable[[str], bool] | None = None,
    code_files: Callable[[str], Any] | None = None,
) -> str:
    """Write ``state`` (``origin``: the objects its tensors come from, to find tied weights) of
    ``obj`` (a transformers model, a module or a dict) into ``destination``.

    ``names``: the weights and index file names (``layout.file_names``); ``original_format``:
    write transformers' in-memory conversions back in the checkpoint's layout
    (``save_original_format``); ``stale``: which files already in ``destination`` and not
    rewritten are removed (default: earlier shards and index of this layout); ``code_files``:
    writes a custom model's code into the directory it is given, before the config.
    """
    weights_name, index_name = names
    check_savable(state, sharded_ok=False)
    state, aliases = untie(state, origin, obj)
    if is_transformers_model(obj):  # transformers names its ties in code, not in the file
        aliases = {}
    if original_format:
        state = _original_format(obj, state)
    layout = plan_layout(
        state, parse_size(max_shard_size), dtype, _total_parameters(obj), weights_name
    )
    stale = stale or _is_shard_file
    refuse_overwriting_sources(state, destination, written=layout.files, stale=stale)
    sizes, largest = _file_sizes(layout)
    refuse_files_over_the_limit(sizes, largest)
    total = sum(e.nbytes for es in layout.files.values() for e in es)
    bar: Progress | None = None
    try:
        with staging_directory(destination) as staging:
            bar = Progress(progress, total)  # once there is somewhere to write
            if code_files is not None:
                code_files(staging)
            _write_transformers_files(obj, staging, dtype)
            with file_size_errors(staging, sizes, largest):
                write_safetensors_files(
                    staging, layout.files, layout.tensors, dtype, bar, aliases=aliases
                )
            if layout.index is not None:
                _write_index(os.path.join(staging, index_name), layout.index)
            publish_directory(staging, destination, stale=stale)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise no_space_error(destination, total) from None
    finally:
        if bar is not None:
            bar.close()
    return destination


def _file_sizes(layout: Layout) -> tuple[dict[str, int], tuple[str, int]]:
    """Each file's bytes (header and tensors) and the largest tensor (name, bytes)."""
    sizes = {
        name: len(header_bytes(file_order(entries), {"format": "pt"}))
        + sum(e.nbytes for e in entries)
        for name, entries in layout.files.items()
    }
    entries = [e for es in layout.files.values() for e in es]
    big = max(entries, key=lambda e: e.nbytes, default=None)
    return sizes, (big.name, big.nbytes) if big is not None else ("", 0)


def _is_shard_file(name: str) -> bool:
    """A file of an earlier save in this layout: its shards and index, or its single file (a
    sharded save leaves no ``model.safetensors`` that ``from_pretrained`` would load instead)."""
    return _SHARD_FILE.fullmatch(name) is not None


def _write_index(path: str, index: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def is_transformers_model(obj: Any) -> bool:
    """A ``transformers`` model (told by its face, so transformers is never imported here)."""
    return (
        isinstance(obj, torch.nn.Module)
        and hasattr(obj, "config")
        and hasattr(obj, "save_pretrained")
    )


def _total_parameters(obj: Any) -> int | None:
    return obj.num_parameters() if is_transformers_model(obj) else None


def _original_format(obj: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5 keeps some weights converted in memory (a mixture of experts' experts
    fused into one tensor) and ``save_pretrained`` writes them back in the checkpoint's original
    layout: the same conversion here. On deferred tensors it is recorded (views, splits), not
    computed: each part is computed when it is written."""
    if not is_transformers_model(obj):
        return state
    converted = in_file_layout(obj, state)
    return state if converted is None else converted


def _write_transformers_files(obj: Any, directory: str, dtype: torch.dtype | None) -> None:
    """What ``save_pretrained`` writes besides the weights: ``config.json`` (with the saved dtype
    and the architecture, as it sets them) and ``generation_config.json``."""
    if not is_transformers_model(obj):
        return
    mark_config(obj, dtype if dtype is not None else obj.dtype)
    obj.config.save_pretrained(directory)
    if obj.can_generate():
        obj.generation_config.save_pretrained(directory)


def mark_config(model: Any, dtype: torch.dtype) -> None:
    """The dtype and architecture eager ``save_pretrained`` sets on the config (on every rank,
    whether it writes or not)."""
    model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
