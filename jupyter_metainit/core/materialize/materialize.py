"""``materialize`` / ``dematerialize``: turn deferred tensors real in place, and back.

Both are all-or-nothing: the work that can fail (replay, reading checkpoints, allocating) happens
before any tensor changes, the swap into place is a critical section that Ctrl-C cannot cut
(``_interrupts``), and a failure releases everything it allocated, whatever holds on to the
exception (IPython keeps the last traceback).
"""

from __future__ import annotations

import inspect
import os
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized, ValuesView
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from jupyter_metainit.core.errors import (
    MaterializationError,
    MetaInitError,
    NotEnoughMemoryError,
)
from jupyter_metainit.core.materialize.autograd_links import link_non_leaves
from jupyter_metainit.core.materialize.digest import digest
from jupyter_metainit.core.materialize.user_state import UserState, copy_user_attributes
from jupyter_metainit.core.record.files import read_file_bytes
from jupyter_metainit.core.record.graph import StorageRecord, TensorRecord
from jupyter_metainit.core.record.tensor import (
    INTERNAL_ATTRS,
    SHARE_MEMORY_ATTR,
    DeferredTensor,
    as_parameter,
)
from jupyter_metainit.core.replay.replay import Progress, compute_values, execute, plan, real_view
from jupyter_metainit.core.replay.values import value_cache
from jupyter_metainit.core.rng import streams as _rng
from jupyter_metainit.core.runtime import events as _events
from jupyter_metainit.core.runtime.arguments import (
    check_floating_dtype,
    missing_device_reason,
    parse_device,
)
from jupyter_metainit.core.runtime.dtensor import local_tensor
from jupyter_metainit.core.runtime.format import format_bytes
from jupyter_metainit.core.runtime.interrupts import critical, handling_interrupts
from jupyter_metainit.core.runtime.lock import exclusive
from jupyter_metainit.core.runtime.memory import free_memory, is_out_of_memory
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.swap import swap_in_place
from jupyter_metainit.core.runtime.walk import materialized_sources, unique_tensors

__all__ = [
    "clear_meta_init_cache",
    "dematerialize",
    "is_deferred",
    "materialize",
    "tensor_source",
    "tensor_state",
]

_RNG_MODES = ("exact", "fast")


class _Shadow:
    """The deferred side of a materialized tensor, kept for :func:`dematerialize`, with what
    the real tensor looked like then (version, address, digest of its memory).

    ``deferred`` always records exactly the values the real tensor had when this was made:
    the init, a read of the checkpoint file it was loaded from, a cast or a move that
    ``materialize`` applied. ``digest`` is None where the recording reads a file: the tensor
    is compared with the file when it is freed.

    Kept in a side table (``_kept``), never on the tensor: ``torch.save`` and pickling a
    parameter then write nothing of ours.
    """

    __slots__ = ("data_ptr", "deferred", "digest", "version")

    def __init__(
        self, deferred: DeferredTensor, version: int, data_ptr: int, content: tuple | None
    ) -> None:
        self.deferred = deferred
        self.version = version
        self.data_ptr = data_ptr
        self.digest = content


# Keyed by the tensor object, whose identity materialize and dematerialize preserve.
_kept: WeakIdKeyDictionary = WeakIdKeyDictionary()  # real tensor -> _Shadow
_sources = materialized_sources  # real tensor -> "checkpoint" / "init"
_fast_values: WeakIdKeyDictionary = WeakIdKeyDictionary()  # real tensors with rng="fast" values
# Real tensors materialized with device=: the device their values were computed on.
_made_on: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Freed tensors -> (held rng="fast" values, device they were computed on or None): a default
# materialize replays them so again, so that a free and a materialize change nothing (fast draws
# depend on the device; a part recorded for a GPU and made on the CPU needs no GPU to return).
_freed_how: WeakIdKeyDictionary = WeakIdKeyDictionary()
_freed_state: WeakIdKeyDictionary = WeakIdKeyDictionary()  # freed tensor -> UserState
# Real tensors whose shadow clear_meta_init_cache dropped (only to say so when freeing them).
_cleared: WeakIdKeyDictionary = WeakIdKeyDictionary()

# Storages a materialization made real, with the tensor over each, the writes recorded on the
# storage then, and the memory's address: a deferred view of the same storage materialized in a
# later call (``self.w_t = self.w.t()``, ``materialize(model.a)`` then ``materialize(model.b)``)
# becomes a view of that memory, as in eager and in a whole-model call.
_realized: weakref.WeakKeyDictionary[StorageRecord, tuple[weakref.ref, int, int]] = (
    weakref.WeakKeyDictionary()
)


def _realized_base(
    rec: TensorRecord, device: torch.device | None, bases: dict[int, torch.Tensor]
) -> torch.Tensor | None:
    """The real memory of ``rec``'s storage as a flat tensor, if an earlier call made it real
    and it is still what that call made (same memory, nothing recorded on it since, on the
    requested device); else ``None`` (the storage is replayed)."""
    storage = rec.storage
    if id(storage) in bases:
        return bases[id(storage)]
    real = _realized_tensor(storage)
    if real is None or (device is not None and real.device != device):
        return None
    memory = real.untyped_storage()
    with plain():
        base = torch.empty(0, dtype=storage.dtype, device=real.device)
        base.set_(memory, 0, (storage.nbytes // storage.dtype.itemsize,))
    bases[id(storage)] = base
    return base


def _realized_tensor(storage: StorageRecord) -> torch.Tensor | None:
    """The real tensor an earlier call made over ``storage``, while it still holds that memory
    and nothing was recorded on the storage since."""
    entry = _realized.get(storage)
    if entry is None:
        return None
    ref, writes, address = entry
    real = ref()
    if real is None or isinstance(real, DeferredTensor) or real.is_meta:
        return None
    memory = real.untyped_storage()
    if (
        len(storage.writes) != writes
        or memory.data_ptr() != address
        or memory.nbytes() != storage.nbytes
    ):
        return None
    return real


def _remember_realized(tensors: list[torch.Tensor], records: list[TensorRecord]) -> None:
    """After the swap: note the storages now real whose memory holds them as recorded (not a
    cast copy, not a partial copy)."""
    for t, rec in zip(tensors, records, strict=True):
        if t.dtype != rec.dtype or isinstance(t, DeferredTensor):
            continue
        memory = t.untyped_storage()
        if memory.nbytes() == rec.storage.nbytes and _realized_tensor(rec.storage) is None:
            _realized[rec.storage] = (weakref.ref(t), len(rec.storage.writes), memory.data_ptr())


# ---------------------------------------------------------------------------------------------
# what a tensor is


def is_deferred(obj: Any) -> bool:
    """True for a deferred tensor, or a module with at least one deferred parameter, buffer or
    tensor attribute (also one kept in a dict, list or tuple attribute)."""
    if isinstance(obj, torch.Tensor):
        return isinstance(_deferred_local(obj), DeferredTensor) or _is_uninitialized(obj)
    if isinstance(obj, torch.nn.Module):
        return any(is_deferred(t) for t in _module_tensors(obj))
    if isinstance(obj, (list, tuple, set, frozenset, ValuesView, Iterator)):
        return any(is_deferred(x) for x in obj)
    return False


def tensor_state(t: torch.Tensor) -> str:
    """Where a tensor's values are: ``"deferred"`` (recorded, materializable), ``"meta"``
    (PyTorch's meta device: no values and no recording), ``"uninitialized"`` (a lazy module's
    parameter before its first forward pass), or the device of a real tensor (``"cpu"``)."""
    if _is_uninitialized(t):
        return "uninitialized"
    if isinstance(_deferred_local(t), DeferredTensor):
        return "deferred"
    if t.is_meta:
        return "meta"
    return str(t.device)


def tensor_values(t: torch.Tensor) -> str:
    """Whether a real tensor's values are eager's: ``"exact"``, or ``"fast"`` when random ops
    were replayed with ``rng="fast"`` (deterministic, but not what eager construction gives).
    ``""`` for a tensor with no values (deferred, meta, lazy)."""
    if _is_uninitialized(t) or t.is_meta or isinstance(_deferred_local(t), DeferredTensor):
        return ""
    return "fast" if t in _fast_values else "exact"


def tensor_source(t: torch.Tensor) -> str:
    """Where a tensor's values come from: ``"checkpoint"`` (read from a file, perhaps
    converted), ``"init"`` (computed by the model's code) or ``""`` (not known: a tensor that
    was never deferred, or a meta/lazy one)."""
    local = _deferred_local(t)
    if isinstance(local, DeferredTensor):
        ops = plan([local._rec]).ops
        from_file = any(op.func is read_file_bytes for op in ops)
        return "checkpoint" if from_file and not any(op.rng is not None for op in ops) else "init"
    return _sources.get(t, "")


def _is_uninitialized(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.parameter.UninitializedTensorMixin)


def _deferred_local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (DTensor's) deferred local shard, else ``t`` itself.

    After ``fully_shard`` or ``distribute_tensor`` a deferred parameter is a DTensor wrapping a
    deferred local tensor; materializing that local tensor in place materializes the shard.
    Duck-typed, so the core needs no ``torch.distributed`` import.
    """
    if isinstance(t, DeferredTensor):
        return t
    local = local_tensor(t)
    return local if isinstance(local, DeferredTensor) else t


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers (persistent or not) and deferred tensor attributes, each object once.

    A sharded parameter (DTensor) contributes its deferred local shard.
    """
    seen: dict[int, torch.Tensor] = {}
    for t in unique_tensors(module, attributes=True):
        local = _deferred_local(t)
        seen.setdefault(id(local), local)
    return list(seen.values())


def _as_list_if_iterator(obj: Any) -> Any:
    """A one-shot iterable (``model.parameters()``, a generator) as a list, so that it can be
    walked more than once; anything else as it is."""
    if isinstance(obj, Iterator) and not isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return list(obj)
    return obj


def _collect(obj: Any, verb: str = "materialize") -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [_deferred_local(obj)]
    if isinstance(obj, torch.nn.Module):
        return _module_tensors(obj)
    if isinstance(obj, (list, tuple, set, frozenset, ValuesView)):
        out: dict[int, torch.Tensor] = {}
        for x in obj:
            if not isinstance(x, (torch.Tensor, torch.nn.Module, list, tuple)):
                hint = " (for named_parameters(), pass parameters())" if isinstance(x, str) else ""
                raise TypeError(
                    f"{verb}() takes a tensor, a module, or a list (or other iterable, e.g. "
                    f"model.parameters()) of them; got a {type(x).__name__} in the list{hint}"
                )
            for t in _collect(x, verb):
                out.setdefault(id(t), t)
        return list(out.values())
    raise TypeError(
        f"{verb}() takes a tensor, a module, or a list (or other iterable, e.g. "
        f"model.parameters()) of them; got {type(obj).__name__}"
    )


def iter_deferred(obj: Any) -> Iterable[DeferredTensor]:
    return [t for t in _collect(obj) if isinstance(t, DeferredTensor)]


# ---------------------------------------------------------------------------------------------
# arguments


def _target_device(device: Any) -> torch.device | None:
    """Check ``device=``; every refusal says what would work instead."""
    d = parse_device(device)
    if d is None:
        return None
    if d.type == "meta":
        raise ValueError(
            "materialize(device='meta') makes no sense; the tensor is deferred already"
        )
    reason = missing_device_reason(d)
    if reason is not None:
        hint = (
            "" if d.type == "cuda" and torch.cuda.is_available()
            else "; use device='cpu'" if d.type == "cuda"
            else "; use 'cpu' or a CUDA device"
        )  # fmt: skip
        raise MaterializationError(f"cannot materialize to {device!r}: {reason}{hint}")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _check_recorded_devices(tensors: list[DeferredTensor], what: str) -> None:
    """With no ``device=``, each tensor goes where it was recorded for (``device=`` in the
    model's code, ``meta_init(device=...)``): refuse before any work if that device is not
    here, rather than fall back to another device silently."""
    seen: dict[torch.device, int] = {}
    for t in tensors:
        seen[t.device] = seen.get(t.device, 0) + 1
    for d, count in seen.items():
        if d.type == "meta":
            raise MaterializationError(
                f"{count} tensor(s) of {what} were recorded for PyTorch's meta device (moved "
                "there with .to('meta') or built with device='meta'): a meta tensor has a shape "
                "but never values, so there is nothing to materialize there. Their recorded "
                "values can be materialized on a real device: pass device='cpu' (or 'cuda'). "
                "Nothing was materialized."
            )
        reason = missing_device_reason(d)
        if reason is not None:
            raise MaterializationError(
                f"{count} tensor(s) of {what} were recorded for {d}, and {reason}; pass "
                "device='cpu' (or another device you have) to materialize them there. "
                "Nothing was materialized."
            )


ProgressCallback = Callable[..., None]


def progress_callback(progress: Any) -> tuple[ProgressCallback | None, Any]:
    """``progress=`` as a ``callable(done_bytes, total_bytes, phase)`` (and a bar to close)."""
    if progress is None or progress is False:
        return None, None
    if callable(progress):
        return _with_phase(progress), None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc="materialize")

        def update(done: int, total: int, phase: str = "") -> None:
            if bar.total != total:
                bar.total = total
            if phase:
                bar.set_postfix_str(phase, refresh=False)
            bar.update(done - bar.n)

        return update, bar
    raise TypeError("progress must be None, a bool, or a callable(done_bytes, total_bytes)")


def _with_phase(callback: Callable[..., None]) -> ProgressCallback:
    """Pass ``phase`` only to callables that take it (``callable(done, total)`` works)."""
    try:
        params = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):
        return lambda done, total, phase="": callback(done, total)
    takes = any(p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD or p.name == "phase"
                for p in params) or len(list(params)) >= 3  # fmt: skip
    if takes:
        return callback
    return lambda done, total, phase="": callback(done, total)


class _MemoryProgress(Progress):
    """Progress in the bytes the requested tensors hold when done (in the requested dtype):
    the total is known before anything runs and never changes; ``done`` never decreases."""

    def __init__(self, callback: ProgressCallback, tensors: list[DeferredTensor],
                 dtype: torch.dtype | None) -> None:  # fmt: skip
        self.callback = callback
        self.sizes = _storage_sizes(tensors, dtype)
        self.total = sum(self.sizes.values())
        self.done = 0
        self.current = ""
        callback(0, self.total, "starting")

    def storage_done(self, storage: StorageRecord) -> None:
        self.done += self.sizes.pop(id(storage), 0)
        self.callback(self.done, self.total, self.current)

    def phase(self, text: str) -> None:
        self.current = text
        self.callback(self.done, self.total, text)

    def loaded(self, tensors: list[DeferredTensor]) -> None:
        for t in tensors:
            self.done += self.sizes.pop(id(t._rec.storage), 0)
        self.callback(self.done, self.total, self.current)


# ---------------------------------------------------------------------------------------------
# failures


def _storage_sizes(tensors: list[DeferredTensor], dtype: torch.dtype | None) -> dict[int, int]:
    """Bytes each storage of ``tensors`` holds when real, floating ones cast to ``dtype``."""
    sizes: dict[int, int] = {}
    for t in tensors:
        size = t._rec.storage.nbytes
        if dtype is not None and t.is_floating_point():
            size = size // t.element_size() * dtype.itemsize
        sizes[id(t._rec.storage)] = size
    return sizes


def _released(
    exc: BaseException,
    what: str,
    device: torch.device | None,
    tensors: list[DeferredTensor],
    dtype: torch.dtype | None,
) -> BaseException:
    """The exception to raise for a failed materialization, holding no frame of the replay.

    Tracebacks keep every frame's locals alive, and IPython keeps the last traceback: the
    partial replay's tensors would stay in memory. The frames are dropped (their text is kept
    as a note on unexpected errors), and running out of memory becomes one line that says what
    was needed and what is free.
    """
    chained: BaseException | None = exc
    while chained is not None:
        chained.__traceback__ = None if chained is not exc else chained.__traceback__
        chained = chained.__cause__ or chained.__context__
    if is_out_of_memory(exc):
        exc.__traceback__ = None
        target = device or (tensors[0].device if tensors else torch.device("cpu"))
        free = free_memory(target)
        need = sum(_storage_sizes(tensors, dtype).values())
        return NotEnoughMemoryError(
            f"not enough memory on {target} to materialize {what}: it needs "
            f"{format_bytes(need)}"
            + (f" and {format_bytes(free)} is free" if free is not None else "")
            + "; materialize a smaller part, a smaller dtype (dtype=torch.bfloat16), or "
            "check first with jupyter_metainit.fits(...). Nothing was materialized."
        )
    if not isinstance(exc, (MetaInitError, KeyboardInterrupt, TypeError, ValueError)):
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
        if hasattr(exc, "add_note"):
            exc.add_note("Raised while materializing, where:\n" + text.rstrip())
    exc.__traceback__ = None
    return exc


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.nn.Module):
        return type(obj).__name__
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, Sized):
        return f"{len(obj)} objects"
    return f"a {type(obj).__name__}"


# ---------------------------------------------------------------------------------------------
# materialize


def materialize(
    obj: Any,
    device: Any = None,
    *,
    dtype: torch.dtype | None = None,
    rng: str | None = None,
    keep_cache: bool = False,
    progress: Any = None,
    checkpoint: Any = None,
    missing: str = "error",
    root: torch.nn.Module | None = None,
) -> Any:
    """Turn deferred tensors real, in place, with the values eager construction gives.

    Every reference to a tensor (module attributes, variables, optimizer lists, tied weights)
    sees the real tensor afterwards: the tensor object itself changes. Only the recorded ops the
    requested tensors depend on are replayed; everything else stays deferred.

    Args:
        obj: a tensor, a module (all its parameters, buffers and tensor attributes, also in dicts,
            lists and tuples, recursively), or a list, tuple or other iterable of them
            (``model.parameters()``; an iterator is returned as a list).
        device: where the real tensors go; ``None`` keeps each tensor's recorded device.
            Parts of ``obj`` that are real already are moved there in place, as
            ``nn.Module.to`` does (same tensor objects, ties kept).
        dtype: cast floating-point tensors to this dtype after replay; real parts are cast in
            place too.
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

    Returns:
        ``obj`` (an iterator's items as a list). A failed or interrupted call leaves every
        tensor as it was (deferred ones deferred and materializable) and keeps nothing it
        allocated. Calls from several threads on the same model are serialized (see ``_busy``).
    """
    obj = _as_list_if_iterator(obj)
    if rng is not None and rng not in _RNG_MODES:
        raise ValueError(f"rng must be 'exact', 'fast' or None (the default), not {rng!r}")
    if missing not in ("error", "init"):
        raise ValueError(f"missing must be 'error' or 'init', not {missing!r}")
    check_floating_dtype(
        dtype,
        arg="dtype",
        use="dtype= casts the floating-point tensors (torch.bfloat16, "
        "torch.float16, torch.float32, ...). Quantize after materializing instead.",
    )
    target_device = _target_device(device)
    callback, bar = progress_callback(progress)
    try:
        with handling_interrupts(), exclusive(f"materializing {_describe(obj)}"):
            collected = _collect(obj)
            tensors = [t for t in collected if isinstance(t, DeferredTensor)]
            _refuse_unmaterializable(collected, tensors)
            if target_device is None:
                _check_recorded_devices(tensors, _describe(obj))
            reals = [
                t for t in collected
                if not isinstance(t, DeferredTensor) and not t.is_meta
            ]  # fmt: skip
            if not tensors and not reals:
                return obj
            failure: BaseException | None = None
            try:
                swapped = _materialize_now(
                    obj, tensors, reals, target_device, dtype, rng, keep_cache, callback,
                    checkpoint, missing, root,
                )  # fmt: skip
            except BaseException as exc:
                failure = _released(exc, _describe(obj), target_device, tensors, dtype)
            if failure is not None:
                raise failure  # outside the handler: no implicit link to the replay's frames
            if keep_cache:
                _warn_unkept(reals, _describe(obj))
            _events.publish("materialized", swapped)
    finally:
        if bar is not None:
            bar.close()
    return obj


def _warn_unkept(reals: list[torch.Tensor], what: str) -> None:
    """keep_cache=True cannot apply to parts that were real already with nothing kept: say so
    now, rather than let a later dematerialize be the first to tell."""
    unkept = [
        t for t in reals if _freeable(t) not in _kept and not _is_uninitialized(t)
    ]  # fmt: skip
    if unkept:
        warnings.warn(
            f"keep_cache=True does not apply to the parts of {what} that were real already: "
            + _why_not_kept(unkept, "cannot be freed again with dematerialize"),
            UserWarning,
            stacklevel=3,
        )


def _refuse_unmaterializable(collected: list[torch.Tensor], tensors: list) -> None:
    if any(_is_uninitialized(t) for t in collected):
        raise MaterializationError(
            "a lazy module's parameters have no shape yet; run a forward pass on example inputs "
            "first (inside meta_init, or with jupyter_metainit.dry_run)"
        )
    meta = [t for t in collected if not isinstance(t, DeferredTensor) and t.is_meta]
    if meta:
        which = "these tensors are" if not tensors else f"{len(meta)} of these tensors are"
        raise MaterializationError(
            f"{which} on PyTorch's meta device, with no recording of their values (built with "
            "`torch.device('meta')`, not `jupyter_metainit.meta_init()`); nothing was "
            "materialized. Build the model inside `with jupyter_metainit.meta_init():` to "
            "materialize it, or leave those parts out."
        )


def _build_real(
    t: DeferredTensor, base: torch.Tensor, dtype: torch.dtype | None, used: set[int],
    exact_tensor: bool = False,
) -> torch.Tensor:  # fmt: skip
    real = base if exact_tensor else real_view(base, t._rec)
    if dtype is not None and real.is_floating_point() and real.dtype != dtype:
        real = real.to(dtype)
    if id(real) in used:
        real = real.detach()  # a second object over the same storage (aliases stay aliases)
    used.add(id(real))
    if getattr(t, "_is_param", False):
        real = as_parameter(t, real, t.requires_grad)
    elif t.requires_grad and (real.is_floating_point() or real.is_complex()):
        real = real.detach().requires_grad_(True)
    copy_user_attributes(t, real)
    if t.__dict__.get(SHARE_MEMORY_ATTR) and real.device.type == "cpu":
        real.share_memory_()  # asked for while deferred (``model.share_memory()``)
    return real


def _materialize_now(
    obj: Any, tensors: list[DeferredTensor], reals: list[torch.Tensor],
    device: torch.device | None, dtype: torch.dtype | None, rng: str | None, keep: bool,
    callback: Any, checkpoint: Any, missing: str, root: torch.nn.Module | None,
) -> list[torch.Tensor]:  # fmt: skip
    """Compute everything, then swap it into place; nothing changes if anything fails."""
    loaded: dict[int, torch.Tensor] = {}
    # id -> a recording of "read it from the checkpoint file" (what dematerialize keeps)
    file_reads: dict[int, DeferredTensor] = {}
    tracker = _MemoryProgress(callback, tensors, dtype) if callback is not None else None
    if checkpoint is not None:
        from jupyter_metainit.core.materialize.checkpoint import load_for

        if tracker is not None:
            tracker.phase("reading checkpoint files")
        loaded = load_for(
            obj, [*tensors, *reals], checkpoint, device, missing, dtype, root, file_reads
        )
        if tracker is not None:
            tracker.loaded([t for t in tensors if id(t) in loaded])
    bases: dict[int, torch.Tensor] = {}
    aliased: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in loaded:
            base = _realized_base(t._rec, device, bases)
            if base is not None:
                aliased[id(t)] = base
    if tracker is not None and aliased:
        tracker.loaded([t for t in tensors if id(t) in aliased])
    to_replay = [t for t in tensors if id(t) not in loaded and id(t) not in aliased]
    how = _replay_how(to_replay, rng, device)
    # One replay per (mode, device); the storages of two never overlap (see _replay_how).
    groups: dict[tuple[str, torch.device | None], list[DeferredTensor]] = {}
    for t in to_replay:
        groups.setdefault(how[id(t)], []).append(t)
    replays = {key: (plan([t._rec for t in group]), group) for key, group in groups.items()}
    # A tensor's own plan says where its values come from; only worth asking if any file is read.
    reads_files = any(
        op.func is read_file_bytes for p, _ in replays.values() for op in p.ops
    )  # fmt: skip
    sources = {
        id(t): "checkpoint" if id(t) in loaded else tensor_source(t) if reads_files else "init"
        for t in tensors
    }
    env: dict[int, torch.Tensor] = {}
    for (mode, on), (replay, group) in replays.items():
        out = execute(replay, on, mode, tracker)
        for t in group:  # made where it was made before, then put where it is asked for
            key, target = id(t._rec.storage), device or t.device
            if on is not None and out[key].device != target:
                out[key] = out[key].to(target)
        env.update(out)

    used: set[int] = set()
    new = []
    fast: set[int] = set()  # ids of tensors whose values come from rng="fast" draws
    for t in tensors:
        if id(t) in loaded:
            new.append(_build_real(t, loaded[id(t)], dtype, used, exact_tensor=True))
        elif id(t) in aliased:
            new.append(_build_real(t, aliased[id(t)], dtype, used))
        else:
            new.append(_build_real(t, env[id(t._rec.storage)], dtype, used))
        state = _freed_state.get(t)
        if state is not None:  # freed before: what the user had set on the object
            state.apply(new[-1])
        # Values differ from eager only where a random op ran in fast mode.
        if (
            how.get(id(t), (rng, None))[0] == "fast"
            and id(t) not in loaded
            and any(op.rng is not None for op in plan([t._rec]).ops)
        ):
            fast.add(id(t))
    del env
    # Non-leaves (``self.scaled = self.w * 2``, a forward's output) get eager's grad_fn.
    link_non_leaves(tensors, new, device, rng)
    holders = [
        _holder_for(t, r, keep, sources[id(t)] == "checkpoint", file_reads.get(id(t)))
        for t, r in zip(tensors, new, strict=True)
    ]
    converted = _converted_reals([t for t in reals if id(t) not in loaded], device, dtype)
    restamps = [_restamp(t, data) for t, data in converted]
    records = [t._rec for t in tensors]
    with critical():
        _swap_all(tensors, new, holders)
        for t in tensors:
            _sources[t] = sources[id(t)]
            _freed_state.pop(t, None)
            _freed_how.pop(t, None)
            made_on = how.get(id(t), (None, None))[1]
            if made_on is None and id(t) in fast:
                made_on = t.device  # fast draws depend on the device they were made on
            if made_on is not None:
                _made_on[t] = made_on
            if id(t) in fast:
                _fast_values[t] = True
        with torch.no_grad():
            for t in reals:
                if id(t) in loaded:
                    value = loaded[id(t)]
                    t.copy_(value if value.dtype == t.dtype else value.to(t.dtype))
                    _sources[t] = "checkpoint"
                    if id(t) in file_reads:  # freeing it gives the checkpoint's values again
                        _kept[t] = _Shadow(file_reads[id(t)], t._version, t.data_ptr(), None)
        for (t, data), restamp in zip(converted, restamps, strict=True):
            t.data = data
            _restamped(t, restamp)
    _remember_realized(tensors, records)
    return [*tensors, *(t for t in reals if id(t) in loaded), *(t for t, _ in converted)]


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
    for t in tensors:
        fast, made_on = _freed_how.get(t, (False, None))
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


def _holder_for(
    t: DeferredTensor, real: torch.Tensor, keep: bool, from_file: bool,
    file_read: DeferredTensor | None,
) -> tuple[DeferredTensor | None, tuple | None] | None:  # fmt: skip
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
        with torch.no_grad():
            converted = recording.to(device=real.device, dtype=real.dtype)
    if file_read is not None:
        return (file_read if converted is None else converted), None
    return converted, None if from_file else digest(real)


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


def _restamp(t: torch.Tensor, data: torch.Tensor) -> _Shadow | None:
    """The shadow ``t`` gets once ``data`` (a cast or move of it) replaces its memory: a
    recording of that conversion, if ``t`` still held exactly its recording's values. A tensor
    trained since gets none: the cast must not make its training look like our values."""
    holder = _kept.get(t)
    if holder is None or _why_not_reproducible(t, holder) is not None:
        return None
    with torch.no_grad():
        converted = holder.deferred.to(device=data.device, dtype=data.dtype)
    return _Shadow(converted, -1, data.data_ptr(), None if holder.digest is None else digest(data))


def _restamped(t: torch.Tensor, restamp: _Shadow | None) -> None:
    if restamp is None:
        stale = _kept.get(t)
        if stale is not None:  # its values are no recording's: freeing it needs force=True
            stale.version = -1
        return
    restamp.version = t._version
    _kept[t] = restamp


def _swap_all(
    tensors: list[DeferredTensor],
    reals: list[torch.Tensor],
    holders: list[tuple[DeferredTensor | None, tuple | None] | None],
) -> None:
    """Swap every tensor into place (a critical section: Ctrl-C waits until all are done)."""
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
            _kept[t] = _Shadow(recording, t._version, t.data_ptr(), content)


# ---------------------------------------------------------------------------------------------
# dematerialize


def dematerialize(obj: Any, *, force: bool = False, root: torch.nn.Module | None = None) -> Any:
    """Make materialized tensors deferred again and free their memory.

    Works on tensors materialized with ``keep_cache=True`` (the widget and magics do that), read
    from a file (``from_pretrained`` under ``meta_init``) or loaded with ``checkpoint=``.
    Materializing them again gives the values they have now, bit for bit (``fast`` values
    too: a tensor freed with them gets them again from ``materialize``'s default, eager's from
    an explicit ``rng="exact"``): that is checked here, whatever happened since (training,
    loads, casts, moves, a changed source tensor or file). A tensor that fails the check is
    refused, by name, unless ``force=True`` (which drops its current values); so is a tensor
    holding a gradient (``.grad``: clear it with ``zero_grad(set_to_none=True)``, or
    ``force=True`` drops it). Refusals change nothing. What the user set on the tensor objects
    (``requires_grad``, attributes, hooks, a Parameter subclass) is kept. ``root`` (the whole
    model, when ``obj`` is a part or a list of parts) only names tensors in errors.
    """
    obj = _as_list_if_iterator(obj)
    with handling_interrupts(), exclusive(f"freeing {_describe(obj)}"):
        # (the object the user holds, the one that holds the memory): a DTensor and its shard
        tensors = [
            (t, _freeable(t)) for t in _collect(obj, "dematerialize")
            if not isinstance(t, DeferredTensor) and not t.is_meta
        ]  # fmt: skip
        names = _names_in(root) if root is not None else _names_in(obj)
        pairs: list[tuple[torch.Tensor, _Shadow]] = []
        refused: list[str] = []
        with_grad: list[str] = []
        lost: list[torch.Tensor] = []
        for held, t in tensors:
            holder = _kept.get(t)
            if holder is None:
                if not _is_uninitialized(t):
                    lost.append(t)
                continue
            if not force:
                # A gradient is the user's data and its memory: freeing would drop it silently.
                if _grad_of(held) is not None or _grad_of(t) is not None:
                    with_grad.append(_name(t, names))
                reason = _why_not_reproducible(t, holder)
                if reason is not None:
                    refused.append(f"{_name(t, names)} {reason}")
            pairs.append((t, holder))
        if lost:
            raise MaterializationError(
                _why_not_kept(lost, "cannot be made deferred again") + " Nothing was changed."
            )
        if with_grad:
            more = f" (and {len(with_grad) - 3} more)" if len(with_grad) > 3 else ""
            raise MaterializationError(
                f"cannot free {len(with_grad)} tensor(s) holding a gradient (.grad), which "
                f"freeing would drop: {', '.join(with_grad[:3])}{more}. Nothing was changed. "
                "Clear the gradients first (model.zero_grad(set_to_none=True), or "
                "optimizer.zero_grad()), or pass force=True to drop them."
            )
        if refused:
            more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
            raise MaterializationError(
                f"cannot free {len(refused)} tensor(s): materializing again would not give "
                f"their current values, so freeing would lose them: {'; '.join(refused[:3])}"
                f"{more}. Nothing was changed. Pass force=True to free them anyway (their "
                "current values are dropped; materializing gives the recorded ones)."
            )
        prepared = [(t, _deferred_for(t, holder), UserState(t)) for t, holder in pairs]
        with critical():
            for t, deferred, state in prepared:
                del _kept[t]
                _sources.pop(t, None)
                fast, made_on = _fast_values.pop(t, None), _made_on.pop(t, None)
                if fast or made_on is not None:  # a default materialize makes them so again
                    _freed_how[t] = (bool(fast), made_on)
                swap_in_place(t, deferred)
                _freed_state[t] = state
        freed = [t for t, _, _ in prepared]
        pairs.clear()
        prepared.clear()
        deferred = None  # the real storages' last references go with these
        _return_memory_to_the_os()
        _events.publish("dematerialized", freed)
    return obj


def _why_not_kept(tensors: list[torch.Tensor], what: str) -> str:
    """Why real ``tensors`` have nothing kept to free them with, each reason counted."""
    earlier = sum(1 for t in tensors if t in _sources and t not in _cleared)
    cleared = sum(1 for t in tensors if t in _cleared)
    never = len(tensors) - earlier - cleared
    reasons = []
    if earlier:
        reasons.append(
            f"{earlier} were materialized without keep_cache=True, which released their "
            "recording (materialize(..., keep_cache=True) on a tensor that is real already "
            "cannot bring it back: pass keep_cache=True the first time they are materialized)"
        )
    if cleared:
        reasons.append(f"{cleared} lost their recording to clear_meta_init_cache()")
    if never:
        reasons.append(f"{never} were never deferred (made real outside meta_init)")
    return f"{len(tensors)} tensor(s) {what}: {'; '.join(reasons)}."


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad`` without torch's warning for non-leaf tensors (they hold none)."""
    return t.grad if t.is_leaf else None


def _freeable(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (DTensor's) real local shard when that is what was kept, else ``t``."""
    local = local_tensor(t)
    return local if local in _kept else t


def _names_in(obj: Any) -> dict[int, str]:
    """Qualified names (``layers.3.weight``) of the tensors of ``obj``, by ``id``."""
    from jupyter_metainit.core.runtime.walk import named_tensors

    names: dict[int, str] = {}
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    for i, x in enumerate(items):
        prefix = f"[{i}]" if isinstance(obj, (list, tuple)) else ""
        if isinstance(x, torch.nn.Module):
            for mname, own in named_tensors(x, attributes=True):
                name = f"{mname}.{own.name}" if mname else own.name
                for t in (own.tensor, _freeable(own.tensor)):
                    names.setdefault(id(t), f"{prefix}.{name}" if prefix else name)
        elif isinstance(x, torch.Tensor):
            names.setdefault(id(_freeable(x)), prefix or "the tensor")
    return names


def _name(t: torch.Tensor, names: dict[int, str]) -> str:
    return names.get(id(t), f"a tensor of shape {tuple(t.shape)}")


def _why_not_reproducible(t: torch.Tensor, holder: _Shadow) -> str | None:
    """Why materializing ``holder.deferred`` would not give ``t``'s current values, bit for bit
    (None: it would). Checked when freeing: whatever happened since materialization counts."""
    recording = holder.deferred
    if t._version != holder.version or t.data_ptr() != holder.data_ptr:
        return "was written since it was materialized (trained, loaded into), or cast or moved"
    if (t.dtype, tuple(t.shape), t.stride()) != (
        recording.dtype, tuple(recording.shape), recording.stride()
    ):  # fmt: skip
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
    from jupyter_metainit.core.record.graph import External

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


def _deferred_for(t: torch.Tensor, holder: _Shadow) -> DeferredTensor:
    """The deferred tensor to swap back into ``t``: its recording, carrying what the user set
    on ``t`` since (attributes, ``requires_grad``, being a Parameter)."""
    deferred = holder.deferred
    for k in [k for k in deferred.__dict__ if k not in INTERNAL_ATTRS]:
        del deferred.__dict__[k]
    deferred.__dict__.update(t.__dict__)
    if isinstance(t, torch.nn.Parameter):
        deferred.__dict__["_is_param"] = True
    deferred._rg = t.requires_grad
    return deferred


def _return_memory_to_the_os() -> None:
    """glibc keeps freed heap pages; give them back so the process's memory visibly drops."""
    if os.name != "posix":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def clear_meta_init_cache() -> None:
    """Release what is kept for later calls: dematerialization shadows, RNG checkpoints and
    values computed for reads.

    Deferred tensors stay materializable (their recording lives with them); tensors materialized
    with ``keep_cache=True`` can no longer be dematerialized, and exact-mode calls may have to
    regenerate random streams again.
    """
    for t in list(_kept.keys()):
        _cleared[t] = True
    _kept.clear()
    _rng.forget_generators()
    for seg in _rng.live_segments():
        seg.clear_checkpoints()
    value_cache.clear()
