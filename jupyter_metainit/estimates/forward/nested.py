"""Walks over a forward pass's nested inputs and outputs (tuples, lists, dicts, ModelOutput).

Every part of a dry run that looks for tensors or generators in what a model takes or
returns uses these, so they all see the same things.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from jupyter_metainit.core import ATEN_SCALAR_TYPES

__all__ = [
    "cache_of",
    "generators_in",
    "is_shape",
    "map_tensors",
    "nested",
    "op_tensors",
    "tensor_bytes",
    "tensor_bytes_in",
    "tensors_in",
]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


def nested(obj: Any, kind: type) -> Iterator[Any]:
    """Instances of ``kind`` in nested lists, tuples and mappings (transformers' ModelOutput)."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from nested(item, kind)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from nested(item, kind)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in nested outputs (tuples, lists, dicts, transformers' ModelOutput)."""
    return nested(obj, torch.Tensor)


def _collect_tensors(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif type(obj) in ATEN_SCALAR_TYPES:  # before the slower Mapping test
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect_tensors(item, found)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            _collect_tensors(item, found)


def op_tensors(args: Any, kwargs: Mapping[str, Any] | None = None) -> list[torch.Tensor]:
    """``list(tensors_in((args, kwargs)))``, same tensors in the same order, without a
    generator per level: a dry run's dispatch mode asks this for every op."""
    found: list[torch.Tensor] = []
    _collect_tensors(args, found)
    if kwargs:
        _collect_tensors(kwargs, found)
    return found


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def is_shape(obj: Any) -> bool:
    return (
        isinstance(obj, (torch.Size, tuple, list))
        and all(isinstance(d, int) and not isinstance(d, bool) for d in obj)
        and len(obj) > 0
    )


def generators_in(obj: Any) -> Iterator[torch.Generator]:
    """Generators in nested inputs (lists, tuples, dicts)."""
    return nested(obj, torch.Generator)


# How deep a cache object is searched for its tensors (Cache -> layers -> keys).
_CACHE_DEPTH = 6


def _reachable(obj: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` (attributes, lists, tuples, dicts), each once."""
    if id(obj) in seen or depth > _CACHE_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _reachable(item, depth + 1, seen)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _reachable(item, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for item in vars(obj).values():
            yield from _reachable(item, depth + 1, seen)


def tensor_bytes_in(obj: Any) -> int:
    """Bytes of the tensors reachable from a cache object (its layers, keys, values)."""
    return sum(t.numel() * t.element_size() for t in _reachable(obj, 0, set()))


def cache_of(output: Any) -> Any:
    """The cache object a model returned (transformers' ``cache`` / ``past_key_values``)."""
    if isinstance(output, Mapping):
        present = list(output.keys())  # the fields set (reading others warns in transformers)
        for key in ("cache", "past_key_values", "cache_params"):
            if key in present and output[key] is not None:
                return output[key]
    return None
