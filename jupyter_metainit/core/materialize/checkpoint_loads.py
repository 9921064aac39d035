"""Load real weights for deferred tensors from ``.safetensors`` files instead of replaying init.

Only the tensors asked for are read, memory-mapped by ``safetensors``; a sharded set is read
through its index JSON (``model.safetensors.index.json``), opening only the shards it needs.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError, MaterializationError
from jupyter_metainit.core.materialize import shadows
from jupyter_metainit.core.materialize.walk import named_tensors
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.arguments import parse_path
from jupyter_metainit.core.runtime.interrupts import copy_in_steps
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["load_for", "load_reals_in_place"]


_WHAT = "a .safetensors file, a sharded set's index JSON, or a list of them"


def _paths(checkpoint: Any) -> list[str]:
    if isinstance(checkpoint, (str, bytes, os.PathLike)):
        items = [checkpoint]
    elif isinstance(checkpoint, (list, tuple)):
        items = list(checkpoint)
    else:
        raise ArgumentTypeError(f"checkpoint= takes {_WHAT}; got {type(checkpoint).__name__}")
    if not items:
        raise ArgumentError(f"checkpoint= is empty; give {_WHAT}")
    paths = []
    for item in items:
        if not isinstance(item, (str, bytes, os.PathLike)):
            raise ArgumentTypeError(
                f"checkpoint= takes {_WHAT}; got {type(item).__name__} in the list"
            )
        path = parse_path(item, "checkpoint=")
        if os.path.isdir(path):
            found = sorted(
                f for f in os.listdir(path) if f.endswith((".safetensors", ".index.json"))
            )
            hint = f" (it holds {', '.join(found[:3])})" if found else ""
            raise IsADirectoryError(
                f"checkpoint= {path!r} is a directory; give the .safetensors file or the "
                f"model.safetensors.index.json inside it{hint}"
            )
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        if not os.access(path, os.R_OK):
            raise PermissionError(f"checkpoint file is not readable: {path}")
        paths.append(path)
    return paths


def _key_to_file(checkpoint: Any) -> dict[str, str]:
    from safetensors import safe_open

    mapping: dict[str, str] = {}
    for p in _paths(checkpoint):
        if p.endswith(".json"):
            try:
                with open(p) as f:
                    index = json.load(f)
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                raise MaterializationError(
                    f'{p} is not a sharded checkpoint\'s index: it needs a "weight_map" object '
                    "mapping tensor names to .safetensors files (as "
                    "model.safetensors.index.json has)"
                ) from None
            base = os.path.dirname(p)
            for key, fname in weight_map.items():
                if not isinstance(fname, str) or not fname:
                    raise MaterializationError(
                        f'{p}: "weight_map" gives {fname!r} as the file of {key!r}; each entry '
                        "must name a .safetensors file next to the index (a string such as "
                        '"model-00001-of-00002.safetensors")'
                    )
                mapping[key] = os.path.join(base, fname)
        else:
            try:
                with safe_open(p, framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        mapping[key] = p
            except Exception as e:
                raise MaterializationError(
                    f"{p} cannot be read as a .safetensors file ({e})"
                ) from None
    return mapping


def _names(obj: Any, tensors: list[DeferredTensor]) -> dict[int, list[str]]:
    """Qualified names (relative to ``obj``) of each requested tensor; tied ones have several."""
    names: dict[int, list[str]] = {id(t): [] for t in tensors}
    if isinstance(obj, torch.nn.Module):
        for mname, (tname, t, _) in named_tensors(obj):
            if id(t) in names:
                names[id(t)].append(f"{mname}.{tname}" if mname else tname)
    return names


def _attribute_ids(module: torch.nn.Module) -> set[int]:
    """Tensors ``module``'s tree keeps as plain attributes (also in containers)."""
    return {
        id(own.tensor)
        for _, own in named_tensors(module, attributes=True)
        if own.kind == "attribute"
    }


def _infer_prefix(names: dict[int, list[str]], keys: set[str]) -> str:
    """The prefix under which a submodule's names appear in a whole-model checkpoint."""
    candidates: dict[str, int] = {}
    for ns in names.values():
        for n in ns:
            if n in keys:
                candidates[""] = candidates.get("", 0) + 1
                continue
            suffix = "." + n
            for k in keys:
                if k.endswith(suffix):
                    p = k[: -len(n)]
                    candidates[p] = candidates.get(p, 0) + 1
    if not candidates:
        return ""
    best = max(candidates.values())
    winners = [p for p, c in candidates.items() if c == best]
    if len(winners) > 1:
        raise MaterializationError(
            f"cannot tell which part of the checkpoint this module is: prefixes {winners[:4]} all "
            "match; pass root=<the whole model> so that the part's qualified names are known"
        )
    return winners[0]


def load_for(
    obj: Any,
    tensors: list[DeferredTensor],
    checkpoint: Any,
    device: torch.device | None,
    missing: str,
    dtype: torch.dtype | None = None,
    root: torch.nn.Module | None = None,
    file_reads: dict[int, DeferredTensor] | None = None,
) -> dict[int, torch.Tensor]:
    """Real tensors for ``tensors`` (by ``id``) read from ``checkpoint``.

    Tensors absent from the checkpoint raise unless ``missing="init"`` (then they are left out of
    the result and replayed from their recorded initialisation). With ``file_reads``, it also
    gets, per tensor, a deferred recording of the read (what ``dematerialize`` keeps, so that
    materializing again reads the file again).
    """
    if not isinstance(obj, torch.nn.Module) and root is None:
        raise ArgumentTypeError(
            "checkpoint= needs a module, or root=<the whole model> (names come from the tree)"
        )
    files = _key_to_file(checkpoint)
    if root is not None and root is not obj:
        names, prefix = _names(root, tensors), ""
        attributes = _attribute_ids(root)
        unnamed = [t for t in tensors if not names[id(t)] and id(t) not in attributes]
        if unnamed:
            raise MaterializationError(
                f"root= does not contain what is being materialized ({len(unnamed)} of its "
                "tensors are not parameters or buffers of root); pass the whole model the part "
                "belongs to"
            )
    else:
        names = _names(obj, tensors)
        attributes = _attribute_ids(obj) if isinstance(obj, torch.nn.Module) else set()
        prefix = _infer_prefix(names, set(files))
    wanted: dict[int, str] = {}
    absent: list[str] = []
    for t in tensors:
        if not names[id(t)] and id(t) in attributes:
            # A tensor kept as a plain attribute (``self.freqs``, ``self.tables["k"]``) is in no
            # state dict, so in no checkpoint: as after ``load_state_dict``, it keeps its init.
            continue
        hit = next((prefix + n for n in names[id(t)] if prefix + n in files), None)
        if hit is None:
            absent.extend(names[id(t)][:1] or ["<unnamed tensor>"])
        else:
            wanted[id(t)] = hit
    if absent and missing == "error":
        raise MaterializationError(
            f"{len(absent)} tensor(s) are not in the checkpoint, e.g. {absent[:3]}; pass "
            "missing='init' to use their recorded initialisation instead"
        )
    by_file: dict[str, list[DeferredTensor]] = {}
    for t in tensors:
        if id(t) in wanted:
            by_file.setdefault(files[wanted[id(t)]], []).append(t)
    out: dict[int, torch.Tensor] = {}
    read: list[tuple[torch.Tensor, str, str, torch.Tensor]] = []
    with plain():
        for path, ts in by_file.items():
            with _opened(path, checkpoint) as f:
                for t in ts:
                    key = wanted[id(t)]
                    sl = _reading(path, key, f.get_slice)
                    shape = tuple(sl.get_shape())
                    if shape != tuple(t.shape):
                        raise MaterializationError(
                            f"{key}: checkpoint shape {shape} does not match the model's "
                            f"{tuple(t.shape)}"
                        )
                    value = _reading(path, key, f.get_tensor)
                    if value.dtype not in (t.dtype, dtype):
                        raise MaterializationError(
                            f"{key}: checkpoint dtype {value.dtype} does not match the model's "
                            f"{t.dtype}; build the model in that dtype (meta_init(dtype=...)) or "
                            "convert it first (model.to(dtype))"
                        )
                    target = device or t.device
                    real = torch.empty_strided(
                        t.shape, t.stride(), dtype=value.dtype, device=target
                    )
                    copy_in_steps(real, value)  # reads the file: told, may be cancelled
                    out[id(t)] = real
                    read.append((t, path, key, real))
    if file_reads is not None:
        for t, path, key, real in read:
            # An already-real tensor keeps its own dtype and geometry (the value is copied in).
            like = real if isinstance(t, DeferredTensor) else t
            file_reads[id(t)] = _recorded_read(path, key, like)
    return out


@contextlib.contextmanager
def _opened(path: str, checkpoint: Any) -> Iterator[Any]:
    """``safe_open(path)``; a missing or corrupt file (a shard an index names) is a clear error
    that names it."""
    from safetensors import safe_open

    listed = "" if _is_listed(path, checkpoint) else " (a shard listed in the index JSON)"
    try:
        f = safe_open(path, framework="pt", device="cpu")
    except FileNotFoundError:
        raise MaterializationError(f"checkpoint file not found: {path}{listed}") from None
    except Exception as e:
        raise MaterializationError(
            f"{path}{listed} cannot be read as a .safetensors file ({e}); it may be corrupt "
            "or truncated. Nothing was materialized."
        ) from None
    with f:
        yield f


def _is_listed(path: str, checkpoint: Any) -> bool:
    items = checkpoint if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    return any(os.fsdecode(os.fspath(x)) == path for x in items)


def _reading(path: str, key: str, read: Any) -> Any:
    try:
        return read(key)
    except Exception as e:
        raise MaterializationError(
            f"{path}: tensor {key!r} cannot be read ({e}); the file may be corrupt or "
            "truncated. Nothing was materialized."
        ) from None


def _recorded_read(path: str, key: str, like: torch.Tensor) -> DeferredTensor:
    """A deferred tensor whose recording is "read ``key`` from ``path``", converted to
    ``like``'s dtype, device and strides: what materializing it gives is what was loaded."""
    from safetensors import safe_open

    from jupyter_metainit.core.record.context import meta_init

    with meta_init(), safe_open(path, framework="pt") as f:
        stored = f.get_tensor(key)
        if (stored.dtype, stored.device, stored.stride()) == (
            like.dtype,
            like.device,
            like.stride(),
        ):
            return stored
        out = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
        out.copy_(stored)
        return out


def load_reals_in_place(
    reals: list[torch.Tensor],
    loaded: dict[int, torch.Tensor],
    file_reads: dict[int, DeferredTensor],
) -> None:
    """Copy checkpoint values into the parts that were real already (same tensor objects)."""
    with torch.no_grad():
        for t in reals:
            if id(t) in loaded:
                value = loaded[id(t)]
                t.copy_(value if value.dtype == t.dtype else value.to(t.dtype))
                shadows.sources[t] = "checkpoint"
                if id(t) in file_reads:  # freeing it gives the checkpoint's values again
                    shadows.kept[t] = shadows.Shadow(
                        file_reads[id(t)], shadows.version_of(t), t.data_ptr(), None
                    )
