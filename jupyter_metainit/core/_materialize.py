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
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from jupyter_metainit.core import _events, _rng
from jupyter_metainit.core._busy import exclusive
from jupyter_metainit.core._digest import digest
from jupyter_metainit.core._files import read_file_bytes
from jupyter_metainit.core._format import format_bytes
from jupyter_metainit.core._graph import StorageRecord
from jupyter_metainit.core._interrupts import critical, handling_interrupts
from jupyter_metainit.core._replay import Progress, compute_values, execute, plan, real_view
from jupyter_metainit.core._swap import swap_in_place
from jupyter_metainit.core._tensor import INTERNAL_ATTRS, DeferredTensor
from jupyter_metainit.core._values import value_cache
from jupyter_metainit.core._walk import unique_tensors
from jupyter_metainit.core.errors import (
    MaterializationError,
    MetaInitError,
    NotEnoughMemoryError,
)

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
    the real tensor looked like then (version, address, digest of its memory). A tensor read
    from a checkpoint keeps no digest: it is compared with the file when it is freed.

    Stored in the real tensor's ``__dict__``; pickling or copying the tensor drops it.
    """

    __slots__ = ("__weakref__", "data_ptr", "deferred", "digest", "version")

    def __init__(
        self, deferred: DeferredTensor | None, version: int, data_ptr: int, content: tuple | None
    ) -> None:
        self.deferred = deferred
        self.version = version
        self.data_ptr = data_ptr
        self.digest = content  # None: compare with the recording's values (a file read)

    def __reduce__(self) -> Any:
        return (_Shadow, (None, -1, 0, ()))

    def __deepcopy__(self, memo: Any) -> _Shadow:
        return _Shadow(None, -1, 0, ())


_shadows: weakref.WeakSet[_Shadow] = weakref.WeakSet()


# ---------------------------------------------------------------------------------------------
# what a tensor is


def is_deferred(obj: Any) -> bool:
    """True for a deferred tensor, or a module with at least one deferred parameter or buffer."""
    if isinstance(obj, torch.Tensor):
        return isinstance(_deferred_local(obj), DeferredTensor) or _is_uninitialized(obj)
    if isinstance(obj, torch.nn.Module):
        return any(is_deferred(t) for t in _module_tensors(obj))
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


def tensor_source(t: torch.Tensor) -> str:
    """Where a tensor's values come from: ``"checkpoint"`` (read from a file, perhaps
    converted), ``"init"`` (computed by the model's code) or ``""`` (not known: a tensor that
    was never deferred, or a meta/lazy one)."""
    local = _deferred_local(t)
    if isinstance(local, DeferredTensor):
        ops = plan([local._rec]).ops
        from_file = any(op.func is read_file_bytes for op in ops)
        return "checkpoint" if from_file and not any(op.rng is not None for op in ops) else "init"
    return t.__dict__.get("_jmi_source", "")


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
    local = getattr(t, "_local_tensor", None)
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


def _collect(obj: Any, verb: str = "materialize") -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [_deferred_local(obj)]
    if isinstance(obj, torch.nn.Module):
        return _module_tensors(obj)
    if isinstance(obj, (list, tuple)):
        out: dict[int, torch.Tensor] = {}
        for x in obj:
            if not isinstance(x, (torch.Tensor, torch.nn.Module)):
                raise TypeError(
                    f"{verb}() takes tensors, modules or a list of them; got a "
                    f"{type(x).__name__} in the list"
                )
            for t in _collect(x, verb):
                out.setdefault(id(t), t)
        return list(out.values())
    raise TypeError(
        f"{verb}() takes a tensor, a module or a list of them; got {type(obj).__name__}"
    )


def iter_deferred(obj: Any) -> Iterable[DeferredTensor]:
    return [t for t in _collect(obj) if isinstance(t, DeferredTensor)]


# ---------------------------------------------------------------------------------------------
# arguments


def parse_device(device: Any) -> torch.device | None:
    """Check a target device; every refusal says what would work instead."""
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"not a device: {device!r} (use e.g. 'cpu' or 'cuda:0')") from e
    if d.type == "meta":
        raise ValueError(
            "materialize(device='meta') makes no sense; the tensor is deferred already"
        )
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise MaterializationError(
                f"cannot materialize to {device!r}: CUDA is not available here; use device='cpu'"
            )
        count = torch.cuda.device_count()
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        if not 0 <= d.index < count:
            raise MaterializationError(
                f"cannot materialize to {device!r}: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
        return d
    if d.type != "cpu":
        available = getattr(torch, d.type, None)
        is_available = getattr(available, "is_available", None)
        if not (callable(is_available) and is_available()):
            raise MaterializationError(
                f"cannot materialize to {device!r}: no {d.type} device is available here; "
                "use 'cpu' or a CUDA device"
            )
    return d


def _check_dtype(dtype: Any) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), not {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(
            f"dtype={dtype} is not a floating-point dtype; dtype= casts the floating-point "
            "tensors (torch.bfloat16, torch.float16, torch.float32, ...). Quantize after "
            "materializing instead."
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


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _free_bytes(device: torch.device) -> int | None:
    """Memory this process can still get on ``device``: for the CPU the least of the machine's
    available memory, the address-space limit (``ulimit -v``) and the cgroup's limit."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
    except Exception:
        return None
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            candidates.append(max(0, limit - used))
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                candidates.append(max(0, int(cap) - int(f.read())))
    except (OSError, ValueError, ImportError):
        pass
    return min(candidates) if candidates else None


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
    if _is_oom(exc):
        exc.__traceback__ = None
        target = device or (tensors[0].device if tensors else torch.device("cpu"))
        free = _free_bytes(target)
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
    return f"{len(obj)} objects"


# ---------------------------------------------------------------------------------------------
# materialize


def materialize(
    obj: Any,
    device: Any = None,
    *,
    dtype: torch.dtype | None = None,
    rng: str = "exact",
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
        obj: a tensor, a module (all its parameters, buffers and tensor attributes, recursively),
            or a list/tuple of them.
        device: where the real tensors go; ``None`` keeps each tensor's recorded device.
            Parts of ``obj`` that are real already are moved there in place, as
            ``nn.Module.to`` does (same tensor objects, ties kept).
        dtype: cast floating-point tensors to this dtype after replay; real parts are cast in
            place too.
        rng: ``"exact"`` (default): bit-identical to eager construction, whatever was
            materialized before and in whatever grouping. ``"fast"``: every random op draws from
            its own stream seeded from the recorded seed and the op's position; deterministic,
            order-independent, parallel and generated on the target device.
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
        ``obj``. A failed or interrupted call leaves every tensor as it was (deferred ones
        deferred and materializable) and keeps nothing it allocated. Calls from several threads
        on the same model are serialized (see ``_busy``).
    """
    if rng not in _RNG_MODES:
        raise ValueError(f"rng must be 'exact' or 'fast', not {rng!r}")
    if missing not in ("error", "init"):
        raise ValueError(f"missing must be 'error' or 'init', not {missing!r}")
    _check_dtype(dtype)
    target_device = parse_device(device)
    callback, bar = progress_callback(progress)
    try:
        with handling_interrupts(), exclusive(f"materializing {_describe(obj)}"):
            collected = _collect(obj)
            tensors = [t for t in collected if isinstance(t, DeferredTensor)]
            _refuse_unmaterializable(collected, tensors)
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
            _events.publish("materialized", swapped)
    finally:
        if bar is not None:
            bar.close()
    return obj


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
        real = torch.nn.Parameter(real, requires_grad=t.requires_grad)
    elif t.requires_grad and (real.is_floating_point() or real.is_complex()):
        real = real.detach().requires_grad_(True)
    for k, v in t.__dict__.items():
        if k not in INTERNAL_ATTRS and k != "_is_param":
            setattr(real, k, v)
    return real


def _materialize_now(
    obj: Any, tensors: list[DeferredTensor], reals: list[torch.Tensor],
    device: torch.device | None, dtype: torch.dtype | None, rng: str, keep: bool,
    callback: Any, checkpoint: Any, missing: str, root: torch.nn.Module | None,
) -> list[torch.Tensor]:  # fmt: skip
    """Compute everything, then swap it into place; nothing changes if anything fails."""
    loaded: dict[int, torch.Tensor] = {}
    tracker = _MemoryProgress(callback, tensors, dtype) if callback is not None else None
    if checkpoint is not None:
        from jupyter_metainit.core._checkpoint import load_for

        if tracker is not None:
            tracker.phase("reading checkpoint files")
        loaded = load_for(obj, [*tensors, *reals], checkpoint, device, missing, dtype, root)
        if tracker is not None:
            tracker.loaded([t for t in tensors if id(t) in loaded])
    to_replay = [t for t in tensors if id(t) not in loaded]
    replay = plan([t._rec for t in to_replay])
    # A tensor's own plan says where its values come from; only worth asking if any file is read.
    reads_files = any(op.func is read_file_bytes for op in replay.ops)
    sources = {
        id(t): "checkpoint" if id(t) in loaded else tensor_source(t) if reads_files else "init"
        for t in tensors
    }
    env = execute(replay, device, rng, tracker)
    used: set[int] = set()
    new = []
    for t in tensors:
        if id(t) in loaded:
            new.append(_build_real(t, loaded[id(t)], dtype, used, exact_tensor=True))
        else:
            new.append(_build_real(t, env[id(t._rec.storage)], dtype, used))
        new[-1].__dict__["_jmi_source"] = sources[id(t)]
    del env
    # Tensors read from a file can always be freed again: their recording is "read the file",
    # and they are compared with it rather than digested now.
    from_file = [sources[id(t)] == "checkpoint" and id(t) not in loaded for t in tensors]
    digests = [digest(r) if keep and not f else None for r, f in zip(new, from_file, strict=True)]
    kept = [keep or f for f in from_file]
    converted = _converted_reals([t for t in reals if id(t) not in loaded], device, dtype)
    with critical():
        _swap_all(tensors, new, digests, kept)
        with torch.no_grad():
            for t in reals:
                if id(t) in loaded:
                    value = loaded[id(t)]
                    t.copy_(value if value.dtype == t.dtype else value.to(t.dtype))
        for t, data in converted:
            _set_data_keeping_shadow(t, data)
    return [*tensors, *(t for t in reals if id(t) in loaded), *(t for t, _ in converted)]


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


def _set_data_keeping_shadow(t: torch.Tensor, data: torch.Tensor) -> None:
    """Replace ``t``'s data by a converted copy; a kept shadow then describes the new memory,
    so that :func:`dematerialize` still sees an unchanged tensor (the conversion is ours)."""
    holder = t.__dict__.get("_jmi_shadow")
    t.data = data
    if holder is not None and holder.deferred is not None:
        holder.version = t._version
        holder.data_ptr = t.data_ptr()
        if holder.digest is not None:
            holder.digest = digest(t)


def _swap_all(
    tensors: list[DeferredTensor],
    reals: list[torch.Tensor],
    digests: list[tuple | None],
    keep: list[bool],
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
    for (t, shadow), content, kept in zip(done, digests, keep, strict=True):
        if kept:
            holder = _Shadow(shadow, t._version, t.data_ptr(), content)
            t.__dict__["_jmi_shadow"] = holder
            _shadows.add(holder)


# ---------------------------------------------------------------------------------------------
# dematerialize


def dematerialize(obj: Any, *, force: bool = False) -> Any:
    """Make materialized tensors deferred again and free their memory.

    Works on tensors materialized with ``keep_cache=True`` (the widget and magics do that).
    Materializing them again in ``exact`` mode gives the same values. A tensor whose memory was
    written since it was materialized (trained, loaded into, through ``.data`` or numpy too) is
    refused unless ``force=True``: its changes would be lost. Refusals change nothing.
    """
    with handling_interrupts(), exclusive(f"freeing {_describe(obj)}"):
        tensors = [
            t for t in _collect(obj, "dematerialize")
            if not isinstance(t, DeferredTensor) and not t.is_meta
        ]  # fmt: skip
        pairs: list[tuple[torch.Tensor, _Shadow]] = []
        changed: list[str] = []
        lost = 0
        for t in tensors:
            holder = t.__dict__.get("_jmi_shadow")
            if holder is None or holder.deferred is None:
                lost += not _is_uninitialized(t)
                continue
            if not force and _changed(t, holder):
                changed.append(f"{tuple(t.shape)} {t.dtype}")
            pairs.append((t, holder))
        if lost:
            raise MaterializationError(
                f"{lost} tensor(s) cannot be made deferred again: they were not materialized "
                "with keep_cache=True (or the cache was cleared, or they were never deferred). "
                "Nothing was changed. Use materialize(..., keep_cache=True) to be able to free "
                "them."
            )
        if changed:
            raise MaterializationError(
                f"{len(changed)} tensor(s) were written since they were materialized (e.g. "
                f"{changed[0]}); dematerializing would discard those changes. Nothing was "
                "changed. Pass force=True to do it anyway."
            )
        with critical():
            for t, holder in pairs:
                deferred = holder.deferred
                del t.__dict__["_jmi_shadow"]
                holder.deferred = None
                swap_in_place(t, deferred)
        freed = [t for t, _ in pairs]
        pairs.clear()
        deferred = None  # the real storages' last references go with these
        _return_memory_to_the_os()
        _events.publish("dematerialized", freed)
    return obj


def _changed(t: torch.Tensor, holder: _Shadow) -> bool:
    if t._version != holder.version or t.data_ptr() != holder.data_ptr:
        return True
    if holder.digest is None:  # read from a file: compare with the file
        recorded = compute_values([holder.deferred._rec])[0]
        with torch.no_grad():
            current = t.detach().to("cpu")
        return not torch.equal(recorded.to(current.dtype), current)
    return digest(t) != holder.digest


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
    for holder in list(_shadows):
        holder.deferred = None
    _rng.forget_generators()
    for seg in _rng.live_segments():
        seg.clear_checkpoints()
    value_cache.clear()
