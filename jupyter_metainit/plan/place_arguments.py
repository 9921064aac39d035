"""What ``place()`` is told: the devices a plan may use and how much memory each offers, and
the workload's inputs.

``devices`` is a mapping ``{"cuda:0": "80GiB", "cpu": 256 * 2**30}`` (capacities in bytes or
as sizes) or ``"auto"``: every visible GPU with its free memory, then the host's available
memory as ``"cpu"``. The workload is ``batch`` x ``seq_len`` token ids, or ``inputs=``: shapes
or tensors, positional (a list) or by keyword (a dict); :func:`check_workload` turns either
into what the planner measures, and refuses a wrong type saying what each argument takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from jupyter_metainit.core import indexed_device, parse_size
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.estimates._arguments import check_shapes
from jupyter_metainit.estimates.fit import device_budget

__all__ = ["check_workload", "is_offload", "name_value_pairs", "parse_devices", "split_inputs"]


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


def check_workload(batch: Any, seq_len: Any, inputs: Any, training: Any) -> tuple:
    """The workload as ``measure`` takes it: positional inputs, or ``(name, value)`` pairs
    for keyword ones; a wrong type is an ``ArgumentTypeError`` saying what each argument takes."""
    if not isinstance(training, bool):
        raise ArgumentTypeError(
            f"training must be True (one training step) or False (inference), not {training!r}"
        )
    _check_count(batch, "batch", "the number of samples per step")
    if isinstance(inputs, Mapping):  # keyword inputs; a shape is typed by its name when measured
        if not all(isinstance(name, str) for name in inputs):
            raise ArgumentTypeError(
                "inputs= as a dict maps the forward's argument names to shapes or tensors, "
                f"e.g. {{'input_ids': (8, 512)}}, not {inputs!r}"
            )
        check_shapes(inputs, "inputs")
        return tuple((name, _as_shape(value)) for name, value in inputs.items())
    if isinstance(inputs, (list, tuple)) and not _is_shape(inputs):
        check_shapes(inputs, "inputs")
        return tuple(inputs)
    if _is_shape(inputs) or isinstance(inputs, torch.Tensor):
        return (inputs,)
    if inputs is not None:
        raise ArgumentTypeError(
            "inputs= takes the forward's inputs: a list of shapes or tensors "
            "(inputs=[(8, 3, 224, 224)]), one shape or tensor, or a dict of keyword inputs "
            f"(inputs={{'input_ids': (8, 512)}}), not {type(inputs).__name__}"
        )
    if seq_len is None:
        raise ArgumentError(
            "place() needs the workload: seq_len= (tokens per sample, for a language model) or "
            "inputs= (the forward's inputs as shapes, e.g. inputs=[(8, 3, 224, 224)])"
        )
    _check_count(seq_len, "seq_len", "the tokens per sample")
    return ((batch, seq_len),)


def _check_count(value: Any, name: str, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} takes {what}, an int >= 1, not {value!r}")
    if value < 1:
        raise ArgumentError(f"{name}={value!r}: give {what}, an int >= 1")


def _is_shape(value: Any) -> bool:
    return (
        isinstance(value, (tuple, torch.Size))
        and len(value) > 0
        and all(isinstance(d, int) and not isinstance(d, bool) for d in value)
    )


def _as_shape(value: Any) -> Any:
    """A shape given as a list or ``torch.Size`` as a tuple (what the dry run takes as one)."""
    if isinstance(value, (list, torch.Size)) and _is_shape(tuple(value)):
        return tuple(value)
    return value


def split_inputs(inputs: tuple) -> tuple[tuple, dict]:
    """Positional inputs, and keyword ones (given as ``(name, value)`` pairs)."""
    if inputs and all(
        isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in inputs
    ):
        return (), dict(inputs)
    return inputs, {}
