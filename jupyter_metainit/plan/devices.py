"""The devices a plan may use and how much memory each offers.

``devices`` is a mapping ``{"cuda:0": "80GiB", "cpu": 256 * 2**30}`` (capacities in bytes or
as sizes) or ``"auto"``: every visible GPU with its free memory, then the host's available
memory as ``"cpu"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from jupyter_metainit.estimates.fit import device_budget, parse_bytes

__all__ = ["is_offload", "name_value_pairs", "parse_devices"]


def name_value_pairs(
    text: str, *, option: str, example: str, values_optional: bool = False
) -> dict[str, str]:
    """``"cuda:0=80GiB, cpu=256GiB"`` (commas or semicolons) -> ``{"cuda:0": "80GiB", ...}``:
    how ``%place --devices/--pin`` and the widget's plan bar read what the user typed.

    With ``values_optional`` a bare name maps to ``""``. A malformed item is a ``ValueError``
    naming ``option`` with an ``example`` of what to type.
    """
    pairs: dict[str, str] = {}
    for item in text.replace(";", ",").split(","):
        if not item.strip():
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not name or (not values_optional and (not sep or not value)):
            raise ValueError(
                f"{option} takes name=value items separated by commas (e.g. {option} "
                f"{example}), not {item.strip()!r}"
            )
        pairs[name] = value
    return pairs


# Where a module can run from, as accelerate's device maps name them.
_KINDS = ("cuda", "xpu", "mps", "npu", "hpu", "mtia", "cpu", "meta")


def _device_name(device: Any) -> str:
    """``"cuda:0"``, ``"cpu"``, ...; an int is a GPU index (accelerate's convention)."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"{device!r} is not a device: name devices as 'cuda:0', 'cuda:1', 'cpu' (a string), "
            "a GPU index (an int) or a torch.device"
        )
    if isinstance(device, int):
        device = f"cuda:{device}"
    if isinstance(device, torch.device):
        device = str(device)
    try:
        parsed = torch.device(device.strip())
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in _KINDS or parsed.type == "meta":
        raise ValueError(
            f"unknown device {device!r} in devices=: use 'cuda:0', 'cuda:1', ..., 'cpu' "
            "(e.g. devices={'cuda:0': '80GiB', 'cpu': '256GiB'}), or devices='auto'"
        )
    if parsed.type != "cpu" and parsed.index is None:
        parsed = torch.device(parsed.type, 0)  # "cuda" is the first GPU in a device map
    return str(parsed)


def _capacity(device: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"capacity of {device!r} is {value!r}: give bytes (an int) or a size such as "
            "'80GiB' / '80GB'"
        )
    try:
        capacity = parse_bytes(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"cannot read the capacity of {device!r} from {value!r}: give bytes (an int) or a "
            "size such as '80GiB' (1024-based) or '80GB' (1000-based)"
        ) from e
    if capacity <= 0:
        raise ValueError(f"capacity of {device!r} must be positive, not {value!r}")
    return capacity


def _visible() -> dict[str, int]:
    found = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            found[f"cuda:{i}"] = device_budget(f"cuda:{i}")
    found["cpu"] = device_budget("cpu")
    return found


def parse_devices(devices: Mapping[Any, Any] | str) -> dict[str, int]:
    """``{"cuda:0": 85899345920, "cpu": ...}`` in the order given (the pipeline's order)."""
    if isinstance(devices, str):
        if devices.strip().lower() != "auto":
            raise ValueError(
                f"devices={devices!r}: pass 'auto' (the visible devices' free memory) or a "
                "mapping such as {'cuda:0': '80GiB', 'cuda:1': '80GiB', 'cpu': '256GiB'}"
            )
        return _visible()
    if not isinstance(devices, Mapping) or not devices:
        raise TypeError(
            "devices must be 'auto' or a non-empty mapping of device -> capacity, such as "
            f"{{'cuda:0': '80GiB', 'cpu': '256GiB'}}, not {devices!r}"
        )
    parsed: dict[str, int] = {}
    for device, value in devices.items():
        name = _device_name(device)
        if name in parsed:
            raise ValueError(f"device {name!r} appears twice in devices= ({device!r})")
        parsed[name] = _capacity(name, value)
    return parsed


def is_offload(device: str) -> bool:
    """Host memory: used only when the accelerators cannot hold the model (accelerate's
    'offload')."""
    return device == "cpu"
