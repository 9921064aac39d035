"""``materialize`` / ``dematerialize``: turn deferred tensors real in place, and back."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from jupyter_metainit.core import _rng
from jupyter_metainit.core._replay import execute, plan, real_view
from jupyter_metainit.core._swap import swap_in_place
from jupyter_metainit.core._tensor import INTERNAL_ATTRS, DeferredTensor
from jupyter_metainit.core.errors import MaterializationError

__all__ = [
    "clear_meta_init_cache",
    "dematerialize",
    "is_deferred",
    "materialize",
    "tensor_state",
]

_RNG_MODES = ("exact", "fast")
_lock = threading.RLock()


class _Shadow:
    """The deferred side of a materialized tensor, kept for :func:`dematerialize`.

    Stored in the real tensor's ``__dict__``; pickling or copying the tensor drops it.
    """

    __slots__ = ("__weakref__", "data_ptr", "deferred", "version")

    def __init__(self, deferred: DeferredTensor | None, version: int, data_ptr: int) -> None:
        self.deferred = deferred
        self.version = version
        self.data_ptr = data_ptr

    def __reduce__(self) -> Any:
        return (_Shadow, (None, -1, 0))

    def __deepcopy__(self, memo: Any) -> _Shadow:
        return _Shadow(None, -1, 0)


_shadows: weakref.WeakSet[_Shadow] = weakref.WeakSet()


def is_deferred(obj: Any) -> bool:
    """True for a deferred tensor, or a module with at least one deferred parameter or buffer."""
    if isinstance(obj, torch.Tensor):
        return isinstance(_deferred_local(obj), DeferredTensor) or _is_uninitialized(obj)
    if isinstance(obj, torch.nn.Module):
        return any(is_deferred(t) for t in _module_tensors(obj))
    return False


def tensor_state(t: torch.Tensor) -> str:
    """``"deferred"`` or the device a real tensor lives on (``"cpu"``, ``"cuda:0"``)."""
    return "deferred" if is_deferred(t) else str(t.device)


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
    """Parameters, buffers (persistent or not) and plain tensor attributes, each object once.

    A sharded parameter (DTensor) contributes its deferred local shard.
    """
    seen: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                t = _deferred_local(t)
                seen.setdefault(id(t), t)
        for v in m.__dict__.values():
            if isinstance(v, DeferredTensor):
                seen.setdefault(id(v), v)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    if isinstance(x, DeferredTensor):
                        seen.setdefault(id(x), x)
    return list(seen.values())


def _collect(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [_deferred_local(obj)]
    if isinstance(obj, torch.nn.Module):
        return _module_tensors(obj)
    if isinstance(obj, (list, tuple)):
        out: dict[int, torch.Tensor] = {}
        for x in obj:
            if not isinstance(x, (torch.Tensor, torch.nn.Module)):
                raise TypeError(
                    "materialize() takes tensors, modules or a list of them; "
                    f"got {type(x).__name__}"
                )
            for t in _collect(x):
                out.setdefault(id(t), t)
        return list(out.values())
    raise TypeError(
        f"materialize() takes a tensor, a module or a list of them; got {type(obj).__name__}"
    )


def _parse_device(device: Any) -> torch.device | None:
    if device is None:
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"not a device: {device!r} (use e.g. 'cpu' or 'cuda:0')") from e
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise MaterializationError(f"cannot materialize to {d}: CUDA is not available here")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        if d.index >= torch.cuda.device_count():
            raise MaterializationError(
                f"cannot materialize to {d}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    if d.type == "meta":
        raise ValueError(
            "materialize(device='meta') makes no sense; the tensor is deferred already"
        )
    return d


def _progress_callback(progress: Any) -> tuple[Callable[[int, int], None] | None, Any]:
    if progress is None or progress is False:
        return None, None
    if callable(progress):
        return progress, None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc="materialize")

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        return update, bar
    raise TypeError("progress must be None, a bool, or a callable(done_bytes, total_bytes)")


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
        real = torch.nn.Parameter(real, requires_grad=t._rg)
    elif t._rg and (real.is_floating_point() or real.is_complex()):
        real = real.detach().requires_grad_(True)
    for k, v in t.__dict__.items():
        if k not in INTERNAL_ATTRS and k != "_is_param":
            setattr(real, k, v)
    return real


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
        dtype: cast floating-point tensors to this dtype after replay.
        rng: ``"exact"`` (default): bit-identical to eager construction, whatever was
            materialized before and in whatever grouping. ``"fast"``: every random op draws from
            its own stream seeded from the recorded seed and the op's position; deterministic,
            order-independent, parallel and generated on the target device.
        keep_cache: keep the recording of these tensors, so that :func:`dematerialize` can make
            them deferred again. By default it is released (with everything no other deferred
            tensor needs).
        progress: ``True`` for a progress bar, or ``callable(done_bytes, total_bytes)``. If the
            callable raises (to cancel), nothing is materialized and the exception propagates.
        checkpoint: path(s) of ``.safetensors`` files (or a sharded set's index JSON) to load the
            values from instead of replaying the initialisation.
        missing: with ``checkpoint``: ``"error"`` (default) if a tensor is not in the checkpoint,
            or ``"init"`` to replay its recorded initialisation.
        root: with ``checkpoint``, when ``obj`` is a part of a model: the whole model, whose
            qualified names the checkpoint uses (``model.layers.3...``).

    Returns:
        ``obj``. A failed or interrupted call leaves every tensor deferred and materializable.
    """
    if rng not in _RNG_MODES:
        raise ValueError(f"rng must be 'exact' or 'fast', not {rng!r}")
    if missing not in ("error", "init"):
        raise ValueError(f"missing must be 'error' or 'init', not {missing!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), not {dtype!r}")
    target_device = _parse_device(device)
    collected = _collect(obj)
    tensors = [t for t in collected if isinstance(t, DeferredTensor)]
    uninit = [t for t in collected if _is_uninitialized(t)]
    if uninit:
        raise MaterializationError(
            "a lazy module's parameters have no shape yet; run a forward pass on example inputs "
            "first (inside meta_init, or with jupyter_metainit.dry_run)"
        )
    if not tensors:
        if any(t.is_meta for t in collected):
            raise MaterializationError(
                "these tensors are on PyTorch's meta device, with no recording of their values; "
                "build the model inside `with jupyter_metainit.meta_init():` instead of "
                "`torch.device('meta')` to materialize it"
            )
        return obj
    callback, bar = _progress_callback(progress)
    try:
        with _lock:
            loaded: dict[int, torch.Tensor] = {}
            if checkpoint is not None:
                from jupyter_metainit.core._checkpoint import load_for

                loaded = load_for(obj, tensors, checkpoint, target_device, missing, dtype, root)
            to_replay = [t for t in tensors if id(t) not in loaded]
            p = plan([t._rec for t in to_replay])
            env = execute(p, target_device, rng, callback)
            used: set[int] = set()
            reals = []
            for t in tensors:
                if id(t) in loaded:
                    reals.append(_build_real(t, loaded[id(t)], dtype, used, exact_tensor=True))
                else:
                    reals.append(_build_real(t, env[id(t._rec.storage)], dtype, used))
            del env
            _swap_all(tensors, reals, keep_cache)
    finally:
        if bar is not None:
            bar.close()
    return obj


def _swap_all(tensors: list[DeferredTensor], reals: list[torch.Tensor], keep: bool) -> None:
    done: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for t, r in zip(tensors, reals, strict=True):
            swap_in_place(t, r)
            done.append((t, r))
    except BaseException:
        for t, r in reversed(done):
            swap_in_place(t, r)
        raise
    for t, shadow in done:
        if keep:
            holder = _Shadow(shadow, t._version, t.data_ptr())
            t.__dict__["_jmi_shadow"] = holder
            _shadows.add(holder)


def dematerialize(obj: Any, *, force: bool = False) -> Any:
    """Make materialized tensors deferred again and free their memory.

    Works on tensors materialized with ``keep_cache=True`` (the widget and magics do that).
    Materializing them again in ``exact`` mode gives the same values. A tensor changed since it
    was materialized (trained, loaded into) is refused unless ``force=True``: its changes would
    be lost.
    """
    tensors = [t for t in _collect(obj) if not isinstance(t, DeferredTensor)]
    pairs: list[tuple[torch.Tensor, _Shadow]] = []
    changed: list[str] = []
    lost = 0
    for t in tensors:
        holder = t.__dict__.get("_jmi_shadow")
        if holder is None or holder.deferred is None:
            lost += not _is_uninitialized(t)
            continue
        if not force and (t._version != holder.version or t.data_ptr() != holder.data_ptr):
            changed.append(f"{tuple(t.shape)} {t.dtype}")
        pairs.append((t, holder))
    if lost:
        raise MaterializationError(
            f"{lost} tensor(s) cannot be made deferred again: they were not materialized with "
            "keep_cache=True (or the cache was cleared, or they were never deferred). Nothing was "
            "changed. Use materialize(..., keep_cache=True) to be able to free them."
        )
    if changed:
        raise MaterializationError(
            f"{len(changed)} tensor(s) changed since they were materialized (e.g. {changed[0]}); "
            "dematerializing would discard those changes. Pass force=True to do it anyway."
        )
    with _lock:
        for t, holder in pairs:
            deferred = holder.deferred
            del t.__dict__["_jmi_shadow"]
            holder.deferred = None
            swap_in_place(t, deferred)
        pairs.clear()
        deferred = None  # the real storages' last references go with these
    _return_memory_to_the_os()
    return obj


def _return_memory_to_the_os() -> None:
    """glibc keeps freed heap pages; give them back so the process's memory visibly drops."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def clear_meta_init_cache() -> None:
    """Release what is kept for later calls: dematerialization shadows and RNG checkpoints.

    Deferred tensors stay materializable (their recording lives with them); tensors materialized
    with ``keep_cache=True`` can no longer be dematerialized, and exact-mode calls may have to
    regenerate random streams again.
    """
    for holder in list(_shadows):
        holder.deferred = None
    _rng.forget_generators()
    for seg in _rng.live_segments():
        seg.clear_checkpoints()


def iter_deferred(obj: Any) -> Iterable[DeferredTensor]:
    return [t for t in _collect(obj) if isinstance(t, DeferredTensor)]
