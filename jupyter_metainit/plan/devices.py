"""The devices a plan may use and how much memory each offers.

``devices`` is a mapping ``{"cuda:0": "80GiB", "cpu": 256 * 2**30}`` (capacities in bytes or
as sizes) or ``"auto"``: every visible GPU with its free memory, then the host's available
memory as ``"cpu"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from jupyter_metainit.core import indexed_device, parse_size
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.estimates.fit import device_budget

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
            raise ArgumentError(
                f"{option} takes name=value items separated by commas (e.g. {option} "
                f"{example}), not {item.strip()!r}"
            )
        pairs[name] = value
    return pairs


# Where a module can run from, as accelerate's device maps name them.
_KINDS = ("cuda", "xpu", "mps", "npu", "hpu", "mtia", "cpu", "meta")


def _device_name(device: Any) -> str:
    """``"cuda:0"``, ``"cpu"``, ...: the core's device parser (an int is a GPU index, a bare
    ``"cuda"`` the current GPU), limited to the kinds a device map names."""
    try:
        parsed = indexed_device(device, "a key of devices=")
    except ArgumentTypeError as e:
        raise ArgumentTypeError(
            f"{device!r} is not a device: use 'cuda:0', 'cuda:1', ..., 'cpu' as the keys of "
            "devices= (e.g. devices={'cuda:0': '80GiB', 'cpu': '256GiB'}), or devices='auto'"
        ) from e
    except ArgumentError:
        parsed = None
    if parsed is None or parsed.type not in _KINDS or parsed.type == "meta":
        raise ArgumentError(
            f"unknown device {device!r} in devices=: use 'cuda:0', 'cuda:1', ..., 'cpu' "
            "(e.g. devices={'cuda:0': '80GiB', 'cpu': '256GiB'}), or devices='auto'"
        )
    if parsed.index is None and parsed.type != "cpu":
        parsed = torch.device(parsed.type, 0)
    return str(parsed)


def _capacity(device: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ArgumentTypeError(
            f"the capacity of {device!r} is {value!r}: give bytes (an int) or a size such as "
            "'80GiB' (1024-based) or '80GB' (1000-based)"
        )
    try:
        capacity = parse_size(value, "capacity")  # the one size grammar
    except ArgumentError as e:
        raise ArgumentError(f"cannot read the capacity of {device!r} from {value!r}: {e}") from e
    if capacity <= 0:
        raise ArgumentError(f"capacity of {device!r} must be positive, not {value!r}")
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
            raise ArgumentError(
                f"devices={devices!r}: pass 'auto' (the visible devices' free memory) or a "
                "mapping such as {'cuda:0': '80GiB', 'cuda:1': '80GiB', 'cpu': '256GiB'}"
            )
        return _visible()
    takes = (
        "devices must be 'auto' or a non-empty mapping of device -> capacity, such as "
        f"{{'cuda:0': '80GiB', 'cpu': '256GiB'}}, not {devices!r}"
    )
    if not isinstance(devices, Mapping):
        raise ArgumentTypeError(takes)
    if not devices:
        raise ArgumentError(takes)
    parsed: dict[str, int] = {}
    for device, value in devices.items():
        name = _device_name(device)
        if name in parsed:
            raise ArgumentError(f"device {name!r} appears twice in devices= ({device!r})")
        parsed[name] = _capacity(name, value)
    return parsed


def is_offload(device: str) -> bool:
    """Host memory: used only when the accelerators cannot hold the model (accelerate's
    'offload')."""
    return device == "cpu"
