"""The parts a placement moves as a whole: repeated blocks, no-split modules, tied groups.

A plan never cuts inside a part. The sequence of parts, in the order the model's modules are
registered (which is the order the forward runs them in for the models a pipeline serves), is
what :mod:`~jupyter_metainit.plan.partition` cuts into one contiguous range per device.

Repeated blocks are found as the model tree shows them ("x80, identical"): consecutive
siblings with the same structural fingerprint (class, tensor shapes and dtypes, children's
fingerprints).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from jupyter_metainit.estimates.repeats import fingerprint, identical_runs

__all__ = ["Part", "find_parts", "repeated_blocks"]


@dataclass(eq=False)  # identity: parts are compared and hashed as objects
class Part:
    """One module placed as a whole. ``followers``: later parts tied to it (same device)."""

    name: str
    module: nn.Module
    group: str = ""  # the repeated-block group ("model.layers"), "" for other parts
    followers: list[Part] = field(default_factory=list)
    leader: Part | None = None  # set on a follower: the part whose device it takes


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [
        *(p for p in module._parameters.values() if p is not None),
        *(b for b in module._buffers.values() if b is not None),
    ]


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in module._modules.items() if m is not None]


def _fingerprint(module: nn.Module, memo: dict[int, str]) -> str:
    """Equal for structurally identical modules (decoder layers...)."""
    key = id(module)
    if key not in memo:
        children = [(local, _fingerprint(child, memo)) for local, child in _children(module)]
        memo[key] = fingerprint(type(module).__qualname__, _own_tensors(module), children)
    return memo[key]


def repeated_blocks(module: nn.Module) -> dict[str, str]:
    """Qualified name -> its group's name, for every member of a run of >= 2 consecutive
    structurally identical siblings (``model.layers.0`` ... ``model.layers.79`` ->
    ``model.layers``)."""
    memo: dict[int, str] = {}
    found: dict[str, str] = {}
    for parent_name, parent in module.named_modules():
        kids = _children(parent)
        prefix = f"{parent_name}." if parent_name else ""
        sigs = [_fingerprint(kid, memo) for _, kid in kids]
        for start, end in identical_runs(sigs):
            # Leaves (a list of identical Linear) repeat too, but only blocks with children
            # are worth a group: single layers are split freely.
            if _children(kids[start][1]):
                for local, _ in kids[start : end + 1]:
                    found[prefix + local] = parent_name
    return found


def _matches(name: str, module: nn.Module, wanted: set[str]) -> bool:
    return name in wanted or type(module).__name__ in wanted


def find_parts(
    module: nn.Module, *, no_split: Iterable[str] | None = None, pinned: Iterable[str] = ()
) -> list[Part]:
    """The model cut into parts, in module order.

    A module is a part when it is a repeated block (unless ``no_split`` is given: then only
    the modules it names, by qualified name or class name, are kept whole), when it is named
    in ``no_split`` or ``pinned``, when it holds tensors itself next to children (its own
    tensors and its children's go together), or when it is a leaf. Otherwise its children
    are looked at. Parts sharing a tensor (tied weights) become one group: the first is the
    leader, the later ones follow it onto its device.
    """
    blocks = repeated_blocks(module) if no_split is None else {}
    keep_whole = set(no_split or ())
    pinned = set(pinned)
    parts: list[Part] = []

    def visit(name: str, mod: nn.Module) -> None:
        kids = _children(mod)
        whole = (
            name in blocks
            or _matches(name, mod, keep_whole)
            or name in pinned
            or not kids
            or bool(_own_tensors(mod))
        )
        if whole:
            parts.append(Part(name, mod, blocks.get(name, "")))
            return
        for local, child in kids:
            visit(f"{name}.{local}" if name else local, child)

    visit("", module)
    _tie(parts)
    return parts


def _tie(parts: list[Part]) -> None:
    """Make later parts sharing a tensor (by identity, as the memory table counts them)
    followers of the first part holding it."""
    holder: dict[int, Part] = {}
    for part in parts:
        tensors = {id(t) for m in part.module.modules() for t in _own_tensors(m)}
        leaders = {holder[k].leader or holder[k] for k in tensors if k in holder}
        leaders.discard(part)
        if leaders:
            leader = min(leaders, key=parts.index)
            part.leader = leader
            leader.followers.append(part)
            # Two earlier groups joined by this part: the later one follows the first too.
            for other in leaders - {leader}:
                for follower in [other, *other.followers]:
                    follower.leader = leader
                    leader.followers.append(follower)
                other.followers = []
        for k in tensors:
            holder.setdefault(k, part)
