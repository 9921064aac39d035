"""Which tensors a module holds, and the memory under each: the one walker every layer uses.

``materialize`` collects with it, the widget's tree and the memory table count with it, and the
checkpoint loader and ``materialize_sharded`` name tensors with it, so that what is shown is what
is acted on. A sharded parameter (DTensor) is looked into here too: :func:`local_tensor` is the
one place that reaches for its local shard (duck-typed: no ``torch.distributed`` import).
It knows deferred tensors (a deferred attribute is part of the model, and its memory is its
recorded storage), so it sits at the materialize stage, above recording.
"""

from __future__ import annotations

import collections
import functools
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.swap import identity_table

__all__ = [
    "OwnTensor",
    "counted_attributes",
    "local_tensor",
    "named_tensors",
    "own_tensors",
    "storage_of",
    "unique_tensors",
]


class OwnTensor(NamedTuple):
    """A tensor a module holds directly, under ``name``."""

    name: str
    tensor: torch.Tensor
    kind: str  # "parameter", "buffer", "non-persistent buffer" or "attribute"


# What ``nn.Module.__init__`` puts in ``__dict__`` (parameter/buffer/module dicts, hooks):
# bookkeeping, not attributes of the model.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)

# How deep containers are followed (a dict of lists of tuples ...): deep enough for real models,
# and a bound for self-referencing structures.
_MAX_CONTAINER_DEPTH = 8


def own_tensors(
    module: nn.Module, *, attributes: bool = False, real_attributes: bool = False
) -> list[OwnTensor]:
    """The parameters and buffers ``module`` holds itself (not its children's), in order.

    With ``attributes``, also the deferred tensors kept as plain attributes, directly or in
    containers (lists, tuples, dicts, deques, sets, dataclasses, ``SimpleNamespace`` and other
    plain objects, nested): a model's ``self.freqs = torch.arange(...)`` or
    ``self.tables = {"k": t}`` is built and materialized with it, and so are tensors that were
    deferred once (materialized, so that a later call moves, casts or frees them again). With
    ``real_attributes``, every tensor attribute counts (for estimates: they hold memory).
    """
    out = [OwnTensor(n, p, "parameter") for n, p in module._parameters.items() if p is not None]
    transient = module._non_persistent_buffers_set
    out += [
        OwnTensor(n, b, "non-persistent buffer" if n in transient else "buffer")
        for n, b in module._buffers.items()
        if b is not None
    ]
    if attributes or real_attributes:
        out += _attributes(module, real_attributes, None)
    return out


def _attributes(module: nn.Module, real: bool, walk: _Walk | None) -> list[OwnTensor]:
    out: list[OwnTensor] = []
    for n, v in module.__dict__.items():
        if type(v) not in _SCALARS and n not in _MODULE_INTERNALS:  # (most are sizes, flags)
            out += _attribute_tensors(n, v, real, 0, None, walk)
    return out


class _Walk:
    """What one walk over several modules (:func:`unique_tensors`) has looked into in full.

    Every module of a ``transformers`` model holds the same ``config`` (dozens of them): it is
    looked into once. A container counts as walked in full only if nothing under it was cut
    (by the depth bound or the cycle check), so that any later look into it could find only
    tensors found already; those looks are skipped (the walk keeps each tensor once anyway).
    """

    __slots__ = ("cuts", "full")

    def __init__(self) -> None:
        self.full: dict[int, object] = {}  # id -> container (kept: ids stay unique meanwhile)
        self.cuts = 0  # containers not entered because of the depth bound or a cycle


def _attribute_tensors(
    name: str,
    value: object,
    real: bool,
    depth: int,
    entered: set[int] | None = None,
    walk: _Walk | None = None,
) -> list[OwnTensor]:
    if type(value) in _SCALARS:  # most attributes of a model's modules (sizes, flags)
        return []
    if walk is not None and id(value) in walk.full:
        # Its tensors are known (see _Walk). First: ``isinstance`` asks an object that is not of
        # the type for its ``__class__``, which costs on a transformers config.
        return []
    if isinstance(value, torch.Tensor):
        if real or isinstance(value, DeferredTensor) or _was_deferred(value):
            return [OwnTensor(name, value, "attribute")]
        return []
    if isinstance(value, _NEVER_ENTERED):
        return []
    if depth >= _MAX_CONTAINER_DEPTH:
        if walk is not None:
            walk.cuts += 1
        return []
    items = _container_items(value)
    if items is None:
        return []
    # Cycle-safe: a structure that refers to itself (a node's ``parent``) is entered once.
    entered = set() if entered is None else entered
    if id(value) in entered:
        if walk is not None:
            walk.cuts += 1
        return []
    entered.add(id(value))
    cuts = walk.cuts if walk is not None else 0
    out: list[OwnTensor] = []
    for key, item in items:
        out += _attribute_tensors(f"{name}.{key}", item, real, depth + 1, entered, walk)
    if walk is not None and walk.cuts == cuts:
        walk.full[id(value)] = value
    return out


_SCALARS = frozenset({int, float, bool, complex, str, type(None)})
# Never entered: text, modules (their children are walked as modules), classes, functions.
_NEVER_ENTERED = (
    str, bytes, bytearray, memoryview, nn.Module, type, types.ModuleType, types.FunctionType,
    types.MethodType, types.BuiltinFunctionType, functools.partial, weakref.ref, range,
)  # fmt: skip


def _container_items(value: object) -> Iterable[tuple[object, object]] | None:
    """The ``(key, item)`` pairs of a container worth looking into for tensors, or None.

    Besides dicts, lists and tuples: deques, sets, and plain Python objects (dataclasses,
    ``SimpleNamespace``, a user's own class) through their ``__dict__`` and ``__slots__``.
    Objects of torch's and other libraries' compiled types are not entered (an optimizer, a
    generator, a hook handle hold nothing of the model's that is not walked already).
    """
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (list, tuple, collections.deque)):
        return list(enumerate(value))
    if isinstance(value, (set, frozenset)):
        return list(enumerate(value))
    module = getattr(type(value), "__module__", "") or ""
    if module == "builtins" or module.split(".", 1)[0] in _LIBRARIES_NOT_ENTERED:
        return None
    pairs: list[tuple[object, object]] = []
    try:  # a proxy's ``__getattr__`` may raise anything: such an object is not looked into
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict):
            pairs += list(attrs.items())
        for cls in type(value).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                    pairs.append((slot, getattr(value, slot)))
    except Exception:
        return None
    return pairs


# Libraries whose objects kept as attributes are machinery, not containers of the model's
# tensors (an optimizer's state, numpy arrays, a tokenizer's tables).
_LIBRARIES_NOT_ENTERED = frozenset({"torch", "numpy", "jupyter_metainit", "IPython", "ipywidgets"})


# Every tensor ``materialize`` made real -> where its values came from ("init" or "checkpoint").
# Kept here, weakly and off the tensor objects, because the walker must know it: an attribute
# that was deferred once stays part of the model (a later call moves, casts or frees it).
materialized_sources: WeakIdKeyDictionary = identity_table(WeakIdKeyDictionary())


def _was_deferred(t: torch.Tensor) -> bool:
    return t in materialized_sources


def named_tensors(
    module: nn.Module, *, attributes: bool = False
) -> Iterator[tuple[str, OwnTensor]]:
    """``(qualified module name, tensor)`` for every module and each tensor it holds; a tied
    tensor comes once per holder, and a module reachable under two names once per name."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        for own in own_tensors(m, attributes=attributes):
            yield prefix, own


def unique_tensors(module: nn.Module, *, attributes: bool = False) -> list[torch.Tensor]:
    """Every tensor of ``module`` and its children, each object once, in walk order."""
    seen: dict[int, torch.Tensor] = {}
    walk = _Walk() if attributes else None
    for m in module.modules():
        owned = own_tensors(m)
        if walk is not None:
            owned += _attributes(m, False, walk)
        for own in owned:
            seen.setdefault(id(own.tensor), own.tensor)
    return list(seen.values())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if ``t`` is a sharded tensor (DTensor), else ``t`` itself.

    After ``fully_shard`` or ``distribute_tensor`` a parameter is a DTensor wrapping a local
    tensor (deferred, or the real shard): materializing, freeing and counting act on that.
    """
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_of(t: torch.Tensor) -> tuple[object, int]:
    """``(key, bytes)`` of the memory ``t`` lives in: views of one storage share the key.

    Deferred tensors answer from their recording, real ones from their storage; a tensor with no
    storage to ask (meta, lazy) is its own key.
    """
    t = local_tensor(t)  # a DTensor's shard holds the memory
    if isinstance(t, DeferredTensor):
        return ("deferred", id(t._rec.storage)), t._rec.storage.nbytes
    if isinstance(t, nn.parameter.UninitializedTensorMixin):
        return ("object", id(t)), 0
    if t.is_meta:
        return ("object", id(t)), t.numel() * t.element_size()
    try:
        storage = t.untyped_storage()
        return ("real", str(t.device), storage.data_ptr()), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less kinds
        return ("object", id(t)), t.numel() * t.element_size()


def counted_attributes(modules: list[nn.Module]) -> list[list[OwnTensor]]:
    """Per module of ``modules`` (a model's ``modules()``), the tensor attributes that hold memory
    of their own: one tensor per storage (a view kept beside its base counts once; the same
    tensor kept by two modules comes as the same object in both, like a tied weight), and none
    over the storage of a parameter or buffer (``self.w_t = self.w.t()`` costs nothing)."""
    held: set[object] = set()
    for m in modules:
        for own in own_tensors(m):
            held.add(storage_of(own.tensor)[0])
    first_of: dict[object, OwnTensor] = {}
    out: list[list[OwnTensor]] = []
    for m in modules:
        here: list[OwnTensor] = []
        for own in own_tensors(m, real_attributes=True):
            if own.kind != "attribute":
                continue
            key = storage_of(own.tensor)[0]
            if key in held:
                continue
            rep = first_of.setdefault(key, own)
            if all(h.tensor is not rep.tensor for h in here):
                here.append(OwnTensor(own.name, rep.tensor, "attribute"))
        out.append(here)
    return out
