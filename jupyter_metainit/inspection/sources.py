"""What ``stats`` and ``compare`` read: named tensors, each read once, a batch at a time.

A model (its ``state_dict``) or a dict of tensors is read through the core's ``values_to_write``
for its deferred tensors: the values ``materialize`` would give (exact mode), computed on every
core, read from the checkpoint files for a model opened with ``from_pretrained`` under
``meta_init``; nothing in the model changes. Real tensors are read as they are now (a GPU's
copied to the CPU). A checkpoint path is read directly: a safetensors file (or the shards of an
index) a batch of tensors at a time from a mapping of the file (no copy), a
``torch.distributed.checkpoint`` directory with ``dcp.load``. Names that are the same tensor
(tied weights) are read once, under the first name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from jupyter_metainit.core import (
    DeferredTensor,
    local_tensor,
    no_values_reason,
    parse_path,
    storage_of,
    tensor_state,
    values_to_write,
)
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["Entry", "Source", "open_source"]

Memory = Callable[[int], torch.UntypedStorage]


@dataclass(frozen=True)
class Entry:
    """One tensor to read: its first name, shape and dtype (its values come later)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Source:
    """Named tensors and how to read a batch of them.

    ``entries``: one per distinct tensor, under its first name, in reading order; ``names``:
    every name, in order, -> the entry's name it is read under (itself, or the tensor it is
    tied to). :meth:`read` gives contiguous CPU values of a batch of entries.
    """

    def __init__(self, entries: list[Entry], names: dict[str, str]) -> None:
        self.entries = {e.name: e for e in entries}
        self.names = names

    def read(self, batch: list[Entry], memory: Memory) -> list[torch.Tensor]:
        raise NotImplementedError


class TensorSource(Source):
    """A dict of tensors: deferred, real (any device), or a mix."""

    def __init__(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        first: dict[Hashable, str] = {}
        names: dict[str, str] = {}
        entries: list[Entry] = []
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(
                    f"{what} takes a dict of tensors; {name!r} holds {type(t).__name__}: leave "
                    "it out, or pass the module"
                )
            reason = no_values_reason(name, tensor_state(t), "read")
            if reason is not None:
                raise ArgumentError(reason)
            local = local_tensor(t)
            key = _region(local)
            names[name] = first.setdefault(key, name)
            if names[name] == name:
                entries.append(Entry(name, tuple(local.shape), local.dtype))
        super().__init__(entries, names)
        self.tensors = {e.name: local_tensor(tensors[e.name]) for e in entries}

    def read(self, batch: list[Entry], memory: Memory) -> list[torch.Tensor]:
        tensors = [self.tensors[e.name] for e in batch]
        deferred = [j for j, t in enumerate(tensors) if isinstance(t, DeferredTensor)]
        out = [_real_values(t) if not isinstance(t, DeferredTensor) else t for t in tensors]
        if deferred:
            values = values_to_write([tensors[j] for j in deferred], memory)
            for j, v in zip(deferred, values, strict=True):
                out[j] = v.contiguous()
        return out


def _region(t: torch.Tensor) -> Hashable:
    """The same memory and the same elements: one tensor under two names (a tied weight)."""
    return (storage_of(t)[0], t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _real_values(t: torch.Tensor) -> torch.Tensor:
    """A real tensor's values as a contiguous CPU tensor (no copy when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


class DcpSource(Source):
    """A ``torch.distributed.checkpoint`` directory, read a batch of tensors at a time."""

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        tensors = {k: m for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
        entries = [Entry(k, tuple(m.size), m.properties.dtype) for k, m in tensors.items()]
        entries.sort(key=lambda e: _natural(e.name))
        super().__init__(entries, {e.name: e.name for e in entries})

    def read(self, batch: list[Entry], memory: Memory) -> list[torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        state = {}
        for e in batch:
            state[e.name] = torch.empty(0, dtype=e.dtype).set_(memory(e.nbytes), 0, e.shape)
        with warnings.catch_warnings():  # one process reading: what no_dist says
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=FileSystemReader(self.path), no_dist=True)
        return [state[e.name] for e in batch]


_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> list[Any]:
    """``layers.2`` before ``layers.10``: a file's names in the model's order, near enough."""
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(name)]


def _safetensors_files(path: str) -> list[str] | None:
    """The safetensors files of ``path`` (a file, an index JSON, or a directory holding
    either); None when it holds none."""
    if os.path.isfile(path):
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
            folder = os.path.dirname(path)
            return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]
        return [path]
    found = sorted(os.listdir(path))
    indexes = [f for f in found if f.endswith(".safetensors.index.json")]
    if indexes:
        return _safetensors_files(os.path.join(path, indexes[0]))
    files = [os.path.join(path, f) for f in found if f.endswith(".safetensors")]
    return files or None


def _open_path(path: str, what: str, as_given: str) -> Source:
    if not os.path.exists(path):
        expanded = f" ({path})" if path != as_given else ""
        raise FileNotFoundError(f"{what}: no such file or directory: {as_given!r}{expanded}")
    if os.path.isdir(path) and os.path.exists(os.path.join(path, ".metadata")):
        return DcpSource(path)
    files = _safetensors_files(path)
    if files is None:
        raise ArgumentError(
            f"{what}: {path!r} holds no checkpoint: give a .safetensors file, a sharded "
            "checkpoint's index JSON or its directory, or a torch.distributed.checkpoint "
            "directory"
        )
    return SafetensorsSource(files)


# safetensors' dtype names -> torch's (the sub-byte and packed ones have no statistics here).
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
}


class SafetensorsSource(Source):
    """Safetensors files, each batch's tensors taken from a mapping of their file opened for
    that batch (no copy; the pages are the page cache's, and leave this process's memory with
    the batch)."""

    def __init__(self, files: list[str]) -> None:

        self.file_of: dict[str, str] = {}
        entries = []
        for file in files:
            with _opened(file) as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    part = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
                    if dtype is None:
                        raise ArgumentTypeError(
                            f"{name} in {file} is {part.get_dtype()}, which stats and compare "
                            f"do not read (they read {', '.join(_SAFETENSORS_DTYPES)})"
                        )
                    entries.append(Entry(name, tuple(part.get_shape()), dtype))
                    self.file_of[name] = file
        entries.sort(key=lambda e: _natural(e.name))
        super().__init__(entries, {e.name: e.name for e in entries})

    def read(self, batch: list[Entry], memory: Memory) -> list[torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for e in batch:
            by_file.setdefault(self.file_of[e.name], []).append(e.name)
        values: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                values.update((name, f.get_tensor(name)) for name in names)
        return [values[e.name].contiguous() for e in batch]


@contextlib.contextmanager
def _opened(file: str) -> Iterator[Any]:
    """``safe_open`` of a file named in the error if it is no safetensors file (safetensors
    says only "header too small" or "invalid header")."""
    from safetensors import safe_open

    try:
        handle = safe_open(file, framework="pt")
    except Exception as exc:  # SafetensorError, OSError: the file, not the caller's code
        raise ArgumentError(
            f"{file!r} is not a readable safetensors file ({exc}); give a file written by "
            "safetensors (save_pretrained, jupyter_metainit.save), or its checkpoint directory"
        ) from None
    with handle as f:
        yield f


def open_source(obj: Any, what: str) -> Source:
    """``obj`` (a module, a dict of tensors, or a checkpoint path) as a :class:`Source`; ``what``
    names the argument in messages (``"stats()"``, ``"compare(): b"``)."""
    if isinstance(obj, torch.nn.Module):
        # The tensors themselves (state_dict's names, ties and persistence rules): a plain
        # state_dict() would record a detach of each on a deferred model, 0.3 ms a tensor.
        return TensorSource(dict(obj.state_dict(keep_vars=True)), what)
    if isinstance(obj, dict):
        return TensorSource(dict(obj), what)
    if isinstance(obj, (str, os.PathLike)):
        path = parse_path(obj, what if ":" in what else f"{what}: path")
        return _open_path(path, what, os.fspath(obj))
    raise ArgumentTypeError(
        f"{what} takes a module, a dict of tensors (a state dict) or a checkpoint path (a "
        f"safetensors file or directory, a DCP directory); got {type(obj).__name__}"
    )
