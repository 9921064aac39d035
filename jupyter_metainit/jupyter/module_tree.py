"""Turn a module hierarchy into the compact JSON tree the widget front end renders.

Used by :class:`~jupyter_metainit.jupyter.widget.ModuleTreeWidget`: it builds the tree once
(one message for the whole model), then recomputes the per-node statistics after each action
and sends only the rows that changed.  Shared (tied) tensors are counted once in every total.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from jupyter_metainit.core import (
    counted_attributes,
    dtype_name,
    own_tensors,
    tensor_source,
    tensor_state,
    tensor_values,
)
from jupyter_metainit.estimates.repeats import fingerprint, identical_runs
from jupyter_metainit.estimates.subtrees import TiedSubtrees, elements_held, mixed_or_single
from jupyter_metainit.jupyter.row_schema import STATS_FIELDS, make_row

__all__ = ["ModelGoneError", "ModuleTree", "NodeStats"]


class ModelGoneError(ReferenceError):
    """The model a tree indexes was garbage-collected: no name in the kernel refers to it."""


_EXTRA_REPR_MAX = 80


def dtype_label(t: torch.Tensor) -> str:
    """``"bf16"``, ``"fp32"``, ``"int64"``: what a dtype badge shows."""
    return dtype_name(t.dtype, short=True)


class Held(NamedTuple):
    """A tensor a node holds directly, with what it counts for (the estimates' rule)."""

    tensor: torch.Tensor
    is_param: bool
    elements: int  # elements_held: a tensor attribute's whole storage, 0 while lazy

    @property
    def nbytes(self) -> int:
        return self.elements * self.tensor.dtype.itemsize


@dataclass
class NodeStats:
    """Totals of one subtree.

    ``params``/``bytes``: unique tensors of the subtree (a tied tensor once). ``share_bytes``:
    bytes of the tensors attributed to this subtree, each tensor to its first holder in module
    order, so siblings' shares never add up past their parent's. ``state``: ``"deferred"``, a
    device, ``"mixed"``... ``dtype``: ``"bf16"``, ``"fp32"``, ``"mixed"`` (floating tensors; other
    dtypes only when there are none). ``target``: the device deferred tensors will go to when it
    is not the CPU. ``source``: where the values come from when it is a file: ``"checkpoint"``,
    or ``"mixed"`` (part checkpoint, part init); ``""`` for init alone. ``values``: ``"fast"``
    when real tensors hold values replayed with ``rng="fast"`` (not eager's), ``"mixed"`` when
    some do, ``""`` when every real tensor holds eager's values.
    """

    params: int = 0
    bytes: int = 0
    share_bytes: int = 0
    state: str = ""
    dtype: str = ""
    target: str = ""
    source: str = ""
    values: str = ""

    def row(self) -> list:
        """The fields a patch row carries after its node (``row_schema.STATS_FIELDS``)."""
        return [getattr(self, name) for name in STATS_FIELDS]


@dataclass
class ModuleTree:
    """Index of a module hierarchy by node id (pre-order; 0 is the root, qualified name ``""``).

    The modules are held weakly: a widget (which ipywidgets keeps alive until it is closed,
    even once its output is gone) must not keep a model and its memory alive after the
    notebook dropped it. Reading a module of a collected model raises :class:`ModelGoneError`.
    """

    module_refs: list[weakref.ref[nn.Module]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    # Per node, the names of the tensor attributes that hold memory of their own (first use).
    attribute_names: list[list[str]] | None = None

    @classmethod
    def build(cls, root: nn.Module) -> ModuleTree:
        """Index every submodule of ``root`` (a module reachable twice appears once)."""
        tree = cls()
        for name, module in root.named_modules():
            node = len(tree.names)
            parent = -1 if node == 0 else tree.index[name.rpartition(".")[0]]
            tree.names.append(name)
            tree.module_refs.append(weakref.ref(module))
            tree.parents.append(parent)
            tree.children.append([])
            tree.index[name] = node
            if parent >= 0:
                tree.children[parent].append(node)
        return tree

    def __len__(self) -> int:
        return len(self.names)

    def first_difference(self) -> str | None:
        """The qualified name of the first module added, removed or replaced since the tree
        was built (``del model.layers[0]``, ``model.head = nn.Linear(...)``), or None."""
        root = self.module_refs[0]()
        if root is None:
            return None  # gone as a whole: see ``alive``
        now = list(root.named_modules())
        for node, (name, module) in enumerate(now):
            if node >= len(self.names) or self.names[node] != name:
                return name
            if self.module_refs[node]() is not module:
                return name
        return self.names[len(now)] if len(now) < len(self.names) else None

    def module(self, node: int) -> nn.Module:
        """The module of ``node``; :class:`ModelGoneError` once the model was collected."""
        module = self.module_refs[node]()
        if module is None:
            raise ModelGoneError(
                "the model this tree showed no longer exists (no name in the kernel referred "
                "to it, so it was freed)"
            )
        return module

    @property
    def alive(self) -> bool:
        return self.module_refs[0]() is not None

    @property
    def root(self) -> nn.Module:
        return self.module(0)

    def holds(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of this tree's live modules."""
        return any(ref() is module for ref in self.module_refs)

    # ----------------------------------------------------------------- tensors and statistics
    def own_tensors(self, node: int) -> list[Held]:
        """The parameters (True), buffers and tensor attributes (False) a node holds directly;
        an attribute that only views a parameter or buffer is left out (it costs nothing)."""
        module = self.module(node)
        if self.attribute_names is None:
            # Names, not tensors: the tree must not hold the model's memory (see the class).
            modules = [self.module(i) for i in range(len(self))]
            self.attribute_names = [[o.name for o in here] for here in counted_attributes(modules)]
        wanted = self.attribute_names[node]
        owned = own_tensors(module, real_attributes=bool(wanted))
        return [
            Held(o.tensor, o.kind == "parameter", elements_held(o.tensor, o.kind == "attribute"))
            for o in owned
            if o.kind != "attribute" or o.name in wanted
        ]

    def _held(self) -> tuple[TiedSubtrees[int], dict[int, Held]]:
        """Which tensors (by id) every node holds directly, and each tensor as its first
        holder in module order holds it."""
        held: list[list[int]] = []
        tensors: dict[int, Held] = {}
        for node in range(len(self.names)):
            here = self.own_tensors(node)
            held.append([id(h.tensor) for h in here])
            for h in here:
                tensors.setdefault(id(h.tensor), h)
        return TiedSubtrees(self.parents, held), tensors

    def holders(self) -> dict[int, list[int]]:
        """``id(tensor)`` -> the nodes holding it directly, in module order (ties: several)."""
        return self._held()[0].holders

    def tied(self) -> list[list[int]]:
        """Per node, the other nodes holding one of its own tensors (tied weights)."""
        return self._held()[0].tied()

    def subtree_tensors(self) -> list[dict[int, Held]]:
        """For each node, the unique tensors (by id) of its whole subtree."""
        sets: list[dict[int, Held]] = [{} for _ in self.names]
        for node in range(len(self.names) - 1, -1, -1):  # children come after parents
            s = sets[node]
            for h in self.own_tensors(node):
                s[id(h.tensor)] = h
            for child in self.children[node]:
                s.update(sets[child])
        return sets

    def stats(self) -> list[NodeStats]:
        """Totals, state, dtype and share of every subtree, tied tensors counted once (the
        estimates' aggregator, the same rule as ``memory_table``'s)."""
        subtrees, tensors = self._held()
        # read once per tensor, not once per subtree holding it
        state = {key: tensor_state(h.tensor) for key, h in tensors.items()}
        source = {key: tensor_source(h.tensor) for key, h in tensors.items()}
        value = {key: tensor_values(h.tensor) for key, h in tensors.items()}
        label = {key: dtype_label(h.tensor) for key, h in tensors.items()}
        floating = {key: h.tensor.is_floating_point() for key, h in tensors.items()}
        params = subtrees.totals(lambda k: tensors[k].elements if tensors[k].is_param else 0)
        nbytes = subtrees.totals(lambda k: tensors[k].nbytes)
        share = subtrees.first_holder_totals(lambda k: tensors[k].nbytes)
        states = subtrees.labels(lambda k: state[k])
        floats = subtrees.labels(lambda k: label[k] if floating[k] else None)
        others = subtrees.labels(lambda k: None if floating[k] else label[k])
        targets = subtrees.labels(
            lambda k: str(tensors[k].tensor.device) if state[k] == "deferred" else None
        )
        sources = subtrees.labels(lambda k: source[k] or None)
        values = subtrees.labels(lambda k: value[k] or None)
        out = []
        for node in range(len(self.names)):
            target = mixed_or_single(targets[node])
            source = mixed_or_single(sources[node])
            out.append(
                NodeStats(
                    params=params[node],
                    bytes=nbytes[node],
                    share_bytes=share[node],
                    state=mixed_or_single(states[node]),
                    dtype=mixed_or_single(floats[node] or others[node]),
                    target="" if target in ("cpu", "") else target,
                    # a file's values or fast-RNG values are worth saying; init/eager's are not
                    source="" if "checkpoint" not in sources[node] else source,
                    values="" if "fast" not in values[node] else mixed_or_single(values[node]),
                )
            )
        return out

    def selection_stats(self, nodes: Iterable[int], dtype: torch.dtype | None = None) -> dict:
        """Totals of the union of the given subtrees; ``bytes_as`` if floats were cast to dtype."""
        union: dict[int, Held] = {}
        sets = self.subtree_tensors()
        nodes = list(nodes)
        for node in nodes:
            union.update(sets[node])
        params = nbytes = nbytes_as = 0
        states: dict[str, int] = {}
        states_as: dict[str, int] = {}  # bytes in ``dtype``, by state
        for t, is_param, elements in union.values():
            if is_param:
                params += elements
            b = elements * t.dtype.itemsize
            nbytes += b
            b_as = elements * dtype.itemsize if dtype is not None and t.is_floating_point() else b
            nbytes_as += b_as
            s = tensor_state(t)
            states[s] = states.get(s, 0) + b
            states_as[s] = states_as.get(s, 0) + b_as
        return {
            "modules": len(nodes),
            "params": params,
            "bytes": nbytes,
            "bytes_as": nbytes_as,
            "states": states,
            "states_as": states_as,
            "also": self._also(nodes, union),
        }

    def _also(self, nodes: list[int], union: dict) -> list[str]:
        """Modules outside the selected subtrees that hold one of its tensors (tied weights):
        materializing the selection makes their tensors real too."""
        inside = set(nodes)
        for node in range(len(self.names)):
            if self.parents[node] in inside:
                inside.add(node)
        holders = self.holders()
        outside = {n for key in union for n in holders.get(key, []) if n not in inside}
        return [self.names[n] for n in sorted(outside)]

    def normalize_selection(self, nodes: Iterable[int]) -> list[int]:
        """Canonical selection: sorted, no node inside another, and a node whose children are
        all selected (and which holds no tensors itself) stands for them.  The front end
        applies the same rule, so a selection reads back the same from either side."""
        sel = set(nodes)
        for node in sorted(sel, reverse=True):  # children have larger ids than their parents
            p = self.parents[node]
            while p >= 0:
                if p in sel:
                    sel.discard(node)
                    break
                p = self.parents[p]
        parents = sorted({self.parents[n] for n in sel if n > 0}, reverse=True)
        while parents:
            p = parents.pop(0)
            kids = self.children[p]
            if p not in sel and kids and all(k in sel for k in kids) and not self.own_tensors(p):
                sel.difference_update(kids)
                sel.add(p)
                if p > 0:
                    gp = self.parents[p]
                    parents = sorted({*parents, gp}, reverse=True)
        return sorted(sel)

    # ----------------------------------------------------------------- repeated blocks
    def signatures(self) -> list[str]:
        """A structural fingerprint per node: equal for identical blocks (decoder layers...)."""
        sigs = [""] * len(self.names)
        for node in range(len(self.names) - 1, -1, -1):
            children = [(self.names[c].rpartition(".")[2], sigs[c]) for c in self.children[node]]
            tensors = [t for t, *_ in self.own_tensors(node)]
            sigs[node] = fingerprint(type(self.module(node)).__qualname__, tensors, children)
        return sigs

    def repeats(self) -> list[tuple[int, int]]:
        """Per node ``(i, n)``: it is the i-th (0-based) of n consecutive identical siblings."""
        sigs = self.signatures()
        rep = [(0, 1)] * len(self.names)
        for kids in self.children:
            for start, end in identical_runs([sigs[k] for k in kids]):
                for i, k in enumerate(kids[start : end + 1]):
                    rep[k] = (i, end - start + 1)
        return rep

    # ----------------------------------------------------------------- JSON
    def to_json(self, stats: list[NodeStats] | None = None) -> dict:
        """The whole tree as one compact JSON structure (rows of arrays, types interned).

        Row fields, by position from ``row_schema.ROW_FIELDS``: ``info`` is a leaf module's
        ``extra_repr()`` (shortened), else ``""``, ``own`` is 1 when the module holds
        parameters or buffers itself, ``tied`` lists the nodes sharing a tensor with it,
        ``rep_i``/``rep_n`` see :meth:`repeats` (see :class:`NodeStats` for the rest).
        """
        stats = stats if stats is not None else self.stats()
        tied = self.tied()
        repeats = self.repeats()
        types: list[str] = []
        type_index: dict[str, int] = {}
        rows = []
        for node, (name, parent) in enumerate(zip(self.names, self.parents, strict=True)):
            module = self.module(node)
            tname = type(module).__name__
            if tname not in type_index:
                type_index[tname] = len(types)
                types.append(tname)
            info = ""
            if not self.children[node]:
                try:
                    info = module.extra_repr()
                except Exception:  # a user module's extra_repr may fail on deferred tensors
                    info = ""
                if len(info) > _EXTRA_REPR_MAX:
                    info = info[: _EXTRA_REPR_MAX - 1] + "…"
            st = stats[node]
            rows.append(
                make_row(
                    parent=parent,
                    name=name.rpartition(".")[2],
                    type=type_index[tname],
                    params=st.params,
                    bytes=st.bytes,
                    state=st.state,
                    rep_i=repeats[node][0],
                    rep_n=repeats[node][1],
                    info=info,
                    own=int(bool(self.own_tensors(node))),
                    dtype=st.dtype,
                    share_bytes=st.share_bytes,
                    target=st.target,
                    tied=tied[node],
                    source=st.source,
                    values=st.values,
                )
            )
        return {"v": 2, "types": types, "nodes": rows}
