"""Factory recipes: repeating the recording of a factory call seen before.

A model makes the same factory calls over and over (every layer's parameters); a recipe is what
one full recording of such a call produced, kept by call key, so the next identical call makes
the same deferred tensor and the same ``OpRecord`` for about a third of the cost.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.inputs import META, call_site, new_output
from jupyter_metainit.core.record.dispatch.metadata import (
    COLUMN_MAJOR_OUTPUTS,
    PROBED,
    Unkeyable,
    call_key,
)
from jupyter_metainit.core.record.graph import OpRecord, next_seq
from jupyter_metainit.core.record.ops import OpInfo
from jupyter_metainit.core.record.state import tls
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.runtime.plain import plain

# Recipes of factory calls (``torch.empty``, ``zeros``, ``ones``, ``full``, ``arange``: no tensor
# argument, no random draw), by (op, arguments, default dtypes, device). A model makes the same
# factory calls over and over (every layer's parameters), and each was a full recording: binding,
# meta kernel, dtype resolution. A recipe is what that recording produced, so replaying it makes
# the same deferred tensor and the same ``OpRecord``, for about a third of the cost.
_recipes: dict[Any, tuple[tuple, tuple, torch.dtype, tuple, dict]] = {}


recipe_funcs: set[Any] = set()


_RECIPES_SIZE = 8192


def _factory_key(func: Any, args: tuple, kwargs: dict) -> Any:
    """The recipe key, or None when an argument is not a plain value (a tensor, anything odd)."""
    try:
        return tls.pending_device, call_key(func, args, kwargs, tensors=False)
    except Unkeyable:
        return None


def keep_recipe(func: Any, args: tuple, kwargs: dict, out: torch.Tensor, op: OpRecord) -> None:
    key = _factory_key(func, args, kwargs)
    if key is None:
        return
    if len(_recipes) >= _RECIPES_SIZE:
        _recipes.clear()
    _recipes[key] = (
        tuple(out.shape),
        tuple(out.stride()),
        out.dtype,
        _copied(op.args),
        dict(op.kwargs),
    )
    recipe_funcs.add(func)


def _copied(args: tuple) -> tuple:
    """Each record gets its own size lists: nothing recorded is shared between two ops."""
    return tuple(list(a) if type(a) is list else a for a in args)


def record_from_recipe(func: Any, args: tuple, kwargs: dict) -> DeferredTensor | None:
    """The recording of a factory call seen before with the same arguments (see ``_recipes``)."""
    key = _factory_key(func, args, kwargs)
    recipe = _recipes.get(key) if key is not None else None
    if recipe is None:
        return None
    size, stride, dtype, rec_args, rec_kwargs = recipe
    where = call_site()
    device = tls.pending_device
    with plain():
        meta = torch.empty_strided(size, stride, dtype=dtype, device=META)
    made, rec, storage = new_output(meta, device, False)
    op = OpRecord(
        next_seq(), func, _copied(rec_args), dict(rec_kwargs), (), (rec,), None, where, None, (), ()
    )
    storage.writes.append(op)
    return made


def worth_a_recipe(
    func: Any,
    info: OpInfo,
    device: torch.device,
    out: Any,
    new_records: list,
    mutates: list,
    computed_or_default: bool,
) -> bool:
    """Whether a recorded call is a plain factory call whose recording a recipe can repeat:
    one new output at offset 0 on the device the call named, nothing random, written, computed
    from values or dependent on the default dtype, and no layout fix-up."""
    return (
        info.dtype_index is not None
        and not info.takes_tensors
        and not info.is_random
        and not mutates
        and not computed_or_default
        and len(new_records) == 1
        and not isinstance(out, (tuple, list))
        and out.storage_offset() == 0
        and tls.pending_device is not None
        and device == tls.pending_device
        and func not in PROBED
        and func not in COLUMN_MAJOR_OUTPUTS
    )
