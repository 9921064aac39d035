"""What a tensor is (deferred, real, fast or exact, from a checkpoint), and which tensors a call
acts on.

``tensor_state``, ``tensor_values`` and ``tensor_source`` answer the widget's and the user's
questions about one tensor; ``is_deferred`` about a module. :func:`collect` turns what a
``materialize`` or ``dematerialize`` call was given (a tensor, a module, a list, an iterator)
into the tensor objects it acts on, each once, a sharded tensor (DTensor) as its local shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized, ValuesView
from typing import Any

import torch

from jupyter_metainit.core.errors import ArgumentTypeError
from jupyter_metainit.core.materialize import shadows
from jupyter_metainit.core.materialize.walk import local_tensor, unique_tensors
from jupyter_metainit.core.record.files import read_file_bytes
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.replay import plan

__all__ = [
    "is_deferred",
    "iter_deferred",
    "no_values_reason",
    "source_files",
    "tensor_source",
    "tensor_state",
    "tensor_values",
    "with_grads",
    "set_grads",
]


def is_deferred(obj: object) -> bool:
    """Whether a tensor or module still has deferred tensors (no memory, values recorded).

    Use it to check what a materialization left to do, or to branch in code that must treat
    deferred models apart. A module is deferred while at least one of its parameters, buffers
    or tensor attributes (also one kept in a dict, list or tuple attribute) is; a list or tuple
    while one of its items is.

    Args:
        obj: a tensor, a module, or a list, tuple, set or iterator of them; anything else is
            not deferred.

    Returns:
        ``True`` for a deferred tensor (also a lazy module's parameter before its first
        forward), a module or collection holding one; ``False`` otherwise.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import is_deferred, materialize, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> is_deferred(model), is_deferred(model[1].weight), is_deferred(torch.ones(2))
        (True, True, False)
        >>> _ = materialize(model[0])
        >>> is_deferred(model[0]), is_deferred(model)  # model[1] is still deferred
        (False, True)
    """
    if isinstance(obj, torch.Tensor):
        return isinstance(_deferred_local(obj), DeferredTensor) or is_uninitialized(obj)
    if isinstance(obj, torch.nn.Module):
        return any(is_deferred(t) for t in _module_tensors(obj))
    if isinstance(obj, (list, tuple, set, frozenset, ValuesView, Iterator)):
        return any(is_deferred(x) for x in obj)
    return False


def tensor_state(t: torch.Tensor) -> str:
    """Where a tensor's values are: ``"deferred"`` (recorded, materializable), ``"meta"``
    (PyTorch's meta device: no values and no recording), ``"uninitialized"`` (a lazy module's
    parameter before its first forward pass), or the device of a real tensor (``"cpu"``)."""
    if is_uninitialized(t):
        return "uninitialized"
    if isinstance(_deferred_local(t), DeferredTensor):
        return "deferred"
    if t.is_meta:
        return "meta"
    return str(t.device)


def no_values_reason(name: str, state: str, doing: str) -> str | None:
    """Why tensor ``name`` (its :func:`tensor_state` is ``state``) has no values to ``doing``
    (``"read"``, ``"save"``), and what to do, in one sentence; ``None`` when it has values. The
    one wording of ``stats``, ``compare`` and ``save`` for a meta or lazy tensor."""
    if state == "meta":
        return (
            f"{name} has no values to {doing}: it is on PyTorch's meta device with no "
            "recording; build the model inside jupyter_metainit.meta_init() (not on "
            "device='meta'), or leave it out"
        )
    if state == "uninitialized":
        return (
            f"{name} has no values to {doing} yet: it is a lazy module's parameter "
            "(nn.LazyLinear, ...) before its first forward pass, which gives it a shape; run the "
            "model once on an example input (inside meta_init too), or leave it out"
        )
    return None


def tensor_values(t: torch.Tensor) -> str:
    """Whether a real tensor's values are eager's: ``"exact"``, or ``"fast"`` when random ops
    were replayed with ``rng="fast"`` (deterministic, but not what eager construction gives).
    ``""`` for a tensor with no values (deferred, meta, lazy)."""
    if is_uninitialized(t) or t.is_meta or isinstance(_deferred_local(t), DeferredTensor):
        return ""
    return "fast" if t in shadows.fast_values else "exact"


def tensor_source(t: torch.Tensor) -> str:
    """Where a tensor's values come from: ``"checkpoint"`` (read from a file, perhaps
    converted), ``"init"`` (computed by the model's code) or ``""`` (not known: a tensor that
    was never deferred, or a meta/lazy one)."""
    local = _deferred_local(t)
    if isinstance(local, DeferredTensor):
        ops = _ops_of(local)
        from_file = any(op.func is read_file_bytes for op in ops)
        return "checkpoint" if from_file and not any(op.rng is not None for op in ops) else "init"
    return shadows.sources.get(t, "")


def source_files(t: torch.Tensor) -> frozenset[str]:
    """The files a deferred tensor's values are read from (as recorded: the real path of each
    checkpoint file); empty for a real tensor and for values computed from no file. ``save``
    asks it so as not to replace a file that tensors it leaves deferred still need."""
    local = _deferred_local(t)
    if not isinstance(local, DeferredTensor):
        return frozenset()
    return frozenset(op.args[0].file.path for op in _ops_of(local) if op.func is read_file_bytes)


def _ops_of(t: DeferredTensor) -> list[Any]:
    """The ops that compute ``t``'s values. A storage one op made from nothing (a file read, a
    constant) is its own plan: asked for every tensor of a checkpoint that is materialized."""
    writes = t._rec.storage.writes
    return writes if len(writes) == 1 and not writes[0].reads else plan([t._rec]).ops


def is_uninitialized(t: torch.Tensor) -> bool:
    """A lazy module's parameter before its first forward pass (no shape yet)."""
    return isinstance(t, torch.nn.parameter.UninitializedTensorMixin)


def _deferred_local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's (DTensor's) deferred local shard, else ``t`` itself: materializing
    that local tensor in place materializes the shard."""
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


def as_list_if_iterator(obj: Any) -> Any:
    """A one-shot iterable (``model.parameters()``, a generator) as a list, so that it can be
    walked more than once; anything else as it is."""
    if isinstance(obj, Iterator) and not isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return list(obj)
    return obj


def collect(obj: Any, verb: str = "materialize") -> list[torch.Tensor]:
    """The tensor objects ``obj`` names, each once; anything else is a ``TypeError`` that says
    what ``verb()`` takes."""
    if isinstance(obj, torch.Tensor):
        return [_deferred_local(obj)]
    if isinstance(obj, torch.nn.Module):
        return _module_tensors(obj)
    if isinstance(obj, (list, tuple, set, frozenset, ValuesView)):
        out: dict[int, torch.Tensor] = {}
        for x in obj:
            if not isinstance(x, (torch.Tensor, torch.nn.Module, list, tuple)):
                hint = " (for named_parameters(), pass parameters())" if isinstance(x, str) else ""
                raise ArgumentTypeError(
                    f"{verb}() takes a tensor, a module, or a list (or other iterable, e.g. "
                    f"model.parameters()) of them; got a {type(x).__name__} in the list{hint}"
                )
            for t in collect(x, verb):
                out.setdefault(id(t), t)
        return list(out.values())
    raise ArgumentTypeError(
        f"{verb}() takes a tensor, a module, or a list (or other iterable, e.g. "
        f"model.parameters()) of them; got {type(obj).__name__}"
    )


def iter_deferred(obj: Any) -> Iterable[DeferredTensor]:
    """The deferred tensors ``obj`` names (a sharded one as its local shard), each once."""
    return [t for t in collect(obj) if isinstance(t, DeferredTensor)]


def describe_request(obj: Any) -> str:
    """What a call acts on, in a few words for messages: ``"Net"``, ``"a tensor of shape
    (3, 4)"``, ``"2 objects"``."""
    if isinstance(obj, torch.nn.Module):
        return type(obj).__name__
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, Sized):
        return f"{len(obj)} objects"
    return f"a {type(obj).__name__}"


_cpp_grad = torch._C.TensorBase.grad.__get__


def with_grads(
    tensors: list[DeferredTensor],
) -> tuple[list[DeferredTensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``tensors`` and the deferred ``.grad`` of each (``backward()`` called in ``__init__``),
    each once; and the (tensor, gradient) pairs to set again once they are real: the swap into
    place gives a tensor a new impl, and its ``.grad`` lived on the old one."""
    pairs = []
    with torch._C.DisableTorchFunctionSubclass():
        for t in tensors:
            grad = _cpp_grad(t)
            if grad is not None:
                pairs.append((t, grad))
    ids = {id(t) for t in tensors}
    grads = [g for _, g in pairs if isinstance(g, DeferredTensor) and id(g) not in ids]
    return [*tensors, *{id(g): g for g in grads}.values()], pairs


def set_grads(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each tensor its gradient again (:func:`with_grads`), as the same object (real now,
    with the tensor's dtype and device: it was materialized in the same call)."""
    for t, grad in pairs:
        if grad.dtype != t.dtype or grad.device != t.device:  # a real one, cast or moved
            grad = grad.to(t.device, t.dtype)
        t.grad = grad
