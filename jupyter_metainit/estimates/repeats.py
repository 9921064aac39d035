"""Repeated blocks: which sibling modules are structurally identical (decoder layers, ...).

The widget's tree groups them ("x80, identical") and the placement planner never splits them
across devices; both ask this module, so the two always agree on what a repeated block is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import torch

__all__ = ["fingerprint", "identical_runs"]


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
