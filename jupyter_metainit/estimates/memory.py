"""Per-module memory table of a model: parameters, bytes, state, sharing and training estimates.

Use :func:`memory_table` before materializing anything to see what each part of a model costs.
It never touches tensor data, so it works the same on deferred, partially materialized and real
models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd
import torch
from torch import nn
from torch.nn.parameter import is_lazy

from jupyter_metainit.core import tensor_source, tensor_state, tensor_values
from jupyter_metainit.core.runtime.walk import counted_attributes, own_tensors, storage_of
from jupyter_metainit.estimates._arguments import (
    check_depth,
    check_optimizer_bytes,
    parse_dtype,
    require_module,
)

__all__ = ["MemoryTable", "memory_table"]

# Bytes per trainable parameter kept by the optimizer (its states, fp32).
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adam": 8.0,  # exp_avg + exp_avg_sq
    "adamw": 8.0,
    "sgd": 0.0,  # plain SGD keeps nothing
    "sgd_momentum": 4.0,  # momentum buffer
    "adafactor": 4.0,  # rough: factored second moments + first moment are at most ~1 state
    "none": 0.0,
}

# Bits per element of the "what if" dtypes accepted by ``dtype=``.
_WHATIF_BITS: dict[str, int] = {
    "float64": 64,
    "fp64": 64,
    "float32": 32,
    "fp32": 32,
    "bfloat16": 16,
    "bf16": 16,
    "float16": 16,
    "fp16": 16,
    "half": 16,
    "float8": 8,
    "fp8": 8,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
    "int4": 4,
    "nf4": 4,
}

_DRY_RUN_ATTR = "_jupyter_metainit_dry_run"

# Columns of the table, in order (dry-run columns are appended when a dry run was recorded).
COLUMNS = [
    "type",
    "depth",
    "children",
    "params_own",
    "params",
    "params_trainable",
    "param_bytes",
    "buffer_bytes",
    "nonpersistent_bytes",
    "attribute_bytes",
    "total_bytes",
    "shared_bytes",
    "dtypes",
    "state",
    "source",
    "values",
    "grad_fp32_bytes",
    "optim_fp32_bytes",
    "train_fp32_bytes",
    "grad_mixed_bytes",
    "optim_mixed_bytes",
    "train_mixed_bytes",
]
DRY_RUN_COLUMNS = ["output_shape", "activation_bytes", "flops", "peak_forward_bytes"]


class MemoryTable(pd.DataFrame):
    """A ``pandas.DataFrame`` of raw numbers that displays itself with human-readable units.

    Everything a DataFrame does works (sort, sum, plot); only the Jupyter display differs.
    """

    @property
    def _constructor(self) -> type[MemoryTable]:
        return MemoryTable

    def _repr_html_(self) -> str | None:
        return self.to_html_view(compact=self.attrs.get("view") != "full")

    def full(self) -> MemoryTable:
        """The same table, displayed with all its columns (the default view is compact)."""
        out = self.copy()
        out.attrs["view"] = "full"
        return out

    def to_html_view(self, *, compact: bool = True) -> str:
        """The HTML Jupyter shows: compact (fits a 1000 px notebook) or with every column."""
        from jupyter_metainit.estimates.render import render_html

        html = render_html(self, columns="compact" if compact else None)
        if compact:
            html += (
                "<p style='font-size: smaller; opacity: 0.7'>Compact view; "
                "<code>table.full()</code> (or <code>%meta_table ... --full</code>) shows "
                "every column.</p>"
            )
        return html


def _whatif_bits(dtype: torch.dtype | str | None) -> tuple[int | None, str | None]:
    if dtype is None:
        return None, None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            return dtype.itemsize * 8, str(dtype).removeprefix("torch.")
        name = str(dtype).removeprefix("torch.")
        return dtype.itemsize * 8, name
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _WHATIF_BITS:
        try:  # any other torch dtype name ("double", "torch.int16"): the shared parser
            return _whatif_bits(parse_dtype(dtype))
        except (TypeError, ValueError):
            pass
        raise ValueError(
            f"unknown dtype {dtype!r}; use a torch.dtype or one of {sorted(_WHATIF_BITS)}"
        )
    canonical = {
        "fp64": "float64",
        "fp32": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp8": "float8",
        "nf4": "int4",
    }.get(key, key)
    return _WHATIF_BITS[key], canonical


def _optimizer_bytes(optimizer: str | float | None) -> float:
    if optimizer is None:
        return 0.0
    check_optimizer_bytes(optimizer)
    if isinstance(optimizer, (int, float)):
        return float(optimizer)
    if not isinstance(optimizer, str):
        raise TypeError(
            f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, None, or a number of "
            f"bytes per trainable parameter, not {optimizer!r}"
        )
    key = optimizer.lower()
    if key not in OPTIMIZER_STATE_BYTES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZER_STATE_BYTES)} "
            "or a number of bytes per trainable parameter"
        )
    return OPTIMIZER_STATE_BYTES[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def memory_table(
    module: nn.Module,
    *,
    depth: int | None = None,
    dtype: torch.dtype | str | None = None,
    optimizer: str | float | None = "adam",
) -> MemoryTable:
    """Return one row per module (tree order, root first) with what each part costs.

    When to use: before materializing, to see parameter counts, bytes, where tensors live and
    what training would need; after :func:`dry_run`, also output shapes, activations and FLOPs.
    It reads only shapes/dtypes, never data, so deferred models cost nothing to inspect.

    The index is the module's qualified name (``""`` for the root, as in
    ``accelerate.utils.compute_module_sizes``); a submodule reachable by two paths gets a row
    for each. Columns hold raw numbers (counts, bytes):

    - ``type``, ``depth`` (root 0), ``children`` (number of direct submodules);
    - ``params_own`` (the module's own parameters), ``params`` (its subtree),
      ``params_trainable`` (subtree, ``requires_grad``);
    - ``param_bytes``, ``buffer_bytes`` (persistent buffers), ``nonpersistent_bytes``
      (non-persistent buffers), ``attribute_bytes`` (tensors kept as plain attributes, also in
      dicts/lists/tuples: each storage once, nothing for a view of a parameter or buffer),
      ``total_bytes`` (their sum);
    - ``shared_bytes``: bytes of this subtree's tensors that modules outside the subtree hold too
      (tied weights). Every shared tensor is counted once in every total, so the root's
      ``total_bytes`` is the real unique size;
    - ``source`` (``checkpoint``: read from a file; ``init``: computed by the model's code;
      ``mixed``), and
    - ``dtypes`` (comma-separated dtypes present), ``state`` (``deferred``, ``cpu``,
      ``cuda:0`` ... or ``mixed``; ``uninitialized`` for lazy modules before their first
      (dry) forward, which count as 0 parameters; ``""`` for a subtree without tensors);
    - training estimates for the subtree, with N its parameters, T the trainable ones, B its buffer
      (and tensor attribute) bytes and S the optimizer's state bytes per trainable parameter
      (Adam/AdamW: 8, two fp32 moments; SGD: 0; SGD with momentum: 4; or ``optimizer=<number>``):

      ``grad_fp32_bytes = 4·T``, ``optim_fp32_bytes = S·T``,
      ``train_fp32_bytes = 4·N + B + 4·T + S·T``  (Adam, all trainable: 16 B/param, the
      "4x fp32 size" that ``accelerate estimate-memory`` prints for float32);

      mixed precision with fp32 master weights (``accelerate``'s rule for fp16/bf16):
      ``grad_mixed_bytes = (2 + 4)·T`` (half-precision gradient + its fp32 copy, accelerate's
      "1.5x fp32 size"), ``optim_mixed_bytes = S·T`` (accelerate's "2x fp32 size" for Adam,
      which is the largest component and the figure accelerate prints for fp16/bf16),
      ``train_mixed_bytes = 2·N + 4·T + B + (2 + 4)·T + S·T`` (half-precision copy of every
      weight, fp32 master of the trainable ones, gradients, optimizer states: 20 B/param for
      Adam, the sum of the components rather than accelerate's largest component).

    Activations are not in the training figures; use :func:`dry_run` for them.

    Args:
        depth: keep only rows down to this depth; totals still cover the whole subtree.
        dtype: "what if" every floating-point tensor were this dtype (``torch.bfloat16``,
            ``"fp16"``, ``"int8"``, ``"int4"`` ...); integer and bool tensors keep their size.
            The model is not touched. ``None`` uses the tensors' own dtypes.
        optimizer: ``"adam"`` (default), ``"adamw"``, ``"sgd"``, ``"sgd_momentum"``,
            ``"adafactor"``, ``None``, or bytes of optimizer state per trainable parameter.

    Totals agree with ``accelerate.utils.compute_module_sizes(model)[""]`` and parameter
    counts with ``sum(p.numel() for p in model.parameters())``.
    """
    require_module(module, "memory_table")
    depth = check_depth(depth)
    bits, whatif_name = _whatif_bits(dtype)
    opt_bytes = _optimizer_bytes(optimizer)

    names: list[str] = []
    mods: list[nn.Module] = []
    parent: list[int] = []
    index_of: dict[str, int] = {}
    # Every path, also to a module reachable twice (shared submodule): each gets its row and
    # its tensors count once per total like any other shared tensor.
    for name, mod in module.named_modules(remove_duplicate=False):
        i = len(names)
        index_of[name] = i
        names.append(name)
        mods.append(mod)
        if name:
            cut = name.rfind(".")
            parent.append(index_of[name[:cut] if cut >= 0 else ""])
        else:
            parent.append(-1)
    n = len(names)

    # Per-tensor facts, keyed by id() of the tensor object (no weakrefs, see CONTRACT.md).
    # kind: 0 parameter, 1 persistent buffer, 2 non-persistent buffer, 3 tensor attribute.
    info: dict[int, tuple[int, int, int, bool, str, str, str, str]] = {}
    owners: dict[int, list[int]] = {}
    params_own = [0] * n
    # Per node aggregates: [numel, trainable numel, param bytes, buffer bytes, np-buffer bytes].
    p_num = [0] * n
    p_train = [0] * n
    p_bytes = [0] * n
    b_bytes = [0] * n
    nb_bytes = [0] * n
    a_bytes = [0] * n
    dtypes: list[set[str]] = [set() for _ in range(n)]
    states: list[set[str]] = [set() for _ in range(n)]
    sources: list[set[str]] = [set() for _ in range(n)]
    values: list[set[str]] = [set() for _ in range(n)]
    bytes_by_dtype: dict[str, int] = {}

    kinds = {"parameter": 0, "buffer": 1, "non-persistent buffer": 2, "attribute": 3}
    # Tensors kept as plain attributes hold memory too (``self.freqs = ...``, dicts of tables):
    # one per storage, none that only views a parameter or buffer.
    attributes = counted_attributes(mods)

    def tensor_entries(i: int) -> Iterable[tuple[torch.Tensor, int]]:
        owned = [*own_tensors(mods[i]), *attributes[i]]
        return [(own.tensor, kinds[own.kind]) for own in owned]

    for i in range(n):
        seen_here: set[int] = set()
        for t, kind in tensor_entries(i):
            key = id(t)
            if key in seen_here:
                continue
            seen_here.add(key)
            if key in info:
                owners[key].append(i)
                if kind == 0:
                    params_own[i] += info[key][0]
                continue
            tdtype = t.dtype
            if is_lazy(t):  # shape unknown until a (dry) forward: counts as empty
                info[key] = (0, 0, kind, False, _dtype_name(tdtype), "uninitialized", "", "")
                owners[key] = [i]
                continue
            numel = t.numel()
            if kind == 3:  # the whole storage is held, also when the attribute is a slice
                numel = storage_of(t)[1] // tdtype.itemsize
            if bits is not None and (tdtype.is_floating_point or tdtype.is_complex):
                nbytes = math.ceil(numel * bits / 8)
                dname = whatif_name or _dtype_name(tdtype)
            else:
                nbytes = numel * tdtype.itemsize
                dname = _dtype_name(tdtype)
            trainable = kind == 0 and t.requires_grad
            info[key] = (
                numel, nbytes, kind, trainable, dname, tensor_state(t), tensor_source(t),
                tensor_values(t),
            )  # fmt: skip
            owners[key] = [i]
            bytes_by_dtype[dname] = bytes_by_dtype.get(dname, 0) + nbytes
            if kind == 0:
                params_own[i] += numel

    shared_bytes = [0] * n
    shared: list[tuple[tuple[int, int, int, bool, str, str, str, str], set[int], set[int]]] = []

    def add(i: int, rec: tuple[int, int, int, bool, str, str, str, str]) -> None:
        numel, nbytes, kind, trainable, dname, state, source, value = rec
        if kind == 0:
            p_num[i] += numel
            p_bytes[i] += nbytes
            if trainable:
                p_train[i] += numel
        elif kind == 1:
            b_bytes[i] += nbytes
        elif kind == 2:
            nb_bytes[i] += nbytes
        else:
            a_bytes[i] += nbytes
        dtypes[i].add(dname)
        states[i].add(state)
        if source:
            sources[i].add(source)
        if value:
            values[i].add(value)

    for key, own in owners.items():
        rec = info[key]
        if len(own) == 1:
            add(own[0], rec)
            continue
        # Shared tensor: count it once in every ancestor of any owner (union of chains);
        # it is "shared with rows outside" for nodes that do not contain all owners.
        union: set[int] = set()
        inter: set[int] | None = None
        for i in own:
            chain = set()
            j = i
            while j >= 0:
                chain.add(j)
                j = parent[j]
            union |= chain
            inter = chain if inter is None else inter & chain
        shared.append((rec, union, inter or set()))

    # Bottom-up: tree order is pre-order, so every child comes after its parent.
    for i in range(n - 1, 0, -1):
        j = parent[i]
        p_num[j] += p_num[i]
        p_train[j] += p_train[i]
        p_bytes[j] += p_bytes[i]
        b_bytes[j] += b_bytes[i]
        nb_bytes[j] += nb_bytes[i]
        a_bytes[j] += a_bytes[i]
        dtypes[j] |= dtypes[i]
        states[j] |= states[i]
        sources[j] |= sources[i]
        values[j] |= values[i]

    for rec, union, inter in shared:
        for i in union:
            add(i, rec)
            if i not in inter:
                shared_bytes[i] += rec[1]

    depths = [0 if not nm else nm.count(".") + 1 for nm in names]
    keep = range(n) if depth is None else [i for i in range(n) if depths[i] <= depth]

    def col(values: list) -> list:
        return values if depth is None else [values[i] for i in keep]

    buf_all = [b_bytes[i] + nb_bytes[i] + a_bytes[i] for i in range(n)]
    grad32 = [4 * t for t in p_train]
    optim = [int(opt_bytes * t) for t in p_train]
    data = {
        "type": col([type(m).__name__ for m in mods]),
        "depth": col(depths),
        "children": col([sum(1 for c in m._modules.values() if c is not None) for m in mods]),
        "params_own": col(params_own),
        "params": col(p_num),
        "params_trainable": col(p_train),
        "param_bytes": col(p_bytes),
        "buffer_bytes": col(b_bytes),
        "nonpersistent_bytes": col(nb_bytes),
        "attribute_bytes": col(a_bytes),
        "total_bytes": col([p_bytes[i] + buf_all[i] for i in range(n)]),
        "shared_bytes": col(shared_bytes),
        "dtypes": col([", ".join(sorted(s)) for s in dtypes]),
        "state": col([_state_of(s) for s in states]),
        "source": col([_state_of(s) for s in sources]),
        # "fast": real values replayed with rng="fast", not eager's; "" before materializing
        "values": col([_state_of(s) for s in values]),
        "grad_fp32_bytes": col(grad32),
        "optim_fp32_bytes": col(optim),
        "train_fp32_bytes": col(
            [4 * p_num[i] + buf_all[i] + grad32[i] + optim[i] for i in range(n)]
        ),
        "grad_mixed_bytes": col([6 * t for t in p_train]),
        "optim_mixed_bytes": col(optim),
        "train_mixed_bytes": col(
            [
                2 * p_num[i] + 4 * p_train[i] + buf_all[i] + 6 * p_train[i] + optim[i]
                for i in range(n)
            ]
        ),
    }
    records = [m.__dict__.get(_DRY_RUN_ATTR) for m in mods]
    if any(r is not None for r in records):
        kept = col(records)
        for column in ("output_shape", "activation_bytes", "flops"):
            data[column] = [None if r is None else r[column] for r in kept]
        data["peak_forward_bytes"] = [
            None if r is None else r["peak_activation_bytes"] + total
            for r, total in zip(kept, data["total_bytes"], strict=True)
        ]
    root_record = records[0] or {}
    table = MemoryTable(data, index=pd.Index(col(names), name="module"))
    for column in ("activation_bytes", "flops", "peak_forward_bytes"):
        if column in table.columns:
            table[column] = table[column].astype("Int64")
    table.attrs.update(
        {
            "model_type": type(module).__name__,
            "dtype": whatif_name,
            "optimizer": optimizer,
            "bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
            "modules": n,
            "largest_leaf": _largest_leaf(names, mods, p_bytes, buf_all),
            "dry_run": dict(root_record["run"]) if "run" in root_record else None,
        }
    )
    return table


def _state_of(states: set[str]) -> str:
    if not states:
        return ""
    if len(states) == 1:
        return next(iter(states))
    return "mixed"


def _largest_leaf(
    names: list[str], mods: list[nn.Module], p_bytes: list[int], buf_all: list[int]
) -> tuple[str, str, int] | None:
    best: tuple[str, str, int] | None = None
    for i, m in enumerate(mods):
        if any(c is not None for c in m._modules.values()):
            continue
        size = p_bytes[i] + buf_all[i]
        if best is None or size > best[2]:
            best = (names[i], type(m).__name__, size)
    return best
