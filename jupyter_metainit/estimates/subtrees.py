"""Per-subtree totals of tensors that several modules may hold: each tensor once per subtree.

The one tie-aware aggregator. A tied weight (``lm_head.weight is embed.weight``) or a submodule
reachable by two paths is held by several modules; every subtree that holds it, through one
holder or several, counts it exactly once. :func:`~jupyter_metainit.estimates.memory_table`
and the widget's tree (``jupyter/module_tree.py``) both add up their columns here, so the table
and the tree can never disagree on what a subtree holds. Callers say what each tensor is worth
(bytes, parameters, a state label); this module only decides which subtrees count it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch.nn.parameter import is_lazy

from jupyter_metainit.core import storage_of

__all__ = ["TiedSubtrees", "elements_held", "mixed_or_single"]

Key = TypeVar("Key", bound=Hashable)


def elements_held(t: torch.Tensor, is_attribute: bool) -> int:
    """The elements of memory a module's tensor stands for: its own for a parameter or buffer,
    the whole storage for a tensor attribute (a slice ``self.x = big[:10]`` keeps ``big``
    alive), none for a lazy tensor before its first (dry) forward (no shape yet)."""
    if is_lazy(t):
        return 0
    if is_attribute:
        return storage_of(t)[1] // t.dtype.itemsize
    return t.numel()


def mixed_or_single(labels: set[str]) -> str:
    """``""`` for none, the label when all agree, else ``"mixed"`` (a state, dtype, source)."""
    if not labels:
        return ""
    if len(labels) == 1:
        return next(iter(labels))
    return "mixed"


class TiedSubtrees(Generic[Key]):
    """Which subtrees hold which tensors, for nodes in pre-order (a child after its parent).

    ``parents[node]`` is the parent's node (-1 for the root); ``held[node]`` the keys of the
    tensors the node holds directly (usually ``id(tensor)``; repeats are ignored).
    """

    def __init__(self, parents: Sequence[int], held: Iterable[Iterable[Key]]) -> None:
        self.parents = list(parents)
        # key -> the nodes holding it directly, in module order (several: a tie)
        self.holders: dict[Key, list[int]] = {}
        for node, keys in enumerate(held):
            for key in keys:
                nodes = self.holders.setdefault(key, [])
                if node not in nodes:
                    nodes.append(node)

    def __len__(self) -> int:
        return len(self.parents)

    def _chain(self, node: int) -> set[int]:
        chain = set()
        while node >= 0:
            chain.add(node)
            node = self.parents[node]
        return chain

    def containing(self, key: Key) -> set[int]:
        """The nodes whose subtree holds ``key`` (the union of its holders' ancestor chains)."""
        union: set[int] = set()
        for node in self.holders[key]:
            union |= self._chain(node)
        return union

    def containing_every_holder(self, key: Key) -> set[int]:
        """The nodes whose subtree holds every holder of ``key`` (nothing outside shares it)."""
        chains = [self._chain(node) for node in self.holders[key]]
        return set.intersection(*chains)

    def tied(self) -> list[list[int]]:
        """Per node, the other nodes holding one of its own tensors, in module order."""
        out: list[list[int]] = [[] for _ in self.parents]
        for nodes in self.holders.values():
            if len(nodes) > 1:
                for node in nodes:
                    out[node].extend(n for n in nodes if n != node and n not in out[node])
        return out

    def _fold(self, value: Callable[[Key], Any], start: Callable[[], Any], merge: Callable) -> list:
        # A tensor held once is added to its holder and flows up with the bottom-up pass; a
        # tied one is added directly to every subtree containing it, once (not once per holder).
        acc = [start() for _ in self.parents]
        tied = []
        for key, nodes in self.holders.items():
            if len(nodes) == 1:
                acc[nodes[0]] = merge(acc[nodes[0]], value(key))
            else:
                tied.append(key)
        for node in range(len(self.parents) - 1, 0, -1):
            parent = self.parents[node]
            acc[parent] = merge(acc[parent], acc[node])
        for key in tied:
            worth = value(key)
            for node in self.containing(key):
                acc[node] = merge(acc[node], worth)
        return acc

    def totals(self, value: Callable[[Key], int]) -> list[int]:
        """Per node, the sum of ``value`` over the tensors its subtree holds, each once."""
        return self._fold(value, int, _add)

    def labels(self, label: Callable[[Key], str | None]) -> list[set[str]]:
        """Per node, the set of labels (states, dtypes ...) of its subtree's tensors; a label
        of ``None`` is left out."""
        return self._fold(lambda key: _one(label(key)), set, _union)

    def shared_outside(self, value: Callable[[Key], int]) -> list[int]:
        """Per node, the sum of ``value`` over its subtree's tensors that modules outside the
        subtree hold too (tied weights)."""
        out = [0] * len(self.parents)
        for key, nodes in self.holders.items():
            if len(nodes) > 1:
                worth = value(key)
                for node in self.containing(key) - self.containing_every_holder(key):
                    out[node] += worth
        return out

    def first_holder_totals(self, value: Callable[[Key], int]) -> list[int]:
        """Per node, the sum of ``value`` over the tensors whose first holder (in module order)
        is in its subtree: each tensor is attributed once, so siblings add up to their parent."""
        acc = [0] * len(self.parents)
        for key, nodes in self.holders.items():
            acc[nodes[0]] += value(key)
        for node in range(len(self.parents) - 1, 0, -1):
            acc[self.parents[node]] += acc[node]
        return acc


def _add(a: int, b: int) -> int:
    return a + b


def _one(label: str | None) -> set[str]:
    return set() if label is None else {label}


def _union(a: set[str], b: set[str]) -> set[str]:
    return a | b if b else a
