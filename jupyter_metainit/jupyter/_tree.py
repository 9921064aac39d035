"""Turn a module hierarchy into the compact JSON tree the widget front end renders.

Used by :class:`~jupyter_metainit.jupyter.widget.ModuleTreeWidget`: it builds the tree once
(one message for the whole model), then recomputes the per-node statistics after each action
and sends only the rows that changed.  Shared (tied) tensors are counted once in every total.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ModuleTree", "tensor_state"]

_EXTRA_REPR_MAX = 80


@functools.cache
def _core_tensor_state() -> Callable[[torch.Tensor], str] | None:
    try:
        from jupyter_metainit.core import tensor_state as core_state
    except ImportError:  # no core: plain meta tensors count as deferred
        return None
    return core_state


def tensor_state(t: torch.Tensor) -> str:
    """``"deferred"`` or the device a tensor's data really lives on (``"cpu"``, ``"cuda:0"``)."""
    core_state = _core_tensor_state()
    if core_state is not None:
        return core_state(t)
    return "deferred" if t.is_meta else str(t.device)


def _numel(t: torch.Tensor) -> int:
    # A lazy module's parameters have no shape before their first forward pass.
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        return 0
    return t.numel()


def _nbytes(t: torch.Tensor) -> int:
    return _numel(t) * t.dtype.itemsize


@dataclass
class NodeStats:
    """Totals of one subtree: unique parameters, bytes of unique params+buffers, and state."""

    params: int = 0
    bytes: int = 0
    state: str = ""


@dataclass
class ModuleTree:
    """Index of a module hierarchy by node id (pre-order; 0 is the root, qualified name ``""``)."""

    root: nn.Module
    names: list[str] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, root: nn.Module) -> ModuleTree:
        """Index every submodule of ``root`` (a module reachable twice appears once)."""
        tree = cls(root)
        for name, module in root.named_modules():
            node = len(tree.names)
            parent = -1 if node == 0 else tree.index[name.rpartition(".")[0]]
            tree.names.append(name)
            tree.modules.append(module)
            tree.parents.append(parent)
            tree.children.append([])
            tree.index[name] = node
            if parent >= 0:
                tree.children[parent].append(node)
        return tree

    def __len__(self) -> int:
        return len(self.names)

    # ----------------------------------------------------------------- tensors and statistics
    def own_tensors(self, node: int) -> list[tuple[torch.Tensor, bool]]:
        """The parameters (True) and buffers (False) a node holds directly."""
        m = self.modules[node]
        out = [(p, True) for p in m._parameters.values() if p is not None]
        out += [(b, False) for b in m._buffers.values() if b is not None]
        return out

    def subtree_tensors(self) -> list[dict[int, tuple[torch.Tensor, bool]]]:
        """For each node, the unique tensors (by id) of its whole subtree."""
        sets: list[dict[int, tuple[torch.Tensor, bool]]] = [{} for _ in self.names]
        for node in range(len(self.names) - 1, -1, -1):  # children come after parents
            s = sets[node]
            for t, is_param in self.own_tensors(node):
                s[id(t)] = (t, is_param)
            for child in self.children[node]:
                s.update(sets[child])
        return sets

    def stats(self) -> list[NodeStats]:
        """Parameter count, bytes and state of every subtree, tied tensors counted once."""
        out = []
        for tensors in self.subtree_tensors():
            st = NodeStats()
            states = set()
            for t, is_param in tensors.values():
                if is_param:
                    st.params += _numel(t)
                st.bytes += _nbytes(t)
                states.add(tensor_state(t))
            st.state = states.pop() if len(states) == 1 else ("mixed" if states else "")
            out.append(st)
        return out

    def selection_stats(self, nodes: Iterable[int], dtype: torch.dtype | None = None) -> dict:
        """Totals of the union of the given subtrees; ``bytes_as`` if floats were cast to dtype."""
        union: dict[int, tuple[torch.Tensor, bool]] = {}
        sets = self.subtree_tensors()
        nodes = list(nodes)
        for node in nodes:
            union.update(sets[node])
        params = nbytes = nbytes_as = 0
        states: dict[str, int] = {}
        for t, is_param in union.values():
            if is_param:
                params += _numel(t)
            b = _nbytes(t)
            nbytes += b
            if dtype is not None and t.is_floating_point():
                nbytes_as += _numel(t) * dtype.itemsize
            else:
                nbytes_as += b
            s = tensor_state(t)
            states[s] = states.get(s, 0) + b
        return {
            "modules": len(nodes),
            "params": params,
            "bytes": nbytes,
            "bytes_as": nbytes_as,
            "states": states,
        }

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
            h = hashlib.blake2b(digest_size=8)
            h.update(type(self.modules[node]).__qualname__.encode())
            for t, _ in self.own_tensors(node):
                lazy = isinstance(t, torch.nn.parameter.UninitializedTensorMixin)
                shape = "lazy" if lazy else tuple(t.shape)
                h.update(f"{shape}{t.dtype}".encode())
            for child in self.children[node]:
                local = self.names[child].rpartition(".")[2]
                h.update(("#" if local.isdigit() else local).encode())
                h.update(sigs[child].encode())
            sigs[node] = h.hexdigest()
        return sigs

    def repeats(self) -> list[tuple[int, int]]:
        """Per node ``(i, n)``: it is the i-th (0-based) of n consecutive identical siblings."""
        sigs = self.signatures()
        rep = [(0, 1)] * len(self.names)
        for kids in self.children:
            start = 0
            while start < len(kids):
                end = start
                while end + 1 < len(kids) and sigs[kids[end + 1]] == sigs[kids[start]]:
                    end += 1
                n = end - start + 1
                if n > 1:
                    for i, k in enumerate(kids[start : end + 1]):
                        rep[k] = (i, n)
                start = end + 1
        return rep

    # ----------------------------------------------------------------- JSON
    def to_json(self, stats: list[NodeStats] | None = None) -> dict:
        """The whole tree as one compact JSON structure (rows of arrays, types interned).

        Row layout: ``[parent, local_name, type_index, params, bytes, state, rep_i, rep_n,
        info, own]`` where ``info`` is a leaf module's ``extra_repr()`` (shortened), else
        ``""``, and ``own`` is 1 when the module holds parameters or buffers itself.
        """
        stats = stats if stats is not None else self.stats()
        types: list[str] = []
        type_index: dict[str, int] = {}
        rows = []
        for node, (name, module, parent) in enumerate(
            zip(self.names, self.modules, self.parents, strict=True)
        ):
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
                [
                    parent,
                    name.rpartition(".")[2],
                    type_index[tname],
                    st.params,
                    st.bytes,
                    st.state,
                    0,
                    1,
                    info,
                    int(bool(self.own_tensors(node))),
                ]
            )
        for node, (i, n) in enumerate(self.repeats()):
            rows[node][6], rows[node][7] = i, n
        return {"v": 1, "types": types, "nodes": rows}
