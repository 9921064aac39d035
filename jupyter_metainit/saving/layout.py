"""Which tensors go into which file under which name: transformers' ``save_pretrained`` layout.

One ``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` shards split as
``huggingface_hub``'s ``split_state_dict_into_shards_factory`` splits them (in key order, a new
shard when the next tensor would pass ``max_shard_size``, a tensor larger than that alone) with
``model.safetensors.index.json``. Tied weights are written once, under the name transformers
keeps (its ``remove_tied_weights_from_state_dict``), so ``from_pretrained`` ties them again.

Files larger than the file system or the process takes (``ulimit -f``, FAT32's 4 GiB) are
refused before writing where the limit is known, and said as such where a write fails, with
the ``max_shard_size`` that fits (:func:`too_large_error`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from jupyter_metainit.core import format_bytes, no_values_reason, storage_of, tensor_state
from jupyter_metainit.core import parse_size as core_parse_size
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.saving.safetensors_file import FileEntry

__all__ = [
    "Layout",
    "check_savable",
    "file_names",
    "file_size_errors",
    "file_size_limit",
    "parse_size",
    "plan_layout",
    "refuse_files_over_the_limit",
    "state_dict_of",
    "too_large_error",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class Layout:
    """The files to write: file name -> entries (in key order), and name -> tensor."""

    files: dict[str, list[FileEntry]]
    tensors: dict[str, torch.Tensor]
    total_size: int  # as the index's metadata counts it: each storage once
    index: dict[str, Any] | None = field(default=None)


def file_names(variant: str | None = None) -> tuple[str, str]:
    """(weights file, index file) as ``save_pretrained(variant=...)`` names them (its
    ``_add_variant``): ``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``."""
    if variant is None:
        return WEIGHTS_NAME, INDEX_NAME
    return f"model.{variant}.safetensors", f"model.safetensors.index.{variant}.json"


def parse_size(size: int | str) -> int:
    """``"5GB"`` (decimal, as transformers reads it), ``"4GiB"`` or a number of bytes: the core's
    one size grammar."""
    return core_parse_size(size, "max_shard_size")


def state_dict_of(obj: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(name -> tensor to save, name -> the object it comes from, for tie detection)."""
    if isinstance(obj, torch.nn.Module):
        named: dict[str, torch.Tensor] = dict(obj.named_parameters(remove_duplicate=False))
        named.update(obj.named_buffers(remove_duplicate=False))
        state = obj.state_dict()
        ignore = getattr(obj, "_keys_to_ignore_on_save", None) or []
        for key in ignore:
            state.pop(key, None)
        return dict(state), {k: named.get(k, v) for k, v in state.items()}
    if isinstance(obj, dict):
        bad = next((k for k, v in obj.items() if not isinstance(v, torch.Tensor)), None)
        if bad is None:
            return dict(obj), dict(obj)
        raise ArgumentTypeError(
            f"save() takes a dict of tensors; {bad!r} holds {type(obj[bad]).__name__}: leave it "
            "out (or save a module). Nothing was written."
        )
    raise ArgumentTypeError(
        f"save() takes a module or a dict of tensors (a state dict), not {type(obj).__name__}"
    )


def check_savable(state: dict[str, torch.Tensor], sharded_ok: bool) -> None:
    """Refuse, before anything is written, tensors that have no values to write: on PyTorch's
    meta device (no recording), a lazy module's uninitialized parameters; and, for one-file
    formats, sharded tensors (each rank holds a part)."""
    for name, t in state.items():
        reason = no_values_reason(name, tensor_state(t), "save")
        if reason is not None:
            raise ArgumentError(reason)
        if not sharded_ok and hasattr(t, "device_mesh"):
            raise ArgumentTypeError(
                f"{name} is sharded (a DTensor); save a sharded model with format='dcp', where "
                "each rank writes its own shards"
            )


def _same_region(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two tensors over the same memory (``storage_of``'s key) covering the same elements."""
    return (a.storage_offset(), a.shape, a.stride(), a.dtype) == (
        b.storage_offset(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def untie(
    state: dict[str, torch.Tensor], origin: dict[str, torch.Tensor], obj: Any
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop the duplicate names of tensors that are the same memory, keeping the name
    transformers keeps (the name its ``_tied_weights_keys`` does not claim), else the first
    in sorted order (safetensors' ``save_model``); and each dropped name -> the name kept
    (``save_model`` writes it in the file's metadata). Different regions of one memory (views)
    are written separately, as transformers clones them."""
    groups: dict[Any, list[str]] = defaultdict(list)
    for name, t in origin.items():
        groups[storage_of(t)[0]].append(name)
    tied_patterns = _tied_patterns(obj)
    drop: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        for first in sorted(names):
            same = [n for n in names if n != first and _same_region(origin[n], origin[first])]
            if not same or first in drop:
                continue
            group = sorted([first, *same])
            claimed = [n for n in group if any(re.search(p, n) for p in tied_patterns)]
            keep = next((n for n in group if n not in claimed), group[0])
            drop.update({n: keep for n in group if n != keep})
    return {k: v for k, v in state.items() if k not in drop}, drop


def _tied_patterns(obj: Any) -> list[str]:
    """transformers' ``_get_tied_weight_keys``: every submodule's ``_tied_weights_keys``."""
    if not isinstance(obj, torch.nn.Module):
        return []
    patterns: list[str] = []
    for name, module in obj.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns.extend(f"{name}.{k}" if name else k for k in tied)
    return patterns


def plan_layout(
    state: dict[str, torch.Tensor],
    max_shard_size: int,
    dtype: torch.dtype | None,
    total_parameters: int | None,
    weights_name: str = WEIGHTS_NAME,
) -> Layout:
    """Split ``state`` into shard files as huggingface_hub's ``split_state_dict_into_shards_
    factory`` does: in key order, counting each storage once at its full size, the tensors that
    share a storage in the shard of the first of them. One file is ``weights_name``; shards are
    named after it (``model-00001-of-00002.safetensors``, ``model.fp16-00001-of-00002...``)."""
    entries = {k: _entry(k, t, dtype) for k, t in state.items()}
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    sharing: dict[object, list[str]] = {}
    for name, t in state.items():
        key, storage_bytes = storage_of(t)
        if key in sharing:
            sharing[key].append(name)
            continue
        sharing[key] = [name]
        size = _saved_size(storage_bytes, t, dtype)
        total += size
        if size > max_shard_size:
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    for names in sharing.values():
        shard = next(s for s in shards if names[0] in s)
        shard.extend(n for n in names[1:] if n not in shard)
    if len(shards) <= 1:
        return Layout(
            {weights_name: [entries[n] for n in (shards[0] if shards else [])]}, state, total
        )
    count = len(shards)
    stem = weights_name.removesuffix(".safetensors")
    files = {
        f"{stem}-{k + 1:05d}-of-{count:05d}.safetensors": [entries[n] for n in names]
        for k, names in enumerate(shards)
    }
    metadata: dict[str, Any] = {"total_size": total}
    if total_parameters is not None:
        metadata = {"total_parameters": total_parameters, **metadata}
    weight_map = {e.name: name for name, shard in files.items() for e in shard}
    index = {"metadata": metadata, "weight_map": weight_map}
    return Layout(files, state, total, index)


def _saved_size(storage_bytes: int, t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """The storage's bytes as huggingface_hub counts them, in ``dtype`` if it casts ``t``."""
    if dtype is None or not t.is_floating_point():
        return storage_bytes
    return storage_bytes // t.dtype.itemsize * dtype.itemsize


def _entry(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> FileEntry:
    saved = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return FileEntry(name, saved, tuple(t.shape))


def file_size_limit() -> int | None:
    """The largest file this process may write (``ulimit -f``: RLIMIT_FSIZE), None where
    unlimited. A write past it fails with EFBIG: Python ignores the SIGXFSZ it also sends."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def refuse_files_over_the_limit(sizes: dict[str, int], largest: tuple[str, int]) -> None:
    """Refuse, before anything is written, files (name -> bytes, planned) larger than this
    process may write; ``largest``: the largest tensor (name, bytes), which no file can split."""
    limit = file_size_limit()
    name, size = max(sizes.items(), key=lambda item: item[1], default=("", 0))
    if limit is not None and size > limit:
        raise too_large_error(
            f"this process may write files of at most {format_bytes(limit)} (ulimit -f); "
            f"{name} would be {format_bytes(size)}",
            limit,
            largest,
        )


@contextmanager
def file_size_errors(
    staging: str, sizes: dict[str, int], largest: tuple[str, int]
) -> Iterator[None]:
    """A write refused for its file's size (EFBIG: a file system's largest file, FAT32's
    4 GiB) said as :func:`too_large_error`, with the size the file system stopped a file at
    (the largest file in ``staging``, of those in ``sizes``)."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EFBIG:
            raise
        reached = {}
        for name in sizes:
            with contextlib.suppress(OSError):
                reached[name] = os.path.getsize(os.path.join(staging, name))
        name, stopped = max(reached.items(), key=lambda item: item[1], default=("", 0))
        limit = file_size_limit()
        if limit is not None and (not stopped or limit < stopped):
            stopped = limit
        if not stopped:  # refused before it grew: no more known than the largest planned file
            name, planned = max(sizes.items(), key=lambda item: item[1])
            cause = f"it refused {name}, {format_bytes(planned)}"
            stopped = planned // 2
        else:
            cause = f"it stopped {name} at {format_bytes(stopped)}"
        raise too_large_error(cause, stopped, largest) from None


def too_large_error(cause: str, cap: int, largest: tuple[str, int]) -> OSError:
    """What a save says when its files are larger than the file system (or the process) takes:
    the ``max_shard_size`` that fits ``cap`` bytes, or why none does."""
    name, nbytes = largest
    room = cap - min(cap // 10, 64 << 20)  # a file's header (and DCP's framing) beside its tensors
    if nbytes > room:
        advice = (
            f"no max_shard_size helps: {name} alone is {format_bytes(nbytes)}; save to a file "
            "system that takes larger files (or raise the limit)"
        )
    else:
        advice = f"use max_shard_size={_round_size(room)!r}"
    return OSError(
        errno.EFBIG,
        f"file too large for this file system ({cause}); {advice}. Nothing was saved",
    )


def _round_size(nbytes: int) -> str:
    """``nbytes`` rounded down to two digits in decimal units, as ``max_shard_size`` reads them
    (``"3.8GB"``)."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= factor:
            value = nbytes / factor
            digits = 1 if value < 10 else 0
            scale = 10**digits
            text = f"{int(value * scale) / scale:.{digits}f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return f"{nbytes}B"
