"""The fill fast path: ``zero_``, ``fill_``, ``normal_``, ``uniform_``... on a deferred tensor.

Fills are most of a model's initialisation: :func:`record_fill` records them as the general
path (``record_op``) would, without its machinery. Also owns the write-ordering shortcut
:func:`full_overwrite`: an op that writes every byte of a storage without reading it ends that
storage's dependence on what came before.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.inputs import call_site
from jupyter_metainit.core.record.dispatch.metadata import ATEN_SCALAR_TYPES, OVERWRITES_SELF
from jupyter_metainit.core.record.dispatch.random_ops import place_random
from jupyter_metainit.core.record.graph import OpRecord, StorageRecord, next_seq
from jupyter_metainit.core.record.tensor import DeferredTensor

aten = torch.ops.aten


def record_fill(func: Any, args: tuple, kwargs: dict) -> DeferredTensor | None:
    """``t.zero_()``, ``t.fill_(v)``, ``t.normal_(...)`` on a deferred ``t`` with plain number
    arguments: the bulk of a model's initialisation, recorded as :func:`record_op` would, without
    its general machinery (binding, meta kernels, dtypes: a fill changes none of them). None
    when an argument is not a plain value (``record_op`` then takes it)."""
    for a in args[1:]:
        if type(a) not in ATEN_SCALAR_TYPES:
            return None
    generator = None
    for k, v in kwargs.items():
        if k == "generator":
            if v is not None and not isinstance(v, torch.Generator):
                return None
            generator = v
        elif type(v) not in ATEN_SCALAR_TYPES:
            return None
    self: DeferredTensor = args[0]
    where = call_site()
    storage = self._rec.storage
    overwrites = full_overwrite(func, args)
    rng = None
    rec_kwargs = dict(kwargs)
    if func not in _PLAIN_FILLS:
        meta = self._meta
        rng, _ = place_random(
            func,
            (meta, *args[1:]),
            kwargs,
            True,
            generator,
            meta.numel() * meta.element_size(),
            self.device,
        )
        if "generator" in rec_kwargs:
            rec_kwargs["generator"] = None
    op = OpRecord(
        next_seq(),
        func,
        (self._rec, *args[1:]),
        rec_kwargs,
        () if overwrites is not None else (storage,),
        (None,),
        rng,
        where,
        None,
        (storage,),
        () if overwrites is None else (overwrites,),
    )
    storage.writes.append(op)
    return self


_PLAIN_FILLS = frozenset({aten.fill_.Scalar, aten.zero_.default})


def full_overwrite(func: Any, bound: list) -> StorageRecord | None:
    """The storage ``func`` writes completely without reading it, if any.

    Fills (``normal_``, ``uniform_``, ``zero_``, ``fill_``) and ``copy_`` from another storage,
    through a view that covers every byte of its storage.
    """
    self = bound[0] if bound else None
    if not isinstance(self, DeferredTensor):
        return None
    if func is aten.copy_.default:
        src = bound[1]
        if isinstance(src, DeferredTensor) and src._rec.storage is self._rec.storage:
            return None
    elif func not in OVERWRITES_SELF:
        return None
    meta, storage = self._meta, self._rec.storage
    if meta.numel() * meta.element_size() != storage.nbytes:
        return None
    return storage if meta.is_contiguous() or _dense(meta.shape, meta.stride()) else None


def _dense(size: Any, stride: Any) -> bool:
    """Non-overlapping and dense: the elements are one block of memory in some dim order."""
    expected = 1
    for st, sz in sorted((st, sz) for sz, st in zip(size, stride, strict=True) if sz != 1):
        if st != expected:
            return False
        expected *= sz
    return True
