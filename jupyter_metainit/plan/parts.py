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

from torch import nn

from jupyter_metainit.estimates.repeats import children, own_tensors, repeated_blocks

__all__ = ["Part", "find_parts"]


@dataclass(eq=False)  # identity: parts are compared and hashed as objects
class Part:
    """One module placed as a whole. ``followers``: later parts tied to it (same device)."""

    name: str
    module: nn.Module
    group: str = ""  # the repeated-block group ("model.layers"), "" for other parts
    followers: list[Part] = field(default_factory=list)
    leader: Part | None = None  # set on a follower: the part whose device it takes


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
        kids = children(mod)
        whole = (
            name in blocks
            or _matches(name, mod, keep_whole)
            or name in pinned
            or not kids
            or bool(own_tensors(mod))
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
        tensors = {id(t) for m in part.module.modules() for t in own_tensors(m)}
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
