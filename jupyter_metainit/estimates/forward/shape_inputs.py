"""What a workload input given as a shape stands for: its dtype and value, from its name.

A shape alone says nothing of its dtype: ``(8, 512)`` is token ids for a language model,
``(8, 3, 224, 224)`` pixels for a vision one. The forward's argument names say it, as
transformers names them: ids, labels and attention masks are integers (its tokenizers return
int64 ones), pixels, audio features and embeddings floats in the model's dtype. A name that says
nothing (``x``, ``input``) takes what the model starts with: token ids for a model whose first
layer is an ``nn.Embedding``, floats otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from jupyter_metainit.estimates.forward.nested import is_shape

__all__ = [
    "ShapeInput",
    "default_input_dtype",
    "float_dtype",
    "input_names",
    "shape_input",
    "stand_in_tensor",
    "typed",
]

# Integer inputs, by name (transformers' names): ids, positions, labels and masks of 0/1.
_INTEGER_NAMES = frozenset({"labels", "bbox", "cache_position", "pixel_mask", "padding_mask"})
_INTEGER_SUFFIXES = ("_ids", "_label", "_labels", "attention_mask", "_positions")
# Float inputs, by name: what transformers' feature extractors and embedders return.
_FLOAT_SUFFIXES = ("_values", "_features", "_embeds", "_states", "head_mask", "_videos")
# Masks hold ones (every position attended, nothing padded), as a full batch does.
_ONES_SUFFIXES = ("attention_mask", "pixel_mask", "padding_mask", "head_mask")


@dataclass(frozen=True)
class ShapeInput:
    """An input given as a shape: the dry run makes it a tensor of ``dtype`` every element of
    which is ``fill``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: int = 0

    def __repr__(self) -> str:
        return f"{self.shape} {str(self.dtype).removeprefix('torch.')}"


def float_dtype(module: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's (else the default)."""
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.get_default_dtype()


def default_input_dtype(module: nn.Module) -> torch.dtype:
    """An input that its name does not type: token ids (int64) for a model whose first leaf
    with parameters is an ``nn.Embedding``, else the model's floating dtype."""
    for m in module.modules():
        if next(iter(m._modules.values()), None) is None and m._parameters:
            return torch.long if isinstance(m, nn.Embedding) else float_dtype(module)
    return float_dtype(module)


def input_names(module: nn.Module) -> list[str | None]:
    """The names of ``module.forward``'s positional parameters, in order (None past them:
    ``*args``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    names: list[str | None] = []
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names


def shape_input(
    module: nn.Module, name: str | None, shape: Any, dtype: torch.dtype | None = None
) -> ShapeInput:
    """What the input ``name`` of ``module.forward`` given as ``shape`` stands for: ``dtype``
    where given, else the type its name says (integer ids, labels and masks; floats in the
    model's dtype for pixels, features, embeddings; else :func:`default_input_dtype`)."""
    key = (name or "").lower()
    fill = 1 if key.endswith(_ONES_SUFFIXES) else 0
    if dtype is None:
        if key.startswith("bool_"):  # ViT's bool_masked_pos
            dtype = torch.bool
        elif key in _INTEGER_NAMES or key.endswith(_INTEGER_SUFFIXES) or key == "input_ids":
            dtype = torch.long
        elif key.endswith(_FLOAT_SUFFIXES):
            dtype = float_dtype(module)
        else:
            dtype = default_input_dtype(module)
    return ShapeInput(tuple(shape), dtype, fill)


def stand_in_tensor(spec: ShapeInput, device: Any = None) -> torch.Tensor:
    """The tensor ``spec`` stands for (deferred inside ``meta_init``, on ``device`` if given)."""
    return torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=device)


def typed(
    module: nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[tuple, dict[str, Any]]:
    """``args`` and ``kwargs`` with every shape in them (a tuple of whole numbers, a
    ``torch.Size``) a :class:`ShapeInput` of the argument it is (``dtype`` where given); the
    positional ones are named by ``module.forward``'s parameters."""
    names = input_names(module)

    def spec(name: str | None, value: Any) -> Any:
        return shape_input(module, name, value, dtype) if is_shape(value) else value

    return (
        tuple(spec(names[i] if i < len(names) else None, a) for i, a in enumerate(args)),
        {k: spec(k, v) for k, v in (kwargs or {}).items()},
    )
