"""``save``: write the values ``materialize`` would give to a checkpoint, in bounded memory.

A layer beside ``distributed``: it reads deferred tensors through the core's public face and
never changes them. Use it to make the checkpoint nobody can allocate (a seed checkpoint of a
70 B model from one machine), or to save a partly materialized model without materializing the
rest. ``format="safetensors"`` writes transformers' layout (``from_pretrained`` loads it);
``format="dcp"`` writes ``torch.distributed.checkpoint``'s (``dcp.load`` into any sharding).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from jupyter_metainit.core import check_progress, parse_dtype, parse_path
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.saving.layout import parse_size, state_dict_of
from jupyter_metainit.saving.safetensors_checkpoint import write_checkpoint
from jupyter_metainit.saving.staging import checked_destination

__all__ = ["save"]

_FORMATS = ("safetensors", "dcp")


def save(
    obj: torch.nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    format: Literal["safetensors", "dcp"] = "safetensors",  # the word transformers and torch use
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | str | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> str:
    """Write ``obj``'s values, exactly as ``materialize`` would give them, into directory ``path``.

    Use it to make the checkpoint nobody can allocate (a seed checkpoint of a 70 B model from
    one machine), or to save a partly materialized model without materializing the rest.
    Deferred, partly materialized and real tensors alike: deferred ones are computed a batch
    at a time (only what each depends on, on every core, on the CPU: a tensor recorded for a
    GPU gets what ``materialize(device="cpu")`` gives it) and freed once written, so memory
    follows the largest tensor, not the model; real ones are written as they are now. Nothing
    in ``obj`` changes: deferred tensors stay deferred. Everything is written into a hidden
    directory inside ``path`` and moved into place at the end: a failed or cancelled save
    leaves no checkpoint behind, and an earlier checkpoint's files there are replaced, your
    other files kept.

    Args:
        obj: a module (its ``state_dict()``) or a dict of tensors.
        path: the directory to write (``~`` is your home directory, as in the widget's Save…
            and ``%save``).
        format: ``"safetensors"``: ``model.safetensors``, or shards and
            ``model.safetensors.index.json`` (transformers' ``save_pretrained`` layout, tied
            weights once; for a transformers model also its ``config.json`` and
            ``generation_config.json``, so ``from_pretrained`` loads it). ``"dcp"``: a
            ``torch.distributed.checkpoint``, one file per rank (``dcp.load`` reads it into
            any sharding).
        max_shard_size: the most tensor bytes in one file: ``"5GB"`` (decimal units, as
            transformers reads them), ``"4GiB"`` or bytes. Default: 5GB shards for
            safetensors (transformers' default), one file per rank for dcp (torch's default).
            A file system (or ``ulimit -f``) that takes smaller files is said as such, with
            the size to use.
        dtype: cast floating-point tensors to this dtype (or its name, ``"bf16"``) as they
            are written.
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)``; if it
            raises (to cancel), nothing is left at ``path`` and the exception propagates.

    Returns:
        ``path`` as a string, ``~`` expanded.

    Raises:
        ArgumentError: an unknown ``format``, a ``dtype`` that is not floating, a
            ``max_shard_size`` that is not a size, an empty ``path``.
        ArgumentTypeError: ``obj`` is neither a module nor a dict of tensors.
        MetaInitError: the save would replace the files deferred tensors being saved are
            still read from (a model opened with ``from_pretrained`` from ``path``); nothing
            was written.
        OSError: the disk is full or a file is too large for the file system (said with the
            ``max_shard_size`` to use); nothing is left behind.

    Examples:
        >>> import os, tempfile
        >>> import torch
        >>> from torch import nn
        >>> from safetensors.torch import load_file
        >>> from jupyter_metainit import is_deferred, materialize, meta_init, save
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     _ = save(model, directory)  # computed a batch at a time, never all in memory
        ...     files = sorted(os.listdir(directory))
        ...     saved = load_file(os.path.join(directory, "model.safetensors"))
        >>> files
        ['model.safetensors']
        >>> is_deferred(model)  # saving changed nothing
        True
        >>> _ = materialize(model)
        >>> torch.equal(saved["0.weight"], model[0].weight)  # what materialize gives
        True
    """
    if not isinstance(format, str):
        raise ArgumentTypeError(f"format takes 'safetensors' or 'dcp', not {format!r}")
    if format not in _FORMATS:
        raise ArgumentError(f"format must be 'safetensors' or 'dcp', not {format!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"save(path=...) takes the directory to write (a str or os.PathLike), not {path!r}"
        )
    check_progress(progress)
    dtype = parse_dtype(dtype)
    if dtype is not None and not dtype.is_floating_point:
        raise ArgumentError(
            f"dtype= casts floating-point tensors to another floating-point dtype (bfloat16, "
            f"float16, float32, ...); {dtype} is not one. Nothing was written."
        )
    destination = checked_destination(parse_path(path, "path"))
    if format == "dcp":
        from jupyter_metainit.saving.dcp import save_dcp  # torch.distributed loads only for dcp

        max_file_bytes = None if max_shard_size is None else parse_size(max_shard_size)
        return save_dcp(
            obj, destination, dtype=dtype, progress=progress, max_file_bytes=max_file_bytes
        )
    state, origin = state_dict_of(obj)
    return write_checkpoint(
        obj,
        state,
        origin,
        destination,
        max_shard_size=max_shard_size or "5GB",
        dtype=dtype,
        progress=progress,
    )
