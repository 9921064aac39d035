"""Repeated blocks: which sibling modules are structurally identical (decoder layers, ...).

The widget's tree groups them ("x80, identical"), the placement planner never splits them
across devices and the dry run measures the first of a run once for the rest; all ask this
module, so they agree on what a repeated block is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

__all__ = [
    "children",
    "fingerprint",
    "identical_runs",
    "own_tensors",
    "repeated_blocks",
    "structural_fingerprint",
]


def fingerprint(
    kind: str, tensors: Iterable[torch.Tensor], children: Iterable[tuple[str, str]]
) -> str:
    """Equal for structurally identical modules: the class name ``kind``, the shape and dtype
    of each tensor it holds itself, and each child's local name (digits as ``#``, so the
    ``3`` of ``layers.3.mlp`` does not count) with that child's fingerprint."""
    h = hashlib.blake2b(digest_size=8)
    h.update(kind.encode())
    for t in tensors:
        lazy = isinstance(t, torch.nn.parameter.UninitializedTensorMixin)
        h.update(f"{'lazy' if lazy else tuple(t.shape)}{t.dtype}".encode())
    for local, child in children:
        h.update(("#" if local.isdigit() else local).encode())
        h.update(child.encode())
    return h.hexdigest()


def identical_runs(signatures: Sequence[str]) -> Iterator[tuple[int, int]]:
    """``(start, end)`` (inclusive) of every run of two or more equal consecutive signatures."""
    start = 0
    while start < len(signatures):
        end = start
        while end + 1 < len(signatures) and signatures[end + 1] == signatures[start]:
            end += 1
        if end > start:
            yield start, end
        start = end + 1


def own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers ``module`` holds itself (not its children's)."""
    return [
        *(p for p in module._parameters.values() if p is not None),
        *(b for b in module._buffers.values() if b is not None),
    ]


def children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(local name, child)`` of the submodules registered on ``module`` (``None`` skipped)."""
    return [(n, m) for n, m in module._modules.items() if m is not None]


def structural_fingerprint(module: nn.Module, memo: dict[int, str]) -> str:
    """Equal for structurally identical modules (decoder layers...)."""
    key = id(module)
    if key not in memo:
        kids = [(local, structural_fingerprint(child, memo)) for local, child in children(module)]
        memo[key] = fingerprint(type(module).__qualname__, own_tensors(module), kids)
    return memo[key]


def repeated_blocks(module: nn.Module) -> dict[str, str]:
    """Qualified name -> its group's name, for every member of a run of >= 2 consecutive
    structurally identical siblings (``model.layers.0`` ... ``model.layers.79`` ->
    ``model.layers``)."""
    memo: dict[int, str] = {}
    found: dict[str, str] = {}
    for parent_name, parent in module.named_modules():
        kids = children(parent)
        prefix = f"{parent_name}." if parent_name else ""
        sigs = [structural_fingerprint(kid, memo) for _, kid in kids]
        for start, end in identical_runs(sigs):
            # Leaves (a list of identical Linear) repeat too, but only blocks with children
            # are worth a group: single layers are split freely.
            if children(kids[start][1]):
                for local, _ in kids[start : end + 1]:
                    found[prefix + local] = parent_name
    return found
