"""Value reads while recording: exact current values of deferred tensors, on the CPU.

:func:`compute_values` is the read path recording uses (``.item()``, ``bool(t)``, ops without a
meta kernel), through :class:`ReplayValueReader`, which ``core.replay``'s ``__init__`` installs
as recording's value reader. It continues from values earlier reads computed (kept by
``read_cache``) and keeps what it computes for the next read.

:func:`values_to_write` is the read path of ``save`` and ``stats``: a batch of tensors at a
time, nothing kept, into memory a ``recycler.Recycler`` hands from one batch to the next (new
memory costs a page fault per page on first touch: filling it with a bfloat16 ``normal_`` takes
about a quarter longer than filling memory already touched, and a model repeats its tensors'
sizes layer after layer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.record.graph import StorageRecord, TensorRecord, constant_op
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay.planning import Plan, plan
from jupyter_metainit.core.replay.read_cache import value_cache
from jupyter_metainit.core.replay.realized import (
    any_realized,
    current_values,
    real_view,
    realized_view,
)
from jupyter_metainit.core.replay.run import execute
from jupyter_metainit.core.runtime.interrupts import handling_interrupts
from jupyter_metainit.core.runtime.lock import exclusive
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["ReplayValueReader", "compute_values", "values_to_write"]


def _constant_value(r: TensorRecord) -> torch.Tensor | None:
    """The kept data of a storage that is a constant never written since (the user's
    ``torch.tensor(...)`` inside ``meta_init``), laid out as the whole storage; else None."""
    writes = r.storage.writes
    if len(writes) != 1 or writes[0].func is not constant_op:
        return None
    data = writes[0].args[0].tensor
    whole = data.is_contiguous() and data.storage_offset() == 0
    if not whole or data.numel() * data.element_size() != r.storage.nbytes:
        return None
    return data


def compute_values(records: list[TensorRecord]) -> list[torch.Tensor]:
    """Exact current values of deferred tensors on the CPU, without changing them.

    Continues from values earlier reads computed (``value_cache``) and keeps what it computes for
    the next read, within the cache's budget.
    """
    constants = [_constant_value(r) for r in records]
    if all(c is not None for c in constants):  # ``torch.tensor(0.5).item()``: nothing to run
        with plain():
            return [real_view(c, r).clone() for c, r in zip(constants, records, strict=True)]
    with handling_interrupts(), exclusive("reading values of deferred tensors"):
        p = plan(records, value_cache)
        env = execute(
            p, torch.device("cpu"), "exact", retain=lambda s: s.nbytes <= value_cache.max_entry
        )
        for sid, (storage, writes) in p.versions.items():
            value = env.get(sid)
            if isinstance(value, torch.Tensor) and writes > 0:  # not a _ShapeMismatch
                value_cache.put(storage, writes, value)
        with plain():
            return [real_view(env[id(r.storage)], r).clone() for r in records]


def values_to_write(
    t: DeferredTensor | Sequence[DeferredTensor],
    memory: Callable[[int], torch.UntypedStorage] | None = None,
    on_part: Callable[[int, int, int, torch.Tensor], None] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Exact values of one deferred tensor (or of a batch of them: a list) as new real CPU
    tensors, without changing them: for writing a model out a batch at a time
    (``jupyter_metainit.save``). They are what ``materialize`` would give: a view of memory an
    earlier ``materialize`` made real gets that memory's values now (``realized``).

    Unlike :func:`compute_values` it neither takes from nor adds to the read cache (whose
    256 MB would stay held after the save) and copies nothing when a tensor covers its whole
    storage (a checkpoint-backed one: its file's mapped pages), so memory follows the batch.
    Only the ops they depend on run, on every core: a batch of whole tensors each made by one
    fill of one stream (a model's weights, in the order they were made) runs as one long fill
    cut across the cores, one jump-ahead per core. ``memory(nbytes)`` gives the untyped
    storages to compute into (``execute``'s; a ``Recycler`` hands them on from batch to batch).
    ``on_part(k, a, b, flat)``, called from the replay's threads: elements ``[a, b)`` of tensor
    ``k`` (its values, ``flat``, are the ones returned, flattened) are final already, so writing
    them can start while the rest is being generated.
    """
    one = isinstance(t, DeferredTensor)
    records = [t._rec] if one else [x._rec for x in t]
    with handling_interrupts(), exclusive("computing values to write"):
        out = current_values(records)  # memory materialize made real: what it would give
        rest = [k for k in range(len(records)) if k not in out]
        if rest:
            replayed = [records[k] for k in rest]
            on_filled = None if on_part is None else _parts_of(replayed, on_part, rest)
            replay = plan(replayed)
            try:
                env = execute(
                    replay,
                    torch.device("cpu"),
                    "exact",
                    one_stream=True,
                    memory=memory,
                    on_filled=on_filled,
                )
            except Exception:
                _refuse_meta_inputs(replay)
                raise
            bases = [env[id(r.storage)] for r in replayed]
            del env
            with plain():
                for k, base, r in zip(rest, bases, replayed, strict=True):
                    out[k] = _compact(base, r)
    values = [out[k] for k in range(len(records))]
    return values[0] if one else values


def _refuse_meta_inputs(replay: Plan) -> None:
    """After a failed replay: if it failed for lack of data in a meta tensor, say so."""
    bad = replay.meta_input_op()
    if bad is not None:
        raise MaterializationError(
            f"a tensor being written cannot be computed: its recording uses a plain tensor of "
            f"PyTorch's meta device ({bad.func} at {bad.where}), which holds no data. Give that "
            "tensor values, or make it inside `jupyter_metainit.meta_init()` without "
            "device='meta' (it is then recorded). Nothing was written."
        ) from None


def _parts_of(
    records: list[TensorRecord],
    on_part: Callable[[int, int, int, torch.Tensor], None],
    index: list[int],
) -> Callable[[TensorRecord, int, int, torch.Tensor], None]:
    """``execute``'s ``on_filled`` for the requested records that are their fill's whole
    storage as it is (the tensor returned is that storage: parts of it are its parts);
    ``records[i]`` is the caller's tensor ``index[i]``."""
    by_storage: dict[int, list[int]] = {}
    for k, r in enumerate(records):
        by_storage.setdefault(id(r.storage), []).append(k)

    def on_filled(target: TensorRecord, a: int, b: int, flat: torch.Tensor) -> None:
        for k in by_storage.get(id(target.storage), ()):
            r = records[k]
            same = (r.size, r.stride, r.offset, r.dtype) == (
                target.size,
                target.stride,
                target.offset,
                target.dtype,
            )
            if same and not r.conj and not r.neg:
                on_part(index[k], a, b, flat)

    return on_filled


def _compact(base: torch.Tensor, r: TensorRecord) -> torch.Tensor:
    """``r``'s view of ``base``: the view itself when it is all of its memory (``base``, or a
    dtype view of all of it: a checkpoint-backed tensor over its file's bytes), else a copy
    (a part would keep the whole storage alive)."""
    view = real_view(base, r)
    if view is base or _all_of_its_memory(view):
        return view
    compact = view.contiguous()
    return compact if compact is not view else view.clone()


def _all_of_its_memory(view: torch.Tensor) -> bool:
    """Whether ``view`` covers its whole storage, in order, with no lazy conjugate or sign."""
    return (
        view.storage_offset() == 0
        and view.is_contiguous()
        and not view.is_conj()
        and not view.is_neg()
        and view.numel() * view.element_size() == view.untyped_storage().nbytes()
    )


class ReplayValueReader:
    """Recording's value reads (see ``core.record.value_reader``), answered by exact replay on
    the CPU with the shared :data:`value_cache`."""

    def values(self, records: list[TensorRecord]) -> list[torch.Tensor]:
        """The current values (``.item()``, an op that needs them): those of memory an earlier
        ``materialize`` made real (``realized``: what materializing them would give), the
        others replayed. (:func:`compute_values` itself is the recording's values.)"""
        if not any_realized():
            return compute_values(records)
        with exclusive("reading values of deferred tensors"):
            out = current_values(records)
            rest = [r for k, r in enumerate(records) if k not in out]
            replayed = iter(compute_values(rest) if rest else [])
        return [out[k] if k in out else next(replayed) for k in range(len(records))]

    def keep(self, storage: StorageRecord, writes: int, value: torch.Tensor) -> None:
        value_cache.put(storage, writes, value)

    def forget_all(self) -> None:
        value_cache.clear()

    def real_view(self, record: TensorRecord, grad: bool) -> torch.Tensor | None:
        return realized_view(record, grad)
