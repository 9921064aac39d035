"""``materialize_sharded``: each rank materializes exactly its own shards of a deferred model.

After FSDP2's ``fully_shard`` or DTensor's ``distribute_tensor`` / ``parallelize_module`` run on
a deferred model, every sharded parameter is a DTensor whose local tensor is deferred: its
recording is "run the parameter's own initialisation, then take this rank's slice (and pad it)".
Replaying that recording gives each rank exactly the values that a single-process (or eager)
construction has in its slice. Every rank records the same construction, so no communication
is needed.

Memory and time: shards are replayed one storage at a time, and a parameter's random fill
(``normal_``/``uniform_``, the usual last write of an initialisation) is generated only for the
rows this rank's shard is cut from, straight into the shard's memory (``core/rng/split_fill``): the
generator jumps to the shard's offset in the stream. A rank then holds its shards plus a small
scratch buffer and spends time in proportion to its shards. Parameters whose last write is
another op (a ``clamp_`` after ``trunc_normal_``, an arithmetic init) are computed whole, and
the rank holds that one full tensor while its shard is cut out; a ``WholeTensorWarning`` names
them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from jupyter_metainit.core import (
    DeferredTensor,
    check_progress,
    format_bytes,
    iter_deferred,
    local_tensor,
    materialize,
    named_tensors,
    noting_whole_intermediates,
    own_tensors,
    progress_callback,
)
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError, MaterializationError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["WholeTensorWarning", "materialize_sharded"]


class WholeTensorWarning(UserWarning):
    """``materialize_sharded`` computed some parameters whole before cutting this rank's shard."""


# Ops that allocate without writing values: a shard whose storage saw nothing else was meant to
# be filled by a collective (DTensor's scatter from ``src_data_rank``), which is not recorded.
_UNINITIALIZED = frozenset({
    "empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default",
    "new_empty_strided.default", "empty_permuted.default",
})  # fmt: skip


def _fsdp_params(module: torch.nn.Module) -> list[Any]:
    """FSDP2's per-parameter state objects (``FSDPParam``) of every ``fully_shard``-ed module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed support
        return []
    out: list[Any] = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            # torch >= 2.12 keeps a list of groups; earlier releases one group or None.
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                single = getattr(state, "_fsdp_param_group", None)
                groups = [] if single is None else [single]
            for group in groups:
                out.extend(group.fsdp_params)
    return out


def _local(t: Any) -> DeferredTensor | None:
    """``t``, or a DTensor's local shard, if that is deferred."""
    local = t if isinstance(t, DeferredTensor) else local_tensor(t)
    return local if isinstance(local, DeferredTensor) else None


def _module_locals(module: torch.nn.Module) -> list[DeferredTensor]:
    """Deferred parameters and buffers, with DTensors replaced by their local tensors."""
    out = []
    for m in module.modules():
        for own in own_tensors(m):
            local = _local(own.tensor)
            if local is not None:
                out.append(local)
    return out


def _shard_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(deferred local tensor)`` -> qualified name, for DTensor parameters and buffers."""
    names: dict[int, str] = {}
    for prefix, (name, t, _) in named_tensors(module):
        local = _local(t)
        if local is not None and local is not t:
            names.setdefault(id(local), f"{prefix}.{name}" if prefix else name)
    return names


def _check_filled(t: DeferredTensor, name: str) -> None:
    writes = t._rec.storage.writes
    if writes and all(op.func.__name__ in _UNINITIALIZED for op in writes) and writes[0].reads:
        raise MaterializationError(
            f"the shard of {name!r} was to be filled by a collective (DTensor sends shards from "
            "rank 0 by default), which a deferred tensor cannot record. Shard with "
            "src_data_rank=None, e.g. parallelize_module(model, mesh, plan, src_data_rank=None) "
            "or distribute_tensor(t, mesh, placements, src_data_rank=None): every rank records "
            "the same construction, so each computes its own shard without communication."
        )


def _groups(tensors: list[DeferredTensor]) -> list[list[DeferredTensor]]:
    """Tensors over the same storage go together, so that aliases stay aliases."""
    by_storage: dict[int, list[DeferredTensor]] = {}
    for t in tensors:
        by_storage.setdefault(id(t._rec.storage), []).append(t)
    return list(by_storage.values())


def _apply_placement(module: torch.nn.Module, mesh: Any, placement: Any) -> None:
    """``fully_shard`` the units of an FSDP plan from ``place`` (innermost first, root last),
    as one would by hand; a model whose units are all sharded already is left as it is."""
    strategy = getattr(placement, "strategy", None)
    if strategy != "fsdp":
        raise ArgumentError(
            f"placement= takes a plan made with place(..., strategy='fsdp', world_size=N); this "
            f"one is a {strategy!r} plan, which puts whole parts on devices: use "
            "materialize(model, placement=plan) for it"
        )
    if mesh is None:
        raise ArgumentError(
            "materialize_sharded(model, mesh, placement=plan) needs the device mesh the units "
            "are sharded over, e.g. init_device_mesh('cuda', (world_size,))"
        )
    ranks = mesh.size()
    if placement.world_size != ranks:
        raise ArgumentError(
            f"the plan is for world_size={placement.world_size} but the mesh has {ranks} ranks: "
            f"plan again with place(..., strategy='fsdp', world_size={ranks})"
        )
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modules = dict(module.named_modules())
    missing = [name for name in placement.units if name not in modules]
    if missing:
        raise ArgumentError(
            f"the plan's units {missing} are not modules of this model: pass the model the plan "
            "was made for"
        )
    units = [modules[name] for name in placement.units]
    sharded = [isinstance(unit, FSDPModule) for unit in units]
    if all(sharded):  # applied before (a call that failed while materializing): finish it
        return
    if any(sharded):
        raise ArgumentError(
            "some modules of this model are fully_shard-ed already, but not as the plan says: "
            "pass the plan to an unsharded model, or call materialize_sharded(model) without it"
        )
    for unit in units:
        fully_shard(unit, mesh=mesh)


def _tensors_to_make(module: torch.nn.Module) -> tuple[dict[int, DeferredTensor], list[Any]]:
    """Every deferred tensor of ``module`` (DTensors' local shards included, each once) and the
    FSDP2 parameters whose shards are among them."""
    tensors: dict[int, DeferredTensor] = {}
    for t in [*_module_locals(module), *iter_deferred(module)]:
        tensors.setdefault(id(t), t)
    fsdp_params = []
    for fp in _fsdp_params(module):
        # FSDP2 keeps the padded shard (the all-gather input) next to the parameter's local
        # tensor, a view of the same storage; both must become real together.
        inner = [local_tensor(fp.sharded_param), getattr(fp, "_sharded_param_data", None)]
        inner = [t for t in inner if isinstance(t, DeferredTensor)]
        if inner:
            fsdp_params.append(fp)
        for t in inner:
            tensors.setdefault(id(t), t)
    return tensors, fsdp_params


def materialize_sharded(
    module: torch.nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    placement: Any = None,
    rng: Literal["exact", "fast"] | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> torch.nn.Module:
    """Materialize a deferred model after sharding it: each rank makes only its own shards.

    Use it after ``fully_shard`` (FSDP2) and/or ``parallelize_module`` / ``distribute_tensor``
    (tensor parallel, with ``src_data_rank=None``), on every rank, before the first forward
    pass. Each shard gets exactly the values it has in a single-process materialization of the
    same model (hence eager construction), so the model's own initialisation is kept: no
    ``to_empty`` and no ``reset_parameters``. Unsharded buffers and parameters are materialized
    too, each on the device it was recorded for (FSDP2 requires that to be the mesh's device:
    build with ``meta_init(device=...)`` on GPUs).

    Peak memory per rank: its shards plus a small scratch buffer, or, for a parameter whose
    initialisation cannot be cut (see the module docstring), that full tensor while its shard is
    made; a ``WholeTensorWarning`` lists those parameters. ``materialize(model)`` gives the same
    values in one replay; prefer this function.

    Args:
        module: the sharded deferred model (the root passed to ``fully_shard``, or any module
            whose parameters are DTensors with deferred local tensors); or, with
            ``placement=``, the unsharded deferred model.
        mesh: the ``DeviceMesh`` to shard over, with ``placement=`` only.
        placement: an FSDP plan, ``place(model, ..., strategy="fsdp", world_size=N)``: its
            ``units`` are ``fully_shard``-ed over ``mesh`` (innermost first, the root last)
            before the shards are made, as one would by hand.
        rng: ``None`` or ``"exact"`` (the default, as ``materialize``'s: bit-identical to a
            single-process materialization) or
            ``"fast"`` (per-op streams seeded from the recording; shards agree across ranks
            because every rank recorded the same seeds). Every rank must build the model from
            the same seed (``torch.manual_seed`` before ``meta_init``).
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)`` over
            this rank's bytes.

    Returns:
        ``module``, with every parameter's shard real. If it fails part-way, the shards made so
        far stay real and the rest stay deferred; calling it again finishes the job.

    Raises:
        ArgumentError: an unknown ``rng``, ``mesh`` without ``placement``, a plan that is not
            an FSDP plan or does not match the model, a model sharded otherwise than its plan.
        ArgumentTypeError: ``module`` is not an ``nn.Module``.
        MaterializationError: a shard has no values to replay (a tensor distributed from
            rank 0's data: use ``src_data_rank=None``), or a replay failed; nothing of that
            group changed.

    Examples:
        In every rank of a ``torchrun`` job; here one rank alone, on the CPU:

        >>> import os, tempfile
        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from jupyter_metainit import is_deferred, meta_init
        >>> from jupyter_metainit.distributed import materialize_sharded
        >>> rendezvous = tempfile.TemporaryDirectory()  # torchrun gives the ranks theirs
        >>> store = dist.FileStore(os.path.join(rendezvous.name, "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        >>> _ = torch.manual_seed(0)  # the same seed on every rank
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        >>> for layer in model:
        ...     _ = fully_shard(layer, mesh=mesh)
        >>> _ = fully_shard(model, mesh=mesh)
        >>> _ = materialize_sharded(model)  # this rank's shards only
        >>> is_deferred(model), type(model[0].weight).__name__
        (False, 'DTensor')
        >>> _ = torch.manual_seed(0)
        >>> eager = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
        >>> torch.equal(model[0].weight.full_tensor(), eager[0].weight)
        True
        >>> dist.destroy_process_group()
        >>> rendezvous.cleanup()
    """
    if not isinstance(module, torch.nn.Module):
        raise ArgumentTypeError(
            "materialize_sharded() takes the sharded model (an nn.Module after fully_shard / "
            f"parallelize_module), not {type(module).__name__}; for single tensors or lists use "
            "jupyter_metainit.materialize"
        )
    if rng is not None and not isinstance(rng, str):
        raise ArgumentTypeError(f"rng takes 'exact', 'fast' or None (the default), not {rng!r}")
    if rng not in (None, "exact", "fast"):
        raise ArgumentError(f"rng must be 'exact', 'fast' or None (the default), not {rng!r}")
    check_progress(progress)
    rng = rng or "exact"
    if placement is not None:
        _apply_placement(module, mesh, placement)
    elif mesh is not None:
        raise ArgumentError(
            "mesh= goes with placement= (an FSDP plan from place); a model you fully_shard "
            "yourself needs only materialize_sharded(model)"
        )
    names = _shard_names(module)
    tensors, fsdp_params = _tensors_to_make(module)
    for t in tensors.values():
        if id(t) in names:
            _check_filled(t, names[id(t)])
    groups = _groups(list(tensors.values()))
    callback, bar = progress_callback(progress)
    sizes = [max(t._rec.storage.nbytes for t in g) for g in groups]
    total, done = sum(sizes), 0
    whole: list[tuple[str, Any]] = []
    try:
        for group, size in zip(groups, sizes, strict=True):
            with noting_whole_intermediates() as noted:
                materialize(group, rng=rng)
            if noted:
                name = next((names[id(t)] for t in group if id(t) in names), None)
                whole.extend((name or f"a {tuple(group[0].shape)} shard", s) for s in noted)
            done += size
            if callback is not None:
                callback(done, total)
    finally:
        if bar is not None:
            bar.close()
        if whole:
            _warn_whole(whole)
    with torch.no_grad():
        for fp in fsdp_params:
            # Re-derive FSDP's views of the now-real shard (as after ``model.to_empty()``).
            fp.reset_sharded_param()
    return module


def _warn_whole(whole: list[tuple[str, Any]]) -> None:
    """Say which parameters were computed whole (memory above the shards), and why."""

    def last_op(storage: Any) -> str:
        func = storage.writes[-1].func
        return getattr(func, "_opname", getattr(func, "__name__", str(func)))

    listed = ", ".join(
        f"{name!r} ({format_bytes(s.nbytes)}, last written by {last_op(s)})"
        for name, s in whole[:5]
    )
    more = f" and {len(whole) - 5} more" if len(whole) > 5 else ""
    largest = max(s.nbytes for _, s in whole)
    warnings.warn(
        f"materialize_sharded computed {len(whole)} parameter(s) whole before cutting this "
        f"rank's shard: {listed}{more}. Their values are exact, but this rank held each full "
        f"tensor for a moment (largest {format_bytes(largest)}). Only a parameter whose last "
        "initialisation op is a normal_ or uniform_ fill (nn.init.normal_, uniform_, kaiming_*, "
        "xavier_*, trunc_normal_ with the usual bounds) is generated for the shard alone.",
        WholeTensorWarning,
        stacklevel=2,
    )
