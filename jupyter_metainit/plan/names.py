"""Names between the user and the parts: pins given by module name, and the device map.

A pin names a module as ``model.named_modules()`` does; it covers every part at or under it. The
device map names modules, and, where a module's own tensors go elsewhere than its children,
those tensors by their qualified names (as accelerate's device maps do: ``final_logits_bias``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.plan.parts import Part, describe
from jupyter_metainit.plan.place_arguments import parse_devices

__all__ = ["check_pin", "compact_device_map", "resolve_pins"]

_PIN_TAKES = (
    "pin takes a dict of module name -> device, e.g. pin={'lm_head': 'cuda:0'}: a name as in "
    "model.named_modules(), a device as 'cuda:0' or 'cpu', a GPU index or a torch.device"
)


def check_pin(pin: Any) -> None:
    """``pin=`` of the wrong type (a list, a device alone, a number) is an
    ``ArgumentTypeError`` that says what it takes."""
    if pin is None:
        return
    if not isinstance(pin, Mapping):
        hint = ""
        if isinstance(pin, (str, int, torch.device)) and not isinstance(pin, bool):
            hint = f" (to put the whole model on it: pin={{'': {pin!r}}})"
        raise ArgumentTypeError(f"{_PIN_TAKES}; not {type(pin).__name__} {pin!r}{hint}")
    for name, device in pin.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"{_PIN_TAKES}; the key {name!r} is not a module name")
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise ArgumentTypeError(f"{_PIN_TAKES}; {name!r} is pinned to {device!r}, not a device")


def _why_whole(part: Part) -> str:
    if part.group:
        return f"one of the repeated blocks {part.group}.*, which a plan never splits"
    if not any(True for _ in part.module.children()):
        return "a single layer"
    return "kept whole as no_split= or a pin asks"


def _inside_error(name: str, holder: Part) -> ArgumentError:
    whole = describe(holder.name)
    instead = (
        f"pin {whole} instead (a pin moves a whole part)"
        if holder.name
        else "pin the whole model instead, or pin nothing"
    )
    blocks = ""
    if holder.group:
        blocks = ", or in Python pass place(..., no_split=[]) to split the blocks"
    return ArgumentError(
        f"pin: {name!r} lies inside {whole}, {_why_whole(holder)}: {instead}{blocks}"
    )


def resolve_pins(
    pin: Mapping[str, Any] | None, parts: list[Part], model: nn.Module, devices: dict[str, int]
) -> dict[str, str]:
    """Leader part name -> device, for every part a pin names (or lies under)."""
    if not pin:
        return {}
    check_pin(pin)
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for name, device in pin.items():
        target = parse_devices({device: 1})
        device_name = next(iter(target))
        if device_name not in devices:
            raise ArgumentError(
                f"pin={{{name!r}: {device!r}}}: {device_name} is not in devices= "
                f"({', '.join(devices)}); add it with its capacity or pin elsewhere"
            )
        if name not in modules:
            raise ArgumentError(
                f"pin: the model has no module {name!r}; use a qualified name "
                "as in model.named_modules() (e.g. 'lm_head', 'model.layers.0')"
            )
        under = [p for p in parts if not name or p.name == name or p.name.startswith(name + ".")]
        if not under:
            holder = next(
                p for p in parts if not p.own_only and (not p.name or name.startswith(p.name + "."))
            )
            raise _inside_error(name, holder)
        for part in under:
            resolved[(part.leader or part).name] = device_name
    return resolved


def compact_device_map(
    model: nn.Module, parts: list[Part], where: dict[str, str]
) -> dict[str, str]:
    """Part devices, compacted: a module whose parts all go to one device stands for them; a
    module's own tensors placed apart from its children are named one by one."""
    below: dict[str, set[str]] = {}
    for name, device in where.items():
        below.setdefault(name, set()).add(device)
        while name:
            name = name.rpartition(".")[0]
            below.setdefault(name, set()).add(device)
    own = {p.name: p for p in parts if p.own_only}
    compact: dict[str, str] = {}
    for name, _ in model.named_modules():
        devices = below.get(name)
        if devices is None:
            continue
        parent, covered = name, False
        while parent and not covered:  # an ancestor on one device already stands for it
            parent = parent.rpartition(".")[0]
            covered = len(below.get(parent, ())) == 1
        if covered:
            continue
        if len(devices) == 1:
            compact[name] = next(iter(devices))
        elif name in own:  # split: its own tensors go where their part goes
            compact.update(dict.fromkeys(own[name].tensor_names(), where[name]))
    return compact
