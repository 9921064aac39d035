"""The parts a placement moves as a whole: repeated blocks, no-split modules, tied groups, and
the tensors a module holds itself next to its children.

A plan never cuts inside a part. The sequence of parts, in the order the model's modules are
registered (which is the order the forward runs them in for the models a pipeline serves), is
what :mod:`~jupyter_metainit.plan.partition` cuts into one contiguous range per device.

Repeated blocks are found as the model tree shows them ("x80, identical"): consecutive
siblings with the same structural fingerprint (class, tensor shapes and dtypes, children's
fingerprints).

A module holding parameters or buffers itself next to children (BART's ``final_logits_bias``,
a ViT's ``cls_token`` and ``pos_embed``) is not kept whole for them: as accelerate's
``infer_auto_device_map`` does, those tensors become a part of their own, placed before the
module's children, and the children are cut as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from jupyter_metainit.estimates.repeats import children, own_tensors, repeated_blocks

__all__ = ["Part", "describe", "find_parts"]


@dataclass(eq=False)  # identity: parts are compared and hashed as objects
class Part:
    """One module placed as a whole. ``followers``: later parts tied to it (same device)."""

    name: str
    module: nn.Module
    group: str = ""  # the repeated-block group ("model.layers"), "" for other parts
    followers: list[Part] = field(default_factory=list)
    leader: Part | None = None  # set on a follower: the part whose device it takes
    # Only the parameters and buffers ``module`` holds itself: its children are other parts.
    # Such a part runs no forward of its own and is named after its module.
    own_only: bool = False

    def modules(self) -> list[nn.Module]:
        """The modules whose own parameters and buffers this part holds: its module's subtree,
        or for an ``own_only`` part the module alone."""
        return [self.module] if self.own_only else list(self.module.modules())

    def tensors(self) -> list[torch.Tensor]:
        """The parameters and buffers this part holds (a tied one once per holder)."""
        return [t for m in self.modules() for t in own_tensors(m)]

    def tensor_names(self) -> list[str]:
        """Qualified names of an ``own_only`` part's tensors, as a device map names them."""
        prefix = f"{self.name}." if self.name else ""
        slots = {**self.module._parameters, **self.module._buffers}
        return [prefix + local for local, t in slots.items() if t is not None]

    @property
    def label(self) -> str:
        """The part as tables and messages show it: its module's name, or for an
        ``own_only`` part the names of its tensors ("cls_token, pos_embed")."""
        return ", ".join(self.tensor_names()) if self.own_only else self.name

    @property
    def kind(self) -> str:
        """The type column: the module's class, or "tensors of <class>"."""
        cls = type(self.module).__name__
        return f"tensors of {cls}" if self.own_only else cls


def describe(name: str) -> str:
    """A module's name in a user's words: the root is "the whole model"."""
    return repr(name) if name else "the whole model"


def _matches(name: str, module: nn.Module, wanted: set[str]) -> bool:
    return name in wanted or type(module).__name__ in wanted


def find_parts(
    module: nn.Module, *, no_split: Iterable[str] | None = None, pinned: Iterable[str] = ()
) -> list[Part]:
    """The model cut into parts, in module order.

    A module is a part when it is a repeated block (unless ``no_split`` is given: then only
    the modules it names, by qualified name or class name, are kept whole), when it is named
    in ``no_split`` or ``pinned``, or when it is a leaf. Otherwise the parameters and buffers
    it holds itself, if any, are a part (``own_only``) and its children are looked at. Parts
    sharing a tensor (tied weights) become one group: the first is the leader, the later ones
    follow it onto its device.
    """
    blocks = repeated_blocks(module) if no_split is None else {}
    keep_whole = set(no_split or ())
    pinned = set(pinned)
    parts: list[Part] = []

    def visit(name: str, mod: nn.Module) -> None:
        kids = children(mod)
        whole = name in blocks or _matches(name, mod, keep_whole) or name in pinned or not kids
        if whole:
            parts.append(Part(name, mod, blocks.get(name, "")))
            return
        if own_tensors(mod):
            parts.append(Part(name, mod, own_only=True))
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
        tensors = {id(t) for t in part.tensors()}
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
