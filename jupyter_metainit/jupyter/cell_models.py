"""The models a ``%%meta_init`` cell made: which new names hold modules, whether each module
was set up (``super().__init__()`` called), and the one line that describes a model.

The magics use these after the cell ran and before they touch a module a user names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from jupyter_metainit.core import format_bytes, format_count, tensor_state, unique_tensors

__all__ = [
    "is_set_up",
    "new_bindings",
    "new_modules",
    "not_set_up_note",
    "not_set_up_part",
    "summary_line",
]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Parameters and buffers of a module (shared ones once), or the tensor(s) themselves."""
    if isinstance(obj, nn.Module):
        return unique_tensors(obj)
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for item in obj for t in _tensors(item)]


def summary_line(name: str, obj: Any) -> str:
    """One line for people: ``model: LlamaForCausalLM, 70.55 B parameters, 131.4 GiB, deferred``.

    Lazy parameters (``nn.LazyLinear`` before its first forward) have no shape yet: they are
    counted apart, as ``3 lazy tensors``.
    """
    tensors = _tensors(obj)
    known = [t for t in tensors if not is_lazy(t)]
    lazy = len(tensors) - len(known)
    if isinstance(obj, nn.Module):
        params = sum(p.numel() for p in obj.parameters() if not is_lazy(p))
    else:
        params = sum(t.numel() for t in known)
    size = sum(t.numel() * t.element_size() for t in known)
    parts = [type(obj).__name__, f"{format_count(params)} parameters", format_bytes(size)]
    if lazy:
        parts.append(f"{lazy} lazy tensor{'s' if lazy > 1 else ''}")
    parts.extend(sorted({tensor_state(t) for t in known}) or ([] if lazy else ["no tensors"]))
    return f"{name}: " + ", ".join(parts)


def _has_module_state(module: nn.Module) -> bool:
    state = getattr(module, "__dict__", {})
    return all(key in state for key in ("_parameters", "_buffers", "_modules"))


def not_set_up_part(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The first module (qualified name, ``""`` for ``module`` itself) whose ``__init__`` never
    ran ``nn.Module.__init__`` (no ``super().__init__()``): it has no parameter or submodule
    dicts, so every walk over the model fails. None when every part is set up."""
    stack: list[tuple[str, nn.Module]] = [("", module)]
    seen: set[int] = set()
    while stack:
        name, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if not _has_module_state(m):
            return name, m
        for child_name, child in m._modules.items():
            if child is not None:
                stack.append((f"{name}.{child_name}" if name else child_name, child))
    return None


def is_set_up(module: nn.Module) -> bool:
    return not_set_up_part(module) is None


def not_set_up_note(name: str, module: nn.Module, refusal: str) -> str:
    """``b: Bad, not shown: ...`` saying which part was never set up and how to fix it."""
    part_name, part = not_set_up_part(module) or ("", module)
    kind = type(part).__name__
    where = f" (its part {part_name})" if part_name else ""
    return (
        f"{name}: {type(module).__name__}, {refusal}{where}: {kind}.__init__ never called "
        f"nn.Module.__init__ (add super().__init__() at the start of {kind}.__init__)"
    )


def new_bindings(before: dict[str, Any], after: dict[str, Any]) -> dict[str, nn.Module]:
    """Top-level ``nn.Module``s a cell bound or rebound (``before`` holds the objects)."""
    return {
        name: obj
        for name, obj in after.items()
        if not name.startswith("_")
        and isinstance(obj, nn.Module)
        and not (name in before and before[name] is obj)
    }


def new_modules(before: dict[str, Any], after: dict[str, Any]) -> dict[str, nn.Module]:
    """Top-level ``nn.Module``s bound or rebound by a cell, minus submodules of another new one.

    ``before`` holds the objects themselves (not their ids) so an id cannot be reused in between.
    Modules that were never set up (see :func:`is_set_up`) are left out.
    """
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for name, obj in new_bindings(before, after).items():
        if not is_set_up(obj):
            continue
        if id(obj) not in seen:
            seen.add(id(obj))
            found[name] = obj
    inner: set[int] = set()
    for module in found.values():
        inner.update(id(sub) for sub in module.modules() if sub is not module)
    return {name: m for name, m in found.items() if id(m) not in inner}
