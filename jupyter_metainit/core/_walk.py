"""Which tensors a module holds: the one walker every layer uses.

``materialize`` collects with it, the widget's tree and the memory table count with it, and the
checkpoint loader and ``materialize_sharded`` name tensors with it, so that what is shown is what
is acted on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from jupyter_metainit.core._tensor import DeferredTensor

__all__ = ["OwnTensor", "named_tensors", "own_tensors", "unique_tensors"]


class OwnTensor(NamedTuple):
    """A tensor a module holds directly, under ``name``."""

    name: str
    tensor: torch.Tensor
    kind: str  # "parameter", "buffer", "non-persistent buffer" or "attribute"


def own_tensors(module: nn.Module, *, attributes: bool = False) -> list[OwnTensor]:
    """The parameters and buffers ``module`` holds itself (not its children's), in order.

    With ``attributes``, also deferred tensors kept as plain attributes (or in a list or tuple
    attribute): a model's ``self.freqs = torch.arange(...)`` is built and materialized with it.
    """
    out = [OwnTensor(n, p, "parameter") for n, p in module._parameters.items() if p is not None]
    transient = module._non_persistent_buffers_set
    out += [
        OwnTensor(n, b, "non-persistent buffer" if n in transient else "buffer")
        for n, b in module._buffers.items()
        if b is not None
    ]
    if attributes:
        for n, v in module.__dict__.items():
            if isinstance(v, DeferredTensor):
                out.append(OwnTensor(n, v, "attribute"))
            elif isinstance(v, (list, tuple)):
                out += [
                    OwnTensor(f"{n}.{i}", x, "attribute")
                    for i, x in enumerate(v)
                    if isinstance(x, DeferredTensor)
                ]
    return out


def named_tensors(
    module: nn.Module, *, attributes: bool = False
) -> Iterator[tuple[str, OwnTensor]]:
    """``(qualified module name, tensor)`` for every module and each tensor it holds; a tied
    tensor comes once per holder, and a module reachable under two names once per name."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        for own in own_tensors(m, attributes=attributes):
            yield prefix, own


def unique_tensors(module: nn.Module, *, attributes: bool = False) -> list[torch.Tensor]:
    """Every tensor of ``module`` and its children, each object once, in walk order."""
    seen: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for own in own_tensors(m, attributes=attributes):
            seen.setdefault(id(own.tensor), own.tensor)
    return list(seen.values())
