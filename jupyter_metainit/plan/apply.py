"""Materialize a plan: every part exactly onto its planned device, with one progress total.

``materialize(model, placement=plan)`` hands the work here (the core reads only the plan's
``materialize_parts``): the parts are made device by device, in the pipeline's order, each
with eager's values (exactness holds in any grouping), and the progress callback sees one total
for the whole model. A failure anywhere makes the parts already made deferred again: every
device but the last keeps its recording until the call has succeeded, so those parts can also
be freed later with ``dematerialize``. A map may name a module's own parameters and buffers
one by one (``final_logits_bias``: they go elsewhere than its children): only those tensors are
made there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from jupyter_metainit.core import (
    dematerialize,
    is_deferred,
    materialize,
    progress_callback,
    unique_tensors,
)
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError

__all__ = ["materialize_parts"]


def _target(model: nn.Module, name: str) -> nn.Module | torch.Tensor:
    """The module, parameter or buffer a device map's key names."""
    owner, _, local = name.rpartition(".")
    try:
        return model.get_submodule(name)
    except AttributeError:
        pass
    try:
        parent = model.get_submodule(owner)
    except AttributeError:
        parent = None
    tensor = None
    if parent is not None:
        tensor = parent._parameters.get(local, parent._buffers.get(local))
    if tensor is None:
        raise ArgumentError(
            f"the plan names {name!r}, which is no module, parameter or buffer of this model: "
            "plan this model (jupyter_metainit.place(model, ...)) and materialize it with that "
            "plan"
        )
    return tensor


def _groups(
    model: nn.Module, device_map: Mapping[str, Any]
) -> dict[str, list[nn.Module | torch.Tensor]]:
    """Modules (and tensors named one by one) per device, devices in the map's order (the
    pipeline's)."""
    groups: dict[str, list[nn.Module | torch.Tensor]] = {}
    for name, device in device_map.items():
        module = _target(model, name)
        if isinstance(device, int) and not isinstance(device, bool):
            device = f"cuda:{device}"  # accelerate's maps name GPUs by index
        groups.setdefault(str(device), []).append(module)
    return groups


def _bytes(modules: list[nn.Module | torch.Tensor], dtype: torch.dtype | None) -> int:
    """What the deferred tensors of ``modules`` hold when real, floating ones at ``dtype``."""
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        found = (
            [module]
            if isinstance(module, torch.Tensor)
            else unique_tensors(module, attributes=True)
        )
        for t in found:
            if is_deferred(t):
                seen.setdefault(id(t), t)
    size = 0
    for t in seen.values():
        itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else None
        size += t.numel() * (itemsize or t.element_size())
    return size


def _offset(callback: Callable[..., None] | None, offset: int, total: int) -> Any:
    if callback is None:
        return None
    return lambda done, _total, phase="": callback(min(offset + done, total), total, phase)


def materialize_parts(
    device_map: Mapping[str, Any], model: nn.Module, *, progress: Any = None, **options: Any
) -> nn.Module:
    """Each module of ``device_map`` (name -> device) materialized on its device, ``options``
    (``dtype``, ``rng``, ``keep_cache``, ``checkpoint``, ``missing``, ``root``) as
    ``materialize`` takes them."""
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            "materialize(obj, placement=plan) takes the model the plan is for, not "
            f"{type(model).__name__}"
        )
    groups = _groups(model, device_map)
    if options.get("checkpoint") is not None and options.get("root") is None:
        options["root"] = model  # the checkpoint names tensors from the whole model
    keep_cache = options.pop("keep_cache", False)
    sizes = [_bytes(parts, options.get("dtype")) for parts in groups.values()]
    callback, bar = progress_callback(progress)
    done: list[nn.Module | torch.Tensor] = []
    offset = 0
    try:
        for k, (device, parts) in enumerate(groups.items()):
            last = k == len(groups) - 1
            materialize(
                parts,
                device,
                keep_cache=keep_cache or not last,
                progress=_offset(callback, offset, sum(sizes)),
                **options,
            )
            done += parts
            offset += sizes[k]
    except BaseException:
        if done:  # the parts made already become deferred again
            dematerialize(done, force=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return model
