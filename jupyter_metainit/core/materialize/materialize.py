"""``materialize``: turn deferred tensors real in place, with the values eager construction gives.

What runs when you click Materialize, in order: check the arguments and refuse what cannot be
done (``failures``); take the lock; collect the tensors asked for (``queries``); compute every
value before anything changes (read a checkpoint, reuse memory made real earlier, replay the
recorded ops); build the real tensors (a Parameter of the recorded class, the user's attributes,
autograd links of non-leaves); swap them all into place in one critical section that Ctrl-C
cannot cut, keeping what a later ``dematerialize`` needs (``shadows``); tell whoever shows them
(``events``). A failure releases everything it allocated, whatever holds on to the exception
(IPython keeps the last traceback), and leaves every tensor as it was.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from jupyter_metainit.core.materialize import shadows
from jupyter_metainit.core.materialize.autograd_links import link_non_leaves
from jupyter_metainit.core.materialize.checkpoint_loads import load_for, load_reals_in_place
from jupyter_metainit.core.materialize.failures import (
    check_arguments,
    check_options,
    check_recorded_devices,
    placed,
    refuse_meta_inputs,
    refuse_unmaterializable,
    released,
    target_device,
)
from jupyter_metainit.core.materialize.progress import (
    MemoryProgress,
    inside_steps,
    progress_callback,
)
from jupyter_metainit.core.materialize.queries import (
    as_list_if_iterator,
    collect,
    describe_request,
    is_uninitialized,
    set_grads,
    tensor_source,
    with_grads,
)
from jupyter_metainit.core.materialize.user_state import as_inference, copy_user_attributes, made_as
from jupyter_metainit.core.record.files import one_header_check, read_file_bytes
from jupyter_metainit.core.record.tensor import SHARE_MEMORY_ATTR, DeferredTensor, as_parameter
from jupyter_metainit.core.replay import Plan, execute, plan, real_view
from jupyter_metainit.core.runtime import events
from jupyter_metainit.core.runtime.heap import return_freed_memory, return_when_freed
from jupyter_metainit.core.runtime.interrupts import critical, handling_interrupts
from jupyter_metainit.core.runtime.lock import exclusive

__all__ = ["materialize"]


def materialize(
    obj: torch.Tensor | torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module],
    device: str | torch.device | int | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    rng: Literal["exact", "fast"] | None = None,
    keep_cache: bool = False,
    progress: bool | Callable[[int, int], None] | Callable[[int, int, str], None] | None = None,
    checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    missing: Literal["error", "init"] = "error",
    root: torch.nn.Module | None = None,
    placement: Any = None,
) -> torch.Tensor | torch.nn.Module | Iterable[torch.Tensor | torch.nn.Module]:
    """Turn deferred tensors real, in place, with the values eager construction gives.

    Use it on the parts of a model built under :func:`meta_init` that you need now (a layer to
    inspect or fine-tune, the whole model on its device): only the recorded ops the requested
    tensors depend on are replayed, everything else stays deferred. Every reference to a tensor
    (module attributes, variables, optimizer lists, tied weights) sees the real tensor
    afterwards: the tensor object itself changes. Parts are independent: any subtree, in any
    order, gets the same values.

    Args:
        obj: a tensor, a module (all its parameters, buffers and tensor attributes, also in dicts,
            lists and tuples, recursively), or a list, tuple or other iterable of them
            (``model.parameters()``; an iterator is returned as a list).
        device: where the real tensors go (a device, its name, or a GPU index); ``None`` keeps
            each tensor's recorded device. Parts of ``obj`` that are real already are moved
            there in place, as ``nn.Module.to`` does (same tensor objects, ties kept).
        dtype: cast floating-point tensors to this dtype (or its name: ``"bf16"``,
            ``"bfloat16"``) after replay; real parts are cast in place too.
        rng: ``"exact"``: bit-identical to eager construction, whatever was materialized
            before and in whatever grouping. ``"fast"``: every random op draws from its own
            stream seeded from the recorded seed and the op's position; deterministic,
            order-independent, parallel and generated on the target device. ``None``
            (default): ``"exact"``, except for tensors freed by :func:`dematerialize` while
            holding fast values, which get those fast values back (a free and a materialize
            change no values); ``rng="exact"`` gives them eager's.
        keep_cache: keep the recording of these tensors, so that :func:`dematerialize` can make
            them deferred again. By default it is released (with everything no other deferred
            tensor needs).
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)`` (or
            ``callable(done_bytes, total_bytes, phase)``): bytes of memory the requested tensors
            hold when done, in ``dtype``; the total is known before anything runs and never
            changes. ``phase`` says in words what runs meanwhile (regenerating a random
            stream, reading checkpoint files). If the callable raises (to cancel), nothing is
            materialized and the exception propagates.
        checkpoint: path(s) of ``.safetensors`` files (or a sharded set's index JSON) to load the
            values from instead of replaying the initialisation. Parts of ``obj`` that are real
            already are loaded too, in place (same tensor objects, ties kept).
        missing: with ``checkpoint``: ``"error"`` (default) if a tensor is not in the checkpoint,
            or ``"init"`` to replay its recorded initialisation.
        root: with ``checkpoint``, when ``obj`` is a part of a model: the whole model, whose
            qualified names the checkpoint uses (``model.layers.3...``).
        placement: a plan from :func:`~jupyter_metainit.place` for the model ``obj``: each
            part onto its planned device, with one progress total (the plan does it).

    Returns:
        ``obj`` itself, its tensors now real (an iterator's items as a list). Calls from several
        threads on the same model are serialized (one lock): a second call waits for the
        first.

    Raises:
        ArgumentError: an argument has a value it cannot use (``dtype="bf17"``,
            ``rng="slow"``, ``device="meta"``).
        ArgumentTypeError: an argument has a type it does not take (``dtype=3``).
        MaterializationError: the values cannot be made: a lazy module before its forward
            pass, a plain PyTorch meta tensor (no recording), a real input changed since it
            was recorded, a tensor missing from ``checkpoint``, a device that is not here.
        NotEnoughMemoryError: the device ran out of memory.
        KeyboardInterrupt: Ctrl-C, or the exception a ``progress`` callable raised to cancel.
            Whatever fails or is interrupted leaves every tensor as it was (deferred ones
            deferred and materializable) and keeps nothing it allocated.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import is_deferred, materialize, meta_init
        >>> def build():
        ...     return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> _ = torch.manual_seed(0)
        >>> with meta_init():
        ...     model = build()
        >>> materialize(model[2])  # the last layer only: the first stays deferred
        Linear(in_features=64, out_features=8, bias=True)
        >>> is_deferred(model[0]), is_deferred(model[2])
        (True, False)
        >>> _ = torch.manual_seed(0)
        >>> eager = build()
        >>> torch.equal(model[2].weight, eager[2].weight)  # bit for bit eager's values
        True

        A progress callable sees the bytes made; ``dtype`` casts as it goes:

        >>> seen = []
        >>> _ = materialize(model, dtype="bf16", progress=lambda done, total: seen.append(done))
        >>> model[0].weight.dtype, seen[-1]  # (64 x 64 + 64) x 2 bytes made; model[2] is cast
        (torch.bfloat16, 8320)
        >>> torch.equal(model[0].weight, eager[0].weight.to(torch.bfloat16))
        True
    """
    check_options("materialize", root, keep_cache=keep_cache)
    if placement is not None and device is None:  # the plan puts each part where it goes
        options = dict(dtype=dtype, rng=rng, keep_cache=keep_cache, checkpoint=checkpoint)
        return placed(placement)(obj, progress=progress, missing=missing, root=root, **options)
    obj = as_list_if_iterator(obj)
    dtype = check_arguments(rng, missing, dtype, placement)
    device = target_device(device)
    callback, bar = progress_callback(progress)
    what = describe_request(obj)
    return_freed_memory()  # what earlier models left (a re-run cell's), before allocating anew
    try:
        with handling_interrupts(), exclusive(f"materializing {what}"):
            collected = collect(obj)
            tensors, grads = with_grads([t for t in collected if isinstance(t, DeferredTensor)])
            refuse_unmaterializable(collected, tensors, obj)
            if device is None:
                check_recorded_devices(tensors, what)
            reals = [t for t in collected if not isinstance(t, DeferredTensor) and not t.is_meta]
            if not tensors and not reals:
                return obj
            tracker = MemoryProgress(callback, tensors, dtype) if callback is not None else None
            call = _Call(obj, tensors, reals, device, dtype, rng, keep_cache, tracker, grads)
            failure: BaseException | None = None
            try:
                changed = _materialize_now(call, checkpoint, missing, root)
            except BaseException as exc:
                failure = released(exc, what, device, tensors, dtype)
            if failure is not None:
                raise failure  # outside the handler: no implicit link to the replay's frames
            if keep_cache:
                _warn_unkept(reals, what)
            events.publish("materialized", changed)
    finally:
        if bar is not None:
            bar.close()
    return obj


@dataclass
class _Call:
    """What one ``materialize`` call acts on, and how."""

    obj: Any
    tensors: list[DeferredTensor]  # to make real
    reals: list[torch.Tensor]  # real already: moved, cast or loaded in place
    device: torch.device | None
    dtype: torch.dtype | None
    rng: str | None
    keep: bool
    tracker: MemoryProgress | None
    grads: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor, its .grad): set after the swap


def _materialize_now(
    call: _Call, checkpoint: Any, missing: str, root: torch.nn.Module | None
) -> list[torch.Tensor]:
    """Compute everything, then swap it into place; nothing changes if anything fails.
    Returns the tensor objects that changed."""
    # id -> a recording of "read it from the checkpoint file" (what dematerialize keeps)
    file_reads: dict[int, DeferredTensor] = {}
    loaded = _read_checkpoint(call, checkpoint, missing, root, file_reads)
    aliased = _memory_made_real_earlier(call, loaded)
    to_replay = [t for t in call.tensors if id(t) not in loaded and id(t) not in aliased]
    how = _replay_how(to_replay, call.rng, call.device)
    replays = _replays(to_replay, how)
    sources = _value_sources(call.tensors, loaded, replays)
    values = _replay(call, replays)
    new, fast = _real_tensors(call, loaded, aliased, values, how)
    del values
    # Non-leaves (``self.scaled = self.w * 2``, a forward's output) get eager's grad_fn.
    link_non_leaves(call.tensors, new, call.device, call.rng or "exact")
    kept = [
        shadows.shadow_for(t, r, call.keep, sources[id(t)] == "checkpoint", file_reads.get(id(t)))
        for t, r in zip(call.tensors, new, strict=True)
    ]
    converted = _converted_reals(
        [t for t in call.reals if id(t) not in loaded], call.device, call.dtype
    )
    restamps = [shadows.restamp(t, data) for t, data in converted]
    records = [t._rec for t in call.tensors]
    with critical():
        shadows.swap_all(call.tensors, new, kept)
        set_grads(call.grads)
        for t in call.tensors:
            shadows.note_materialized(
                t, sources[id(t)], how.get(id(t), (None, None))[1], id(t) in fast
            )
        load_reals_in_place(call.reals, loaded, file_reads)
        for (t, data), stamp in zip(converted, restamps, strict=True):
            t.data = data
            shadows.apply_restamp(t, stamp)
    shadows.remember_realized(call.tensors, records)
    return_when_freed([*call.tensors, *(t for t, _ in converted)])
    return [*call.tensors, *(t for t in call.reals if id(t) in loaded), *(t for t, _ in converted)]


def _read_checkpoint(
    call: _Call,
    checkpoint: Any,
    missing: str,
    root: torch.nn.Module | None,
    file_reads: dict[int, DeferredTensor],
) -> dict[int, torch.Tensor]:
    """Values read from ``checkpoint=`` (by tensor ``id``), deferred and real parts alike."""
    if checkpoint is None:
        return {}
    if call.tracker is not None:
        call.tracker.phase("reading checkpoint files")
    with inside_steps(call.tracker):  # each tensor's read told as it goes, in steps
        loaded = load_for(
            call.obj,
            [*call.tensors, *call.reals],
            checkpoint,
            call.device,
            missing,
            call.dtype,
            root,
            file_reads,
        )
    if call.tracker is not None:
        call.tracker.loaded([t for t in call.tensors if id(t) in loaded])
    return loaded


def _memory_made_real_earlier(
    call: _Call, loaded: dict[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """The real memory an earlier call made of each tensor's storage, where it is still as made
    (by tensor ``id``): such a tensor becomes a view of it, not a copy."""
    bases: dict[int, torch.Tensor] = {}
    aliased: dict[int, torch.Tensor] = {}
    for t in call.tensors:
        if id(t) not in loaded:
            base = shadows.realized_base(t._rec, call.device, bases)
            if base is not None:
                aliased[id(t)] = base
    if call.tracker is not None and aliased:
        call.tracker.loaded([t for t in call.tensors if id(t) in aliased])
    return aliased


def _replay_how(
    tensors: list[DeferredTensor], rng: str | None, device: torch.device | None
) -> dict[int, tuple[str, torch.device | None]]:
    """``(rng mode, device to compute on)`` for each tensor, by ``id``.

    The mode is ``rng`` if given, else ``"fast"`` for tensors freed while holding fast values
    and ``"exact"`` for the others. The device is ``device``, except for tensors freed after
    being made on a device of their own (``device=`` then): computed there again where
    ``device`` is None, and always when their fast values come back (fast draws differ
    between devices), then moved. Tensors over one storage (tied, views) share both, so that
    they stay one memory.
    """
    by_storage: dict[int, tuple[bool, torch.device | None]] = {}
    freed_how = shadows.freed_how if shadows.freed_how else {}  # (a look-up makes a weak ref)
    for t in tensors:
        fast, made_on = freed_how.get(t, (False, None))
        was_fast, was_on = by_storage.get(id(t._rec.storage), (False, None))
        by_storage[id(t._rec.storage)] = (fast or was_fast, was_on or made_on)
    out: dict[int, tuple[str, torch.device | None]] = {}
    for t in tensors:
        fast, made_on = by_storage[id(t._rec.storage)]
        mode = rng if rng is not None else "fast" if fast else "exact"
        keep_draws = mode == "fast" and fast  # its fast values, drawn where they were drawn
        on = made_on if made_on is not None and (device is None or keep_draws) else device
        out[id(t)] = (mode, on)
    return out


_Replays = dict[tuple[str, torch.device | None], tuple[Plan, list[DeferredTensor]]]


def _replays(
    tensors: list[DeferredTensor], how: dict[int, tuple[str, torch.device | None]]
) -> _Replays:
    """One replay plan per (rng mode, device); the storages of two never overlap (see
    ``_replay_how``)."""
    groups: dict[tuple[str, torch.device | None], list[DeferredTensor]] = {}
    for t in tensors:
        groups.setdefault(how[id(t)], []).append(t)
    return {key: (plan([t._rec for t in group]), group) for key, group in groups.items()}


def _value_sources(
    tensors: list[DeferredTensor], loaded: dict[int, torch.Tensor], replays: _Replays
) -> dict[int, str]:
    """Where each tensor's values come from (``"checkpoint"`` or ``"init"``), by ``id``."""
    # A tensor's own plan says where its values come from; only worth asking if any file is read.
    reads_files = any(op.func is read_file_bytes for p, _ in replays.values() for op in p.ops)
    return {
        id(t): "checkpoint" if id(t) in loaded else tensor_source(t) if reads_files else "init"
        for t in tensors
    }


def _replay(call: _Call, replays: _Replays) -> dict[int, torch.Tensor]:
    """Run the replays: storage ``id`` -> its real memory, on the device asked for."""
    values: dict[int, torch.Tensor] = {}
    for (mode, on), (replay, group) in replays.items():
        # a checkpoint file's header once, not once per tensor
        with one_header_check(), refuse_meta_inputs(replay, group, call.obj):
            out = execute(replay, on, mode, call.tracker)
        for t in group:  # made where it was made before, then put where it is asked for
            key, target = id(t._rec.storage), call.device or t.device
            if on is not None and out[key].device != target:
                out[key] = out[key].to(target)
        values.update(out)
    return values


def _real_tensors(
    call: _Call,
    loaded: dict[int, torch.Tensor],
    aliased: dict[int, torch.Tensor],
    values: dict[int, torch.Tensor],
    how: dict[int, tuple[str, torch.device | None]],
) -> tuple[list[torch.Tensor], set[int]]:
    """The real tensor of each deferred one (same order), and the ids of those whose values
    come from ``rng="fast"`` draws."""
    used: set[int] = set()
    new = []
    fast: set[int] = set()
    freed_state = shadows.freed_state if shadows.freed_state else {}  # (as in _replay_how)
    for t in call.tensors:
        if id(t) in loaded:
            new.append(_build_real(t, loaded[id(t)], call.dtype, used, exact_tensor=True))
        elif id(t) in aliased:
            new.append(_build_real(t, aliased[id(t)], call.dtype, used))
        else:
            new.append(_build_real(t, values[id(t._rec.storage)], call.dtype, used))
        state = freed_state.get(t)
        if state is not None:  # freed before: what the user had set on the object
            state.apply(new[-1])
        # Values differ from eager only where a random op ran in fast mode.
        if (
            how.get(id(t), (call.rng, None))[0] == "fast"
            and id(t) not in loaded
            and any(op.rng is not None for op in plan([t._rec]).ops)
        ):
            fast.add(id(t))
    return new, fast


def _build_real(
    t: DeferredTensor,
    base: torch.Tensor,
    dtype: torch.dtype | None,
    used: set[int],
    exact_tensor: bool = False,
) -> torch.Tensor:
    """``t``'s real tensor over ``base`` (its storage's memory; with ``exact_tensor``, the
    tensor itself): cast, a Parameter of the recorded class, with the user's attributes."""
    real = base if exact_tensor else real_view(base, t._rec)
    if dtype is not None and real.is_floating_point() and real.dtype != dtype:
        real = real.to(dtype)
    if id(real) in used:
        real = real.detach()  # a second object over the same storage (aliases stay aliases)
    used.add(id(real))
    with made_as(t):  # under torch.inference_mode() where ``t`` was made so
        real = as_inference(t, real)
        if getattr(t, "_is_param", False):
            real = as_parameter(t, real, t.requires_grad)
        elif t.requires_grad and (real.is_floating_point() or real.is_complex()):
            real = real.detach().requires_grad_(True)
    copy_user_attributes(t, real)
    if t.__dict__.get(SHARE_MEMORY_ATTR) and real.device.type == "cpu":
        real.share_memory_()  # asked for while deferred (``model.share_memory()``)
    return real


def _converted_reals(
    reals: list[torch.Tensor], device: torch.device | None, dtype: torch.dtype | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Already-real parts that ``device``/``dtype`` ask to move or cast, with their new data.

    They are converted the way ``nn.Module.to`` does it (``t.data = ...``): the same tensor
    objects, so ties, optimizer references and hooks stay. Computed before anything changes.
    """
    out = []
    for t in reals:
        want_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        want_device = device if device is not None else t.device
        if t.dtype == want_dtype and t.device == want_device:
            continue
        with torch.no_grad():
            out.append((t, t.detach().to(want_device, want_dtype)))
    return out


def _warn_unkept(reals: list[torch.Tensor], what: str) -> None:
    """keep_cache=True cannot apply to parts that were real already with nothing kept: say so
    now, rather than let a later dematerialize be the first to tell."""
    unkept = [
        t for t in reals if shadows.freeable(t) not in shadows.kept and not is_uninitialized(t)
    ]
    if unkept:
        warnings.warn(
            f"keep_cache=True does not apply to the parts of {what} that were real already: "
            + shadows.why_not_kept(unkept, "cannot be freed again with dematerialize"),
            UserWarning,
            stacklevel=3,
        )
