"""Per-module memory table of a model: parameters, bytes, state, sharing and training estimates.

Use :func:`memory_table` before materializing anything to see what each part of a model costs.
It never touches tensor data, so it works the same on deferred, partially materialized and real
models. How a column adds up over a subtree (tied tensors once) is
:class:`~jupyter_metainit.estimates.subtrees.TiedSubtrees`' job; the display is ``table.py``'s.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pandas as pd
import torch
from torch import nn
from torch.nn.parameter import is_lazy

from jupyter_metainit.core import (
    counted_attributes,
    dtype_name,
    own_tensors,
    tensor_source,
    tensor_state,
    tensor_values,
)
from jupyter_metainit.estimates._arguments import check_depth, require_module
from jupyter_metainit.estimates.sizing import optimizer_state_bytes, whatif_bits
from jupyter_metainit.estimates.subtrees import TiedSubtrees, elements_held, mixed_or_single
from jupyter_metainit.estimates.table import MemoryTable

__all__ = ["DRY_RUN_ATTR", "MemoryTable", "memory_table", "subtree_bytes"]

# Where dry_run leaves each module's figures (plain numbers and shapes) for later tables.
DRY_RUN_ATTR = "_jupyter_metainit_dry_run"

# What a tensor is to the module holding it (own_tensors' kinds).
PARAMETER, BUFFER, NONPERSISTENT, ATTRIBUTE = 0, 1, 2, 3
_KINDS = {
    "parameter": PARAMETER,
    "buffer": BUFFER,
    "non-persistent buffer": NONPERSISTENT,
    "attribute": ATTRIBUTE,
}


class TensorFacts(NamedTuple):
    """What one tensor adds to every subtree holding it (read once per tensor)."""

    numel: int
    nbytes: int  # under the "what if" dtype for floating tensors
    kind: int  # PARAMETER, BUFFER, NONPERSISTENT or ATTRIBUTE (as its first holder has it)
    trainable: bool
    dtype: str
    state: str
    source: str
    values: str


class _Modules(NamedTuple):
    """Every path to a submodule in pre-order: a module reachable twice (shared submodule)
    gets a node per path, and its tensors count once per total like any other tied tensor."""

    names: list[str]
    modules: list[nn.Module]
    parents: list[int]


class _Holdings(NamedTuple):
    subtrees: TiedSubtrees[int]  # which subtrees hold which tensor (by id)
    facts: dict[int, TensorFacts]  # id(tensor) -> its facts
    params_own: list[int]  # per node, its own parameters (a tied one in each holder)
    bytes_by_dtype: dict[str, int]


def _module_paths(module: nn.Module) -> _Modules:
    names: list[str] = []
    mods: list[nn.Module] = []
    parents: list[int] = []
    index_of: dict[str, int] = {}
    for name, mod in module.named_modules(remove_duplicate=False):
        index_of[name] = len(names)
        names.append(name)
        mods.append(mod)
        parents.append(index_of[name.rpartition(".")[0]] if name else -1)
    return _Modules(names, mods, parents)


def _facts_of(
    t: torch.Tensor, kind: int, bits: int | None, whatif: str | None, sizes_only: bool = False
) -> TensorFacts:
    dtype = t.dtype
    own_name = dtype_name(dtype)
    if is_lazy(t):  # shape unknown until a (dry) forward: counts as empty
        return TensorFacts(0, 0, kind, False, own_name, "uninitialized", "", "")
    numel = elements_held(t, is_attribute=kind == ATTRIBUTE)
    if bits is not None and (dtype.is_floating_point or dtype.is_complex):
        nbytes, name = math.ceil(numel * bits / 8), whatif or own_name
    else:
        nbytes, name = numel * dtype.itemsize, own_name
    trainable = kind == PARAMETER and t.requires_grad
    if sizes_only:  # where each tensor lives and came from: not asked for
        return TensorFacts(numel, nbytes, kind, trainable, name, "", "", "")
    return TensorFacts(
        numel, nbytes, kind, trainable, name, tensor_state(t), tensor_source(t), tensor_values(t)
    )


def _holdings(
    tree: _Modules, bits: int | None, whatif: str | None, sizes_only: bool = False
) -> _Holdings:
    """Which tensors each node holds directly, and each tensor's facts (keyed by ``id``: the
    modules keep every tensor alive for the whole call)."""
    # Tensors kept as plain attributes hold memory too (``self.freqs = ...``, dicts of tables):
    # one per storage, none that only views a parameter or buffer.
    attributes = counted_attributes(tree.modules)
    facts: dict[int, TensorFacts] = {}
    held: list[list[int]] = []
    params_own = [0] * len(tree.modules)
    bytes_by_dtype: dict[str, int] = {}
    for i, mod in enumerate(tree.modules):
        here: dict[int, None] = {}
        for own in [*own_tensors(mod), *attributes[i]]:
            key, kind = id(own.tensor), _KINDS[own.kind]
            if key in here:
                continue
            here[key] = None
            if key not in facts:
                facts[key] = fact = _facts_of(own.tensor, kind, bits, whatif, sizes_only)
                if fact.state != "uninitialized":
                    bytes_by_dtype[fact.dtype] = bytes_by_dtype.get(fact.dtype, 0) + fact.nbytes
            if kind == PARAMETER:
                params_own[i] += facts[key].numel
        held.append(list(here))
    return _Holdings(TiedSubtrees(tree.parents, held), facts, params_own, bytes_by_dtype)


def _size_columns(held: _Holdings, opt_bytes: float) -> dict[str, list]:
    """Counts, bytes, labels and training estimates per subtree (every node, tree order)."""
    facts, subtrees = held.facts, held.subtrees

    def total(kind: int, field: str = "nbytes", trainable_only: bool = False) -> list[int]:
        def worth(key: int) -> int:
            f = facts[key]
            counts = f.kind == kind and (f.trainable or not trainable_only)
            return getattr(f, field) if counts else 0

        return subtrees.totals(worth)

    params = total(PARAMETER, "numel")
    trainable = total(PARAMETER, "numel", trainable_only=True)
    param_bytes, buffer_bytes = total(PARAMETER), total(BUFFER)
    nonpersistent, attribute = total(NONPERSISTENT), total(ATTRIBUTE)
    rest = [b + nb + a for b, nb, a in zip(buffer_bytes, nonpersistent, attribute, strict=True)]
    grad32 = [4 * t for t in trainable]
    optim = [int(opt_bytes * t) for t in trainable]
    n = range(len(subtrees))

    def labels(field: str) -> list[str]:
        # a tensor without a source or values label ("") says nothing about its subtree's
        found = subtrees.labels(lambda key: getattr(facts[key], field) or None)
        return [mixed_or_single(s) for s in found]

    return {
        "params_own": held.params_own,
        "params": params,
        "params_trainable": trainable,
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
        "nonpersistent_bytes": nonpersistent,
        "attribute_bytes": attribute,
        "total_bytes": [param_bytes[i] + rest[i] for i in n],
        "shared_bytes": subtrees.shared_outside(lambda key: facts[key].nbytes),
        "dtypes": [", ".join(sorted(s)) for s in subtrees.labels(lambda k: facts[k].dtype)],
        "state": [mixed_or_single(s) for s in subtrees.labels(lambda k: facts[k].state)],
        "source": labels("source"),
        # "fast": real values replayed with rng="fast", not eager's; "" before materializing
        "values": labels("values"),
        "grad_fp32_bytes": grad32,
        "optim_fp32_bytes": optim,
        "train_fp32_bytes": [4 * params[i] + rest[i] + grad32[i] + optim[i] for i in n],
        "grad_mixed_bytes": [6 * t for t in trainable],
        "optim_mixed_bytes": optim,
        "train_mixed_bytes": [
            2 * params[i] + 4 * trainable[i] + rest[i] + 6 * trainable[i] + optim[i] for i in n
        ],
    }


def subtree_bytes(module: nn.Module, *, dtype: torch.dtype | str | None = None) -> dict[str, int]:
    """``memory_table(module, dtype=dtype)["total_bytes"]`` by qualified name, without the
    table and the columns that ask the core about every tensor: the planner needs these bytes
    for every part of every plan."""
    bits, whatif_name = whatif_bits(dtype)
    tree = _module_paths(module)
    held = _holdings(tree, bits, whatif_name, sizes_only=True)
    facts = held.facts  # every kind (parameters, buffers, attributes) counts, as in the table
    totals = held.subtrees.totals(lambda key: facts[key].nbytes)
    return dict(zip(tree.names, totals, strict=True))


def _dry_run_columns(records: list[dict | None], total_bytes: list[int]) -> dict[str, list]:
    """The columns a dry run left on the modules (``None`` where it did not reach)."""
    data: dict[str, list] = {}
    for column in ("output_shape", "activation_bytes", "flops"):
        data[column] = [None if r is None else r[column] for r in records]
    data["peak_forward_bytes"] = [
        None if r is None else r["peak_activation_bytes"] + total
        for r, total in zip(records, total_bytes, strict=True)
    ]
    return data


def memory_table(
    module: nn.Module,
    *,
    depth: int | None = None,
    dtype: torch.dtype | str | None = None,
    optimizer: str | float | None = "adamw",
) -> MemoryTable:
    """One row per module (tree order, root first) with what each part costs: counts, bytes,
    training memory.

    Use it before materializing, to see parameter counts, bytes, where tensors live and what
    training would need; after :func:`dry_run`, also output shapes, activations and FLOPs. It
    reads only shapes and dtypes, never data, so deferred models cost nothing to inspect.
    Totals agree with ``accelerate.utils.compute_module_sizes(model)[""]`` and parameter
    counts with ``sum(p.numel() for p in model.parameters())``. In Jupyter the table shows
    units and a tree.

    The table is indexed by the module's qualified name (``""`` for the root, as in
    ``accelerate.utils.compute_module_sizes``; a submodule reachable by two paths gets a
    row for each). Columns hold raw numbers (counts, bytes):

    - ``type``, ``depth`` (root 0), ``children`` (number of direct submodules);
    - ``params_own`` (the module's own parameters), ``params`` (its subtree),
      ``params_trainable`` (subtree, ``requires_grad``);
    - ``param_bytes``, ``buffer_bytes`` (persistent buffers), ``nonpersistent_bytes``
      (non-persistent buffers), ``attribute_bytes`` (tensors kept as plain attributes,
      also in dicts/lists/tuples: each storage once, nothing for a view of a parameter or
      buffer), ``total_bytes`` (their sum);
    - ``shared_bytes``: bytes of this subtree's tensors that modules outside the subtree
      hold too (tied weights). Every shared tensor is counted once in every total, so the
      root's ``total_bytes`` is the real unique size;
    - ``source`` (``checkpoint``: read from a file; ``init``: computed by the model's
      code; ``mixed``), and
    - ``dtypes`` (comma-separated dtypes present), ``state`` (``deferred``, ``cpu``,
      ``cuda:0`` ... or ``mixed``; ``uninitialized`` for lazy modules before their first
      (dry) forward, which count as 0 parameters; ``""`` for a subtree without tensors);
    - training estimates for the subtree, with N its parameters, T the trainable ones, B
      its buffer (and tensor attribute) bytes and S the optimizer's state bytes per
      trainable parameter (Adam/AdamW: 8, two fp32 moments; SGD: 0; SGD with momentum: 4;
      or ``optimizer=<number>``):
      ``grad_fp32_bytes = 4·T``, ``optim_fp32_bytes = S·T``,
      ``train_fp32_bytes = 4·N + B + 4·T + S·T`` (Adam, all trainable: 16 B/param, the
      "4x fp32 size" that ``accelerate estimate-memory`` prints for float32); mixed
      precision with fp32 master weights (``accelerate``'s rule for fp16/bf16):
      ``grad_mixed_bytes = (2 + 4)·T`` (half-precision gradient + its fp32 copy,
      accelerate's "1.5x fp32 size"), ``optim_mixed_bytes = S·T`` (accelerate's "2x fp32
      size" for Adam, which is the largest component and the figure accelerate prints for
      fp16/bf16), ``train_mixed_bytes = 2·N + 4·T + B + (2 + 4)·T + S·T``
      (half-precision copy of every weight, fp32 master of the trainable ones, gradients,
      optimizer states: 20 B/param for Adam, the sum of the components rather than
      accelerate's largest component). Activations are not in the training figures; use
      :func:`dry_run` for them;
    - after a :func:`dry_run`: ``output_shape``, ``activation_bytes``, ``flops``,
      ``peak_forward_bytes``.

    Args:
        module: the model or a part of it: deferred, partly materialized or real.
        depth: keep only rows down to this depth; totals still cover the whole subtree.
        dtype: "what if" every floating-point tensor were this dtype (``torch.bfloat16``,
            ``"fp16"``, ``"int8"``, ``"int4"`` ...); integer and bool tensors keep their size.
            The model is not touched. ``None`` uses the tensors' own dtypes.
        optimizer: ``"adamw"`` (default, as ``place``), ``"adam"``, ``"sgd"``, ``"sgd_momentum"``,
            ``"adafactor"``, ``None``, or bytes of optimizer state per trainable parameter.

    Returns:
        A pandas DataFrame with those rows and columns (its Jupyter display humanizes them).

    Raises:
        ArgumentTypeError: ``module`` is not an ``nn.Module``.
        ArgumentError: an unknown ``dtype`` or ``optimizer``, or a negative ``depth``.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import memory_table, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
        >>> table = memory_table(model)
        >>> table[["type", "params", "total_bytes"]]
                      type   params  total_bytes
        module
                Sequential  8393728     33574912
        0           Linear  4198400     16793600
        1             ReLU        0            0
        2           Linear  4195328     16781312
        >>> int(memory_table(model, dtype="bf16").loc["", "total_bytes"])  # what if it were bf16?
        16787456
    """
    require_module(module, "memory_table")
    depth = check_depth(depth)
    bits, whatif_name = whatif_bits(dtype)
    opt_bytes = optimizer_state_bytes(optimizer)
    tree = _module_paths(module)
    held = _holdings(tree, bits, whatif_name)
    sizes = _size_columns(held, opt_bytes)

    depths = [0 if not name else name.count(".") + 1 for name in tree.names]
    keep = [i for i in range(len(tree.names)) if depth is None or depths[i] <= depth]
    data: dict[str, list[Any]] = {
        "type": [type(m).__name__ for m in tree.modules],
        "depth": depths,
        "children": [sum(1 for c in m._modules.values() if c is not None) for m in tree.modules],
        **sizes,
    }
    records = [m.__dict__.get(DRY_RUN_ATTR) for m in tree.modules]
    if any(r is not None for r in records):
        data.update(_dry_run_columns(records, sizes["total_bytes"]))
    kept = {column: [values[i] for i in keep] for column, values in data.items()}
    table = MemoryTable(kept, index=pd.Index([tree.names[i] for i in keep], name="module"))
    for column in ("activation_bytes", "flops", "peak_forward_bytes"):
        if column in table.columns:
            table[column] = table[column].astype("Int64")
    root_record = records[0] or {}
    table.attrs.update(
        {
            "model_type": type(module).__name__,
            "dtype": whatif_name,
            "optimizer": optimizer,
            "bytes_by_dtype": dict(sorted(held.bytes_by_dtype.items())),
            "modules": len(tree.names),
            "largest_leaf": _largest_leaf(tree, sizes["total_bytes"]),
            "dry_run": dict(root_record["run"]) if "run" in root_record else None,
        }
    )
    return table


def _largest_leaf(tree: _Modules, total_bytes: list[int]) -> tuple[str, str, int] | None:
    best: tuple[str, str, int] | None = None
    for i, m in enumerate(tree.modules):
        if any(c is not None for c in m._modules.values()):
            continue
        if best is None or total_bytes[i] > best[2]:
            best = (tree.names[i], type(m).__name__, total_bytes[i])
    return best
