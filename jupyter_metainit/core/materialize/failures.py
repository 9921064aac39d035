"""What a materialization says when it cannot be done: refused before any work, or failed.

Refusals come first, before anything is computed: an argument that makes no sense, a device
that is not here, tensors with no recording (PyTorch's meta device) or no shape (a lazy
module). A failure during the work (out of memory, Ctrl-C, an error in a recorded op) becomes
the exception :func:`released` returns: it holds no frame of the replay, so nothing the call
allocated stays alive in a traceback IPython keeps, and running out of memory is one line that
says what was needed and what is free. Every message ends in what to do instead.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from jupyter_metainit.core.errors import (
    ArgumentError,
    ArgumentTypeError,
    MaterializationError,
    MetaInitError,
    NotEnoughMemoryError,
)
from jupyter_metainit.core.materialize.progress import storage_sizes
from jupyter_metainit.core.materialize.queries import is_uninitialized
from jupyter_metainit.core.materialize.walk import named_tensors
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay import Plan, plan
from jupyter_metainit.core.runtime.arguments import (
    check_flag,
    check_floating_dtype,
    missing_device_reason,
    parse_device,
)
from jupyter_metainit.core.runtime.format import format_bytes
from jupyter_metainit.core.runtime.memory_left import free_memory, is_out_of_memory

__all__ = [
    "check_arguments",
    "check_options",
    "check_root",
    "check_recorded_devices",
    "refuse_meta_inputs",
    "refuse_unmaterializable",
    "released",
    "target_device",
]

RNG_MODES = ("exact", "fast")


def check_arguments(
    rng: str | None, missing: str, dtype: torch.dtype | str | None, placement: Any = None
) -> torch.dtype | None:
    """Refuse ``rng=``, ``missing=``, ``dtype=`` and ``placement=`` values that make no sense;
    return ``dtype`` as a ``torch.dtype`` (any spelling ``parse_dtype`` reads)."""
    if placement is not None:  # with device= (placement= alone is handled before any check)
        raise ArgumentError(
            "placement= gives every part its own device: leave device= out, or drop placement="
        )
    if rng is not None and not isinstance(rng, str):
        raise ArgumentTypeError(f"rng takes 'exact', 'fast' or None (the default), not {rng!r}")
    if rng is not None and rng not in RNG_MODES:
        raise ArgumentError(f"rng must be 'exact', 'fast' or None (the default), not {rng!r}")
    if not isinstance(missing, str):
        raise ArgumentTypeError(f"missing takes 'error' or 'init', not {missing!r}")
    if missing not in ("error", "init"):
        raise ArgumentError(f"missing must be 'error' or 'init', not {missing!r}")
    return check_floating_dtype(
        dtype,
        arg="dtype",
        use="dtype= casts the floating-point tensors (torch.bfloat16, "
        "torch.float16, torch.float32, ...). Quantize after materializing instead.",
    )


def check_root(root: Any, verb: str) -> None:
    """``root=`` is the whole model (an ``nn.Module``) or None: anything else is refused before
    any work, whether or not it would be read."""
    if root is not None and not isinstance(root, torch.nn.Module):
        raise ArgumentTypeError(
            f"{verb}(root=...) takes the whole model (an nn.Module) the tensors belong to, or "
            f"None, not {type(root).__name__} {root!r}"
        )


def check_options(verb: str, root: Any, **flags: Any) -> None:
    """The arguments of ``verb`` every call checks first: ``root=`` and the bool flags."""
    check_root(root, verb)
    for name, value in flags.items():
        check_flag(value, name)


def placed(placement: Any) -> Any:
    """What materializes a placement: its ``materialize_parts`` (the core reads nothing else of
    the plan, so it needs nothing of the planning layer)."""
    apply = getattr(placement, "materialize_parts", None)
    if not callable(apply):
        raise ArgumentTypeError(
            "placement= takes a plan from jupyter_metainit.place(model, devices, ...), not "
            f"{type(placement).__name__}; with a device map, use "
            "jupyter_metainit.plan.Placement.from_device_map(device_map)"
        )
    return apply


def target_device(device: Any) -> torch.device | None:
    """Check ``device=``; every refusal says what would work instead."""
    d = parse_device(device)
    if d is None:
        return None
    if d.type == "meta":
        raise ArgumentError(
            "materialize(device='meta') makes no sense; the tensor is deferred already"
        )
    reason = missing_device_reason(d)
    if reason is not None:
        if d.type != "cuda":
            hint = "; use 'cpu' or a CUDA device"
        elif not torch.cuda.is_available():
            hint = "; use device='cpu'"
        else:  # an index past the last GPU: the reason lists the ones there are
            hint = ""
        raise MaterializationError(f"cannot materialize to {device!r}: {reason}{hint}")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def check_recorded_devices(tensors: list[DeferredTensor], what: str) -> None:
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


def refuse_unmaterializable(collected: list[torch.Tensor], tensors: list, obj: Any = None) -> None:
    """Refuse a lazy module's parameters (no shape yet) and tensors on PyTorch's meta device
    (no data and no recording of their values) among ``collected``; ``tensors`` are its
    deferred ones, ``obj`` what the call was given (to name the meta tensors' attributes)."""
    if any(is_uninitialized(t) for t in collected):
        raise MaterializationError(
            "a lazy module's parameters have no shape yet; run a forward pass on example inputs "
            "first (inside meta_init, or with jupyter_metainit.dry_run)"
        )
    meta = [t for t in collected if not isinstance(t, DeferredTensor) and t.is_meta]
    if not meta:
        return
    named = _attribute_names(obj, meta)
    if not tensors:
        which = f"{named} are" if named else "these tensors are"
        raise MaterializationError(
            f"{which} on PyTorch's meta device, with no recording of their values (built with "
            "`torch.device('meta')`, not `jupyter_metainit.meta_init()`); nothing was "
            "materialized. Build the model inside `with jupyter_metainit.meta_init():` to "
            "materialize it, or leave those parts out."
        )
    which = named or f"{len(meta)} of these tensors"
    raise MaterializationError(
        f"{which}: a plain tensor on PyTorch's meta device (made with device='meta' or under "
        "`torch.device('meta')`), which holds no data and no recording of its values, so "
        "there is nothing to materialize. Give it values (assign a tensor to the attribute, or "
        "initialise it in the model's code), or make it inside `jupyter_metainit.meta_init()` "
        "without device='meta' (it is then recorded). Nothing was materialized: the model is "
        "still deferred."
    )


def _attribute_names(obj: Any, tensors: list[torch.Tensor], most: int = 5) -> str:
    """``"Net.pos (non-persistent buffer), ..."``: where ``tensors`` sit in the modules of
    ``obj`` (a module, or a list of them); ``""`` when none is found there."""
    modules = [obj] if isinstance(obj, torch.nn.Module) else obj
    if not isinstance(modules, (list, tuple)):
        return ""
    wanted = {id(t) for t in tensors}
    names: dict[int, str] = {}
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            continue
        for prefix, own in named_tensors(m, attributes=True):
            if id(own.tensor) in wanted and id(own.tensor) not in names:
                path = ".".join(p for p in (type(m).__name__, prefix, own.name) if p)
                names[id(own.tensor)] = f"`{path}` ({own.kind})"
    shown = list(names.values())[:most]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


@contextlib.contextmanager
def refuse_meta_inputs(replay: Plan, group: list[DeferredTensor], obj: Any) -> Iterator[None]:
    """Around a replay: when it fails and one of its ops was recorded on a plain tensor of
    PyTorch's meta device (no data: ``deferred.copy_(torch.empty(3, device="meta"))``), say
    which attribute needs it and where it was used, instead of PyTorch's "Cannot copy out of
    meta tensor". Checked on failure only: a replay that runs costs nothing more."""
    try:
        yield
    except Exception:
        bad = replay.meta_input_op()
        if bad is None:
            raise
        needing = [t for t in group if bad in plan([t._rec]).ops]
        which = _attribute_names(obj, needing) or f"{len(needing)} tensor(s)"
        raise MaterializationError(
            f"{which} cannot be materialized: its recording uses a plain tensor of PyTorch's "
            f"meta device ({bad.func} at {bad.where}), which holds no data to compute it from. "
            "Give that tensor values, or make it inside `jupyter_metainit.meta_init()` without "
            "device='meta' (it is then recorded). Nothing was materialized: the model is still "
            "deferred."
        ) from None


def released(
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
        need = sum(storage_sizes(tensors, dtype).values())
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
