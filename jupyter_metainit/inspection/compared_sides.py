"""Which tensors ``compare`` reads of a side, and in which layout: a transformers model compared
with a checkpoint path as ``save_pretrained`` writes it, and only the subtrees asked about."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from jupyter_metainit.core import in_file_layout
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["Layout", "check_modules", "file_layout", "under"]


def under(name: str, scope: Sequence[str]) -> bool:
    """Whether tensor or module ``name`` lies inside one of the subtrees ``scope``."""
    return any(name.startswith(s + ".") for s in scope)


@dataclass
class Layout:
    """One side of a comparison as it is read.

    ``tensors``: what is opened (the side itself, or a dict of its tensors, renamed, converted
    or left out); ``renamed``: a file's name -> the model's, for a tensor only renamed (the
    table names it as the model does); ``origin``: each name of ``tensors`` -> the model's
    tensor it is, or is a part of (the split experts of a fused one), by ``state_dict`` name.
    """

    tensors: Any
    renamed: dict[str, str] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)


def check_modules(a: Any, modules: str | Sequence[str] | None) -> list[str]:
    """The subtrees asked about, ``[]`` for the whole of ``a`` (``""`` is the whole, too).

    Raises:
        ArgumentTypeError: ``modules`` is not a name or a list of names.
        ArgumentError: a name that is no submodule of the module ``a``.
    """
    if modules is None:
        return []
    if isinstance(modules, str):
        modules = [modules]
    if not all(isinstance(m, str) for m in modules):
        raise ArgumentTypeError(
            "compare(modules=...) takes a submodule's qualified name or a list of them "
            "(as named_modules() gives them, e.g. 'model.layers.0')"
        )
    if "" in modules:
        return []
    if isinstance(a, torch.nn.Module):
        known = {name for name, _ in a.named_modules(remove_duplicate=False)}
        missing = [m for m in modules if m not in known]
        if missing:
            raise ArgumentError(
                f"compare(modules=...): {', '.join(map(repr, missing[:3]))} is no submodule of "
                "a; give qualified names as a.named_modules() gives them (e.g. "
                "'model.layers.0')"
            )
    return list(modules)


def file_layout(side: Any, other: Any, scope: list[str], *, origins: bool = False) -> Layout:
    """``side`` as compare reads it against ``other``, only the tensors under ``scope`` (none:
    all of them).

    A transformers model compared with a checkpoint path is seen as ``save_pretrained`` writes
    it: transformers >= 5 renames some weights in memory (GPT-NeoX's ``lm_head`` is
    ``embed_out`` in the file) and fuses others (a mixture of experts'), and writes them back in
    the file's layout. Deferred tensors stay deferred (the conversion's views and splits are
    recorded). A subtree's tensors are converted alone, so its part of the file's layout is
    what is compared, under the file's names. ``origins``: also say which model tensor each
    converted one comes from (each is converted alone once more).
    """
    if isinstance(side, torch.nn.Module):
        state = dict(side.state_dict(keep_vars=True))
    elif isinstance(side, dict):
        state = dict(side)
    else:  # a path: restricted once opened (Layout.origin stays empty)
        return Layout(side)
    if scope:
        state = {k: v for k, v in state.items() if under(k, scope)}
    converted = _converted(side, other, state)
    if converted is None:
        return Layout(state if scope or not isinstance(side, torch.nn.Module) else side)
    first: dict[int, str] = {}
    for name, t in state.items():
        first.setdefault(id(t), name)
    renamed = {
        k: first[id(t)]
        for k, t in converted.items()
        if k not in state and id(t) in first and first[id(t)] not in converted
    }
    return Layout(converted, renamed, _origins(side, state, converted) if origins else {})


def _converted(model: Any, other: Any, state: dict[str, torch.Tensor]) -> dict | None:
    """``state`` in the file's layout, or None where transformers converts nothing."""
    if not isinstance(model, torch.nn.Module) or not isinstance(other, (str, os.PathLike)):
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:  # no transformers: nothing is converted in memory
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    return in_file_layout(model, state)


def _origins(
    model: torch.nn.Module, state: dict[str, torch.Tensor], converted: dict[str, torch.Tensor]
) -> dict[str, str]:
    """Each converted name -> the model's tensor it comes from: the tensor itself where it is
    kept or only renamed; else each tensor converted alone (its split into the file's tensors).
    A name only a group of tensors converted together gives (a fusion in the file) has none."""
    first: dict[int, str] = {}
    for name, t in state.items():
        first.setdefault(id(t), name)
    out = {k: first[id(t)] for k, t in converted.items() if id(t) in first}
    kept = set(out.values())
    for name, t in state.items():
        if name in kept or first[id(t)] != name:
            continue
        try:
            alone = in_file_layout(model, {name: t}) or {}
        except Exception:  # a converter that needs its whole group: no single origin
            continue
        for k in alone:
            if k in converted:
                out.setdefault(k, name)
    return out
