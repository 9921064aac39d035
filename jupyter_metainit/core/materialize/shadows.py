"""What is kept of materialized tensors between calls, and the one place that changes it.

A real tensor may still need its past: :func:`dematerialize` swaps back the deferred side
kept for it (a :class:`Shadow`); a later ``materialize`` gives a freed tensor the same kind of
values again (fast draws, the device they were made on) and the user's hooks back; a deferred
view of memory made real earlier becomes a view of that memory again (``realized``). All of it
lives in side tables keyed weakly by the tensor object (whose identity materialize and
dematerialize preserve), never on the tensor: ``torch.save`` and pickling write nothing of
ours. :func:`why_not_reproducible` says whether a shadow still gives a tensor's current values
(checked before freeing it); :func:`clear_meta_init_cache` drops what can be dropped.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.materialize.walk import local_tensor, materialized_sources
from jupyter_metainit.core.record.files import comparing_with_file, read_file_bytes
from jupyter_metainit.core.record.graph import External, TensorRecord
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay import compute_values, plan
from jupyter_metainit.core.replay.read_cache import value_cache
from jupyter_metainit.core.replay.realized import (
    realized_memory,
    recording_only,
    remember_realized,
)
from jupyter_metainit.core.rng import streams as _rng
from jupyter_metainit.core.runtime.digest import digest
from jupyter_metainit.core.runtime.swap import identity_table, swap_in_place

__all__ = ["clear_meta_init_cache", "realized_base", "remember_realized"]


class Shadow:
    """The deferred side of a materialized tensor, kept for :func:`dematerialize`, with what
    the real tensor looked like then (version, address, digest of its memory).

    ``deferred`` always records exactly the values the real tensor had when this was made:
    the init, a read of the checkpoint file it was loaded from, a cast or a move that
    ``materialize`` applied. ``digest`` is None where the recording reads a file: the tensor
    is compared with the file when it is freed.
    """

    __slots__ = ("data_ptr", "deferred", "digest", "version")

    def __init__(
        self, deferred: DeferredTensor, version: int | None, data_ptr: int, content: tuple | None
    ) -> None:
        self.deferred = deferred
        self.version = version
        self.data_ptr = data_ptr
        self.digest = content


# The recording each real tensor can be freed to (what ``keep_cache=True`` keeps).
kept: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())  # real tensor -> Shadow
sources = materialized_sources  # real tensor -> "checkpoint" / "init"
# Real tensors with rng="fast" values.
fast_values: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())
# Real tensors materialized with device=: the device their values were computed on.
made_on: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())
# Freed tensors -> (held rng="fast" values, device they were computed on or None): a default
# materialize replays them so again, so that a free and a materialize change nothing (fast draws
# depend on the device; a part recorded for a GPU and made on the CPU needs no GPU to return).
freed_how: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())
freed_state: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())  # -> UserState
# Real tensors whose shadow clear_meta_init_cache dropped (only to say so when freeing them).
cleared: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())


def realized_base(
    rec: TensorRecord, device: torch.device | None, bases: dict[int, torch.Tensor]
) -> torch.Tensor | None:
    """The real memory of ``rec``'s storage as a flat tensor, if an earlier call made it real
    and it is still what that call made (``replay.realized``'s rule, which ``save`` and value
    reads follow too), on the requested device; else ``None`` (the storage is replayed)."""
    storage = rec.storage
    if id(storage) in bases:
        return bases[id(storage)]
    base = realized_memory(storage)
    if base is None or (device is not None and base.device != device):
        return None
    bases[id(storage)] = base
    return base


def freeable(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (DTensor's) real local shard when that is what was kept, else ``t``."""
    local = local_tensor(t)
    return local if local in kept else t


def why_not_kept(tensors: list[torch.Tensor], what: str) -> str:
    """Why real ``tensors`` have nothing kept to free them with, each reason counted."""
    earlier = sum(1 for t in tensors if t in sources and t not in cleared)
    dropped = sum(1 for t in tensors if t in cleared)
    never = len(tensors) - earlier - dropped

    def were(k: int) -> str:
        return f"{k} {'was' if k == 1 else 'were'}"

    reasons = []
    if earlier:
        reasons.append(
            f"{were(earlier)} materialized without keep_cache=True, which released the "
            "recording (materialize(..., keep_cache=True) on a tensor that is real already "
            "cannot bring it back: pass keep_cache=True the first time, as the widget's "
            "Materialize does, or run the cell that builds the model again)"
        )
    if dropped:
        reasons.append(f"{dropped} lost the recording to clear_meta_init_cache()")
    if never:
        reasons.append(f"{were(never)} never deferred (made real outside meta_init)")
    noun = "tensor" if len(tensors) == 1 else "tensors"
    return f"{len(tensors)} {noun} {what}: {'; '.join(reasons)}."


# ---------------------------------------------------------------------------------------------
# does a shadow still give the tensor's values?


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``; None for an inference tensor, which keeps no version counter (a change to
    it shows in the digest of its memory)."""
    return None if t.is_inference() else t._version


def why_not_reproducible(t: torch.Tensor, holder: Shadow) -> str | None:
    """Why materializing ``holder.deferred`` would not give ``t``'s current values, bit for bit
    (None: it would). Checked when freeing: whatever happened since materialization counts."""
    recording = holder.deferred
    if version_of(t) != holder.version or t.data_ptr() != holder.data_ptr:
        return "was written since it was materialized (trained, loaded into), or cast or moved"
    if (t.dtype, tuple(t.shape), t.stride()) != (
        recording.dtype,
        tuple(recording.shape),
        recording.stride(),
    ):
        return "was changed since it was materialized (cast or reshaped)"
    if holder.digest is not None and digest(t) != holder.digest:
        return (
            "was written since it was materialized (through .data, detach() or numpy, which "
            "the version counter misses)"
        )
    reason = _changed_sources(recording)
    if reason is not None:
        return reason
    if holder.digest is None:  # a file read: compare with the file
        try:
            with comparing_with_file():  # its digest: what the bytes must be when it comes back
                recorded = compute_values([recording._rec])[0]
        except MaterializationError as e:
            return f"cannot be read again from its file ({e})"
        with torch.no_grad():
            current = t.detach().to("cpu")
        if recorded.dtype != current.dtype or not torch.equal(recorded, current):
            return "differs from its checkpoint file (written since it was read)"
    return None


def _changed_sources(recording: DeferredTensor) -> str | None:
    """Why replaying ``recording`` would fail or differ now: a real tensor it was computed from
    (``load_state_dict`` of another model's tensors, by reference) was written since, or a file
    it reads changed or is gone."""
    for op in plan([recording._rec]).ops:
        if op.func is read_file_bytes:
            try:
                op.args[0].file.check()
            except MaterializationError as e:
                return f"cannot be read again from its file ({e})"
            continue
        for x in tree_leaves((op.args, op.kwargs)):
            if not isinstance(x, External) or x.tensor.is_meta:
                continue
            if x.tensor._version != x.version or (x.digest and digest(x.tensor) != x.digest):
                return (
                    f"was computed from a real tensor (at {x.where}) that was written since, "
                    "so its recording cannot give these values again"
                )
    return None


# ---------------------------------------------------------------------------------------------
# what a materialization keeps


def shadow_for(
    t: DeferredTensor,
    real: torch.Tensor,
    keep: bool,
    from_file: bool,
    file_read: DeferredTensor | None,
) -> tuple[DeferredTensor | None, tuple | None] | None:
    """What ``dematerialize`` will keep for ``t`` once ``real`` is in place: ``(recording,
    digest)``, the recording None for ``t``'s own (the object swapped out), or None for nothing.

    Tensors read from a file can always be freed again: their recording is "read the file", and
    they are compared with it rather than digested now. So can tensors loaded with
    ``checkpoint=``: their recording becomes that file read.
    """
    if file_read is None and not keep and not from_file:
        return None
    recording = t if file_read is None else file_read
    converted = None
    if real.dtype != recording.dtype or real.device != recording.device:
        # Cast (dtype=) or placed (device=) on the way: keep a recording of that too, so that
        # materializing again gives these values, not the uncast ones.
        with torch.no_grad(), recording_only():
            converted = recording.to(device=real.device, dtype=real.dtype)
    if file_read is not None:
        return (file_read if converted is None else converted), None
    return converted, None if from_file else digest(real)


def restamp(t: torch.Tensor, data: torch.Tensor) -> Shadow | None:
    """The shadow ``t`` gets once ``data`` (a cast or move of it) replaces its memory: a
    recording of that conversion, if ``t`` still held exactly its recording's values. A tensor
    trained since gets none: the cast must not make its training look like our values."""
    holder = kept.get(t)
    if holder is None or why_not_reproducible(t, holder) is not None:
        return None
    with torch.no_grad(), recording_only():  # the recording's cast, not the memory's values
        converted = holder.deferred.to(device=data.device, dtype=data.dtype)
    return Shadow(converted, -1, data.data_ptr(), None if holder.digest is None else digest(data))


def apply_restamp(t: torch.Tensor, stamp: Shadow | None) -> None:
    """Keep ``stamp`` for ``t`` (converted in place), or mark its old shadow stale."""
    if stamp is None:
        stale = kept.get(t)
        if stale is not None:  # its values are no recording's: freeing it needs force=True
            stale.version = -1
        return
    stamp.version = version_of(t)
    kept[t] = stamp


def swap_all(
    tensors: list[DeferredTensor],
    reals: list[torch.Tensor],
    holders: list[tuple[DeferredTensor | None, tuple | None] | None],
) -> None:
    """Swap every tensor into place and keep each one's shadow (call it in a critical section:
    Ctrl-C waits until all are done). If one swap fails, those done are swapped back."""
    done: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for t, r in zip(tensors, reals, strict=True):
            swap_in_place(t, r)
            done.append((t, r))
    except BaseException:
        for t, r in reversed(done):
            swap_in_place(t, r)
        raise
    for (t, swapped_out), holder in zip(done, holders, strict=True):
        if holder is not None:
            recording, content = holder
            if recording is None:
                recording = swapped_out  # the deferred side, exactly as it was
            kept[t] = Shadow(recording, version_of(t), t.data_ptr(), content)


def note_materialized(t: torch.Tensor, source: str, on: torch.device | None, fast: bool) -> None:
    """``t`` is real now: where its values came from, the device they were computed on
    (``device=``; or, for fast draws, which depend on it, the tensor's own), whether they are
    fast; whatever was kept of it while it was freed is done with."""
    sources[t] = source
    if freed_state:  # (a look-up makes a weak reference: none where nothing was freed)
        freed_state.pop(t, None)
    if freed_how:
        freed_how.pop(t, None)
    if on is None and fast:
        on = t.device  # fast draws depend on the device they were made on
    if on is not None:
        made_on[t] = on
    if fast:
        fast_values[t] = True


def note_freed(t: torch.Tensor) -> None:
    """``t`` is being freed: forget its shadow and sources; remember how a default
    ``materialize`` should make it again (fast values, the device they were made on)."""
    del kept[t]
    sources.pop(t, None)
    fast, on = fast_values.pop(t, None), made_on.pop(t, None)
    if fast or on is not None:  # a default materialize makes them so again
        freed_how[t] = (bool(fast), on)


def clear_meta_init_cache() -> None:
    """Release what is kept for later calls: dematerialization shadows, RNG checkpoints and
    values computed for reads.

    Use it when memory is tight and you will not free tensors again: deferred tensors stay
    materializable (their recording lives with them); tensors materialized with
    ``keep_cache=True`` can no longer be dematerialized, and exact-mode calls may have to
    regenerate random streams again. A model that is deleted needs none of this: its
    recording, RNG checkpoints and shadows go with it.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import clear_meta_init_cache, is_deferred, materialize, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        >>> _ = materialize(model[0], keep_cache=True)
        >>> clear_meta_init_cache()  # model[0] can no longer be freed
        >>> _ = materialize(model[1])  # deferred tensors are still materializable
        >>> is_deferred(model)
        False
    """
    for t in list(kept.keys()):
        cleared[t] = True
    kept.clear()
    _rng.forget_generators()
    for seg in _rng.live_segments():
        seg.clear_checkpoints()
    value_cache.clear()
