"""TODO"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.inputs import is_float
from jupyter_metainit.core.record.ops import OpInfo
from jupyter_metainit.core.runtime.plain import plain

aten = torch.ops.aten

def uses_default_dtype(flat: list, out: Any) -> bool:
    """True if ``out``'s floating dtype can only have come from the default dtype."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not any(isinstance(o, torch.Tensor) and is_float(o.dtype) for o in outs):
        return False
    return not any(isinstance(x, torch.Tensor) and is_float(x.dtype) for x in flat)


def explicit_default_dtype(
    func: Any, info: OpInfo, args: tuple, kwargs: dict, dtype: torch.dtype, out: Any
) -> tuple[tuple, dict] | None:
    """The same op with its result dtype made explicit, where that changes no value.

    An op whose floating result comes from the default dtype (``int_t / 16``, ``int_t * 0.5``,
    ``torch.sqrt(int_t)``) promotes its inputs to that dtype and computes in it. Giving it a
    0-dim ``dtype`` tensor for each Python number, or (pointwise ops without numbers) its first
    integer input cast to ``dtype``, promotes to the same dtype and computes the same values,
    and makes replay independent of the default in force then. None when neither applies.
    """
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, torch.Tensor) and o.is_complex() for o in outs):
        return None
    schema = func._schema.arguments
    tensor_slots = {a.name for a in schema if str(a.type) in ("Tensor", "Optional[Tensor]")}

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    def zero_dim(x: Any) -> torch.Tensor:
        with plain():
            return torch.tensor(x, dtype=dtype)

    new_args = list(args)
    new_kwargs = dict(kwargs)
    changed = False
    for i, x in enumerate(args):
        if i < len(schema) and schema[i].name in tensor_slots and number(x):
            new_args[i], changed = zero_dim(x), True
    for k, x in kwargs.items():
        if k in tensor_slots and number(x):
            new_kwargs[k], changed = zero_dim(x), True
    if not changed and torch.Tag.pointwise in func.tags:
        for i, x in enumerate(args):
            if i < len(schema) and schema[i].name in tensor_slots and isinstance(x, torch.Tensor):
                new_args[i] = aten._to_copy.default(x, dtype=dtype)
                changed = True
                break
    return (tuple(new_args), new_kwargs) if changed else None
