"""FLOPs of a dry run's forward pass, per module (subtree inclusive), from torch's counter.

Adds what ``FlopCounterMode`` lacks on some torch versions (the CPU flash-attention kernel)
and keeps its module tracker off autograd, which deferred tensors do not have.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

__all__ = ["flop_counter", "flops_by_module"]


def _cpu_flash_sdpa_flops(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """FLOPs of the CPU flash-attention kernel, which FlopCounterMode does not map (torch 2.13).

    Grouped-query attention (fewer key/value heads) counts as its heads repeated, which is the
    work the kernel does; older ``sdpa_flop_count`` (torch 2.11) refuses unequal head counts.
    """
    heads = query_shape[1]
    key_shape = (key_shape[0], heads, *key_shape[2:])
    value_shape = (value_shape[0], heads, *value_shape[2:])
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _extra_flop_formulas() -> dict[Any, Any]:
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op in flop_registry:
        return {}
    return {op: _cpu_flash_sdpa_flops}


def _track_forward_only(flops: FlopCounterMode) -> FlopCounterMode:
    """Keep ``flops``' module tracker off autograd: the dry run has no backward.

    Its hooks register gradient hooks on a module's inputs and outputs that require grad;
    on deferred tensors (no autograd graph) that fails whenever a module is called on a
    parameter (``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``, a learned
    query fed to a Linear). The same names are pushed and popped without them.
    """
    tracker = getattr(flops, "mod_tracker", None)
    name_of = getattr(tracker, "_get_mod_name", None)
    push = getattr(tracker, "_get_append_fn", None)
    pop = getattr(tracker, "_get_pop_fn", None)
    if name_of is None or push is None or pop is None:  # another torch: keep its own hooks
        return flops

    def pre_hook(mod: nn.Module, args: Any) -> None:
        push(name_of(mod), False)()

    def post_hook(mod: nn.Module, args: Any, output: Any) -> None:
        pop(name_of(mod), False)()

    # ModuleTracker.__enter__ registers these instance attributes as its global hooks.
    tracker._fw_pre_hook = pre_hook  # type: ignore[union-attr]
    tracker._fw_post_hook = post_hook  # type: ignore[union-attr]
    return flops


def flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` for a dry run: no display, forward only, CPU flash attention."""
    return _track_forward_only(
        FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
    )


def flops_by_module(
    flops: FlopCounterMode, root: nn.Module, reached: set[str], known: set[str]
) -> dict[str, int]:
    """Qualified module name -> FLOPs of its subtree; 0 for a module reached without any."""
    root_label = type(root).__name__
    by_name: dict[str, int] = {name: 0 for name in reached}
    for key, per_op in flops.get_flop_counts().items():
        if key == root_label:
            name = ""
        elif key.startswith(root_label + "."):
            name = key[len(root_label) + 1 :]
        else:
            continue
        if name in known:
            by_name[name] = int(sum(per_op.values()))
    return by_name
