"""The default dtype: recorded explicitly wherever an op's result depends on it.

PyTorch's default dtype is process-wide and may differ at replay (``meta_init(dtype=...)``,
``torch.set_default_dtype`` later). The rule owned here: **replay never reads the default dtype
in force then**. A factory whose dtype was left to the default gets it as an explicit ``dtype``
argument; an op whose floating result comes from the default (``int_t / 16``) is rewritten with
its dtype explicit where that changes no value, else its ``OpRecord`` keeps the default dtype
it ran under (``default_dtype``; replay runs it under ``state.default_dtype_as``).

Also owned here: the same-dtype checks eager kernels make and PyTorch's meta kernels skip
(:func:`check_same_dtypes`), so a mixed-dtype matmul fails where it is written, as eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.inputs import call_site, is_float
from jupyter_metainit.core.record.dispatch.metadata import meta_outputs
from jupyter_metainit.core.record.ops import OpInfo
from jupyter_metainit.core.record.state import (
    _global_default_dtype,
    default_dtype_as,
    dtype_override,
)
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


@dataclass
class Dtypes:
    """What :func:`resolve_dtypes` found: the call as recorded, its outputs, and the default
    dtype replay must run it under (None: none needed)."""

    kwargs: dict
    meta_kwargs: dict
    out: Any
    default_dtype: torch.dtype | None = None
    explicit: tuple[tuple, dict] | None = None  # the same op with its dtype explicit: record that


def resolve_dtypes(
    func: Any,
    info: OpInfo,
    bound: list,
    flat: list,
    args: tuple,
    kwargs: dict,
    meta_args: tuple,
    meta_kwargs: dict,
    out: Any,
) -> Dtypes:
    """Make the call's dtype independent of the default dtype in force at replay."""
    if info.dtype_index is not None and not info.takes_tensors:
        # A factory: replay gets the dtype explicitly, never the default in force then.
        if bound[info.dtype_index] is None:
            global_default, override = _global_default_dtype(), dtype_override()
            if (
                override is not None
                and override != global_default
                and isinstance(out, torch.Tensor)
                and out.dtype == global_default
            ):
                meta_kwargs = {**meta_kwargs, "dtype": override}
                out = meta_outputs(func, bound, meta_args, meta_kwargs)
            kwargs = {**kwargs, "dtype": out.dtype}
            meta_kwargs = {**meta_kwargs, "dtype": out.dtype}
        return Dtypes(kwargs, meta_kwargs, out)
    if not uses_default_dtype(flat, out):
        return Dtypes(kwargs, meta_kwargs, out)
    global_default, override = _global_default_dtype(), dtype_override()
    default_dtype = override if override is not None else global_default
    explicit = explicit_default_dtype(func, info, args, kwargs, default_dtype, out)
    if explicit is not None:
        return Dtypes(kwargs, meta_kwargs, out, default_dtype, explicit)
    if default_dtype != global_default:
        with default_dtype_as(default_dtype):
            out = meta_outputs(func, bound, meta_args, meta_kwargs)
    return Dtypes(kwargs, meta_kwargs, out, default_dtype)


# Ops whose CPU and CUDA kernels refuse inputs of different dtypes ("expected m1 and m2 to have
# the same dtype") while their meta kernels accept them and answer with the first input's dtype:
# by name, the arguments that must share one dtype (every overload but ``out_dtype`` ones).
# Without the check a float64 x float32 matmul is recorded and fails only at materialize.
_SAME_DTYPE: dict[str, tuple[str, ...]] = {
    "mm": ("self", "mat2"),
    "addmm": ("self", "mat1", "mat2"),
    "addmm_": ("self", "mat1", "mat2"),
    "_addmm_activation": ("self", "mat1", "mat2"),
    "addbmm": ("self", "batch1", "batch2"),
    "addbmm_": ("self", "batch1", "batch2"),
    "mv": ("self", "vec"),
    "convolution": ("input", "weight"),
    "nll_loss_forward": ("self", "weight"),
    "nll_loss2d_forward": ("self", "weight"),
}
_same_dtype_slots: dict[Any, tuple[int, ...]] = {}  # per overload, read once


def check_same_dtypes(func: Any, info: OpInfo, bound: list) -> None:
    """Raise eager's ``RuntimeError`` where ``func`` is given tensors of different dtypes that
    its real kernels refuse and its meta kernel would let through (``_SAME_DTYPE``)."""
    slots = _same_dtype_slots.get(func)
    if slots is None:
        names = _SAME_DTYPE.get(func._schema.name.split("::")[-1], ())
        if "out_dtype" in info.arg_names:
            names = ()
        slots = _same_dtype_slots[func] = tuple(
            info.arg_index(n) for n in names if n in info.arg_names
        )
    if not slots:
        return
    tensors = [(info.arg_names[i], bound[i]) for i in slots if isinstance(bound[i], torch.Tensor)]
    dtypes = {t.dtype for _, t in tensors}
    if len(dtypes) > 1:
        got = ", ".join(f"{name}: {t.dtype}" for name, t in tensors)
        raise RuntimeError(
            f"{func} expects {' and '.join(n for n, _ in tensors)} to have the same dtype, but "
            f"got {got} (called at {call_site()}); eager PyTorch refuses this too: cast one of "
            "them (x.to(layer.weight.dtype)), or build the model under the dtype of its inputs "
            "(meta_init(dtype=...))"
        )
