"""The widget's plan: *Plan…* (where each part goes, :func:`~jupyter_metainit.plan.place`), pins,
and *Materialize plan*, run on the worker thread like Materialize and Free.

The page sends the plan's options with the action (``{"action": "plan", "devices":
"cuda:0=80GiB, cuda:1=80GiB", "batch": 4, "seq_len": 4096, "training": false}``); the kernel
checks them (a mistake is a notice), plans, and publishes the plan as the kernel-owned ``plan``
trait: per device its predicted peak against its capacity, and per tree node the device it goes
to. A pin (``{"action": "pin", "names": [...], "device": "cuda:1"}``) re-plans the rest around
the pinned parts; ``unpin`` drops every pin.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from jupyter_metainit.core import (
    dtype_name,
    format_bytes,
    materialize,
    parse_dtype,
)
from jupyter_metainit.estimates.fit import device_budget
from jupyter_metainit.jupyter.magic_options import MAX_DIMENSION, input_shapes
from jupyter_metainit.jupyter.tree_widget.actions import Job
from jupyter_metainit.jupyter.tree_widget.comparing import prepare_compare
from jupyter_metainit.jupyter.tree_widget.host import WidgetHost
from jupyter_metainit.jupyter.tree_widget.save_action import prepare_save
from jupyter_metainit.jupyter.tree_widget.values import prepare_values
from jupyter_metainit.jupyter.tree_widget.wording import (
    estimate_failure_in_words,
    modules_in_words,
)
from jupyter_metainit.plan import Placement, place
from jupyter_metainit.plan.place_arguments import name_value_pairs
from jupyter_metainit.plan.precision import convention

__all__ = ["PlanState", "parse_device_text", "plan_payload", "prepare_job"]


def parse_device_text(text: Any) -> dict[str, Any] | str:
    """``"cuda:0=80GiB, cuda:1=80GiB"`` -> ``{"cuda:0": "80GiB", ...}``; ``"auto"`` stays.

    A device given without a capacity gets its free memory now (as ``fits`` measures it).
    Raises ValueError with what to type instead."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            "Type the devices to plan over, e.g. cuda:0=80GiB, cuda:1=80GiB (or auto); "
            "nothing was planned."
        )
    if text.strip().lower() == "auto":
        return "auto"
    devices: dict[str, Any] = {}
    typed = name_value_pairs(
        text, option="Devices", example="cuda:0=80GiB, cuda:1=80GiB", values_optional=True
    )
    for name, capacity in typed.items():
        if not capacity:
            try:
                capacity = device_budget(name)
            except (ValueError, RuntimeError):
                raise ValueError(
                    f"Give {name!r} a capacity, e.g. {name}=80GiB (its free memory cannot be "
                    "measured here); nothing was planned."
                ) from None
        devices[name] = capacity
    return devices


#: What the plan bar's Precision offers (None: every tensor as built); see plan.precision.
PRECISIONS = (None, "bf16", "fp32", "bf16-mixed")


def _check_precision(value: Any) -> str | None:
    if value in ("", None):
        return None
    if value not in PRECISIONS:
        raise ValueError(
            f"Refused: Precision must be as built, bf16, fp32 or bf16-mixed, not {value!r}."
        )
    return value


def _check_count(value: Any, what: str, *, optional: bool = False) -> int | None:
    if optional and (value is None or value == ""):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSION:
        raise ValueError(
            f"Refused: {what} must be a whole number from 1 to {MAX_DIMENSION:,}, not {value!r}."
        )
    return value


def _node_devices(
    placement: Placement, module: nn.Module, index: dict[str, int], n: int, names: list[str]
) -> list[int]:
    """Per tree node: the position of the one device its tensors go to; -1 when it holds no
    tensors, -2 when they go to several devices."""
    order = list(placement.capacity)
    keys = sorted(placement.device_map, key=len, reverse=True)  # the longest prefix decides
    found: list[set[str]] = [set() for _ in range(n)]
    # every name of a tied tensor: lm_head shows the device of the embedding it shares
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    by_tensor: dict[int, str] = {}
    for tensor_name, tensor in tensors:
        owner = tensor_name.rpartition(".")[0]
        # a key is a module (its tensors and its children's) or a tensor of its own (by name)
        key = next(
            (
                k
                for k in keys
                if not k or tensor_name == k or owner == k or owner.startswith(k + ".")
            ),
            None,
        )
        if key is not None:
            by_tensor.setdefault(id(tensor), placement.device_map[key])
    for tensor_name, tensor in tensors:
        device = by_tensor.get(id(tensor))
        if device is None:
            continue
        owner = tensor_name.rpartition(".")[0]
        path = owner
        while True:
            if path in index:
                found[index[path]].add(device)
            if not path:
                break
            path = path.rpartition(".")[0]
    out = []
    for node in range(n):
        devices = found[node] if names[node] in index else set()
        out.append(
            -1 if not devices else order.index(next(iter(devices))) if len(devices) == 1 else -2
        )
    return out


def plan_payload(
    placement: Placement, module: nn.Module, tree: Any, request: dict, pins: dict[str, str]
) -> dict:
    """What the page shows of a plan (the ``plan`` trait): plain JSON."""
    parts_per_device: dict[str, int] = {}
    for _, _, device, _ in placement.parts:
        parts_per_device[device] = parts_per_device.get(device, 0) + 1
    devices = [
        {
            "name": d,
            "peak": int(placement.peak[d]),
            "capacity": int(c),
            "fits": placement.peak[d] <= c,
            "parts": parts_per_device.get(d, 0),
        }
        for d, c in placement.capacity.items()
    ]
    kind = "training" if placement.training else "inference"
    return {
        "devices": devices,
        "nodes": _node_devices(placement, module, tree.index, len(tree), tree.names),
        "fits": placement.fits,
        "headline": f"{kind}, {placement.workload}: "
        + ("fits" if placement.fits else "does not fit"),
        "advice": list(placement.advice),
        "notes": list(placement.notes),
        "pins": dict(pins),
        "request": dict(request),
        "device_map": dict(placement.device_map),
    }


def prepare_job(host: WidgetHost, plans: PlanState, action: str, content: dict) -> tuple[str, Job]:
    """Check an action message other than materialize and free; the busy label and the job
    the worker thread runs (``ActionRunner``'s ``prepare``).

    Raises:
        ValueError: the message cannot be carried out (said as a notice; nothing runs).
    """
    if action == "save":
        return prepare_save(host, content)
    if action == "values":
        return prepare_values(host, content)
    if action == "compare":
        return prepare_compare(host, content)
    return plans.prepare(action, content)


class PlanState:
    """A widget's plan: the last placement, the options it was made with and the pins, and the
    jobs of *Plan…*, a pin, *Unpin* and *Materialize plan* (which read and replace them).

    Args:
        host: the widget: its model, tree and options, and its ``plan`` trait (the page's
            copy of the plan) and ``phase``.
    """

    def __init__(self, host: WidgetHost) -> None:
        self._host = host
        self.placement: Placement | None = None  # the last plan, what *Materialize plan* does
        self.request: dict | None = None  # its options, re-used by pins
        self.pins: dict[str, str] = {}

    def prepare(self, action: str, content: dict) -> tuple[str, Job]:
        """Check a plan, pin, unpin or materialize_plan message; the busy label and the job.
        Raises ValueError (said as a notice) when the message cannot be carried out."""
        if action == "materialize_plan":
            return "materialize the plan", self._materialize_plan_job()
        if action == "plan":
            request = {
                "devices": content.get("devices"),
                "batch": _check_count(content.get("batch", 1), "batch"),
                "seq_len": _check_count(content.get("seq_len"), "seq len", optional=True),
                "training": bool(content.get("training", False)),
                "inputs": input_shapes(content.get("inputs")),
                "precision": _check_precision(content.get("precision")),
            }
            if request["seq_len"] is None and request["inputs"] is None:
                raise ValueError(
                    "Enter a Seq len (tokens per sample), or for a model whose forward takes "
                    "other inputs their shapes in Inputs, batch included, e.g. (8, 3, 224, 224): "
                    "the plan measures the activations of that workload."
                )
            devices = parse_device_text(request["devices"])
            return "plan", lambda: self._plan_job(request, devices, {})
        if self.request is None:
            raise ValueError("Plan first (Plan…), then pin parts to its devices.")
        request = self.request
        devices = parse_device_text(request["devices"])
        if action == "unpin":
            return "plan", lambda: self._plan_job(request, devices, {}, drop=True)
        names = self._host._check_names(content.get("names"))
        device = content.get("device")
        if not isinstance(device, str) or device not in (
            self.placement.capacity if self.placement else {}
        ):
            raise ValueError(f"Refused: pin to one of the plan's devices, not {device!r}.")
        return "plan", lambda: self._plan_job(request, devices, dict.fromkeys(names, device))

    def _plan_job(
        self, request: dict, devices: Any, pin: dict[str, str], drop: bool = False
    ) -> tuple[str, bool]:
        # a new plan keeps the pins to devices it still has; unpin drops them all
        host = self._host
        kept = {n: d for n, d in self.pins.items() if isinstance(devices, dict) and d in devices}
        pins = {} if drop else {**kept, **pin}
        host.phase = "planning (a dry run of the workload on meta tensors)"
        try:
            placement = place(
                host.module,
                devices,
                batch=request["batch"],
                seq_len=request["seq_len"],
                inputs=request.get("inputs"),
                training=request["training"],
                precision=request.get("precision"),
                pin=pins or None,
            )
        except Exception as exc:  # a known cause is said in words, what to do included
            worded = estimate_failure_in_words(str(exc), _float_dtypes(host.module))
            if worded is None:
                raise
            raise ValueError(worded) from None
        self.placement, self.request, self.pins = placement, request, pins
        host.plan = plan_payload(placement, host.module, host._tree, request, pins)
        peaks = ", ".join(
            f"{d} {format_bytes(p)} of {format_bytes(placement.capacity[d])}"
            for d, p in placement.peak.items()
        )
        verdict = "It fits" if placement.fits else "It does NOT fit"
        pinned = (
            f" Pinned: {modules_in_words(list(pin), host.var_name)} → {next(iter(pin.values()))}."
            if pin
            else ""
        )
        advice = "" if placement.fits else " What would make it fit is under the plan bar."
        return f"Planned in {{took}}. {verdict}: {peaks}.{pinned}{advice}", not placement.fits

    def _materialize_plan_job(self) -> Job:
        placement = self.placement
        if placement is None:
            raise ValueError("Plan first (Plan…): there is no plan to materialize.")
        usable = {"cpu", *(d["name"] for d in self._host.devices)}
        missing = sorted(set(placement.device_map.values()) - usable)
        if missing:
            raise ValueError(
                f"Refused: the plan puts parts on {', '.join(missing)}, which this kernel cannot "
                "use. Plan over the devices it has (devices: auto), then materialize."
            )
        return lambda: self._materialize_plan(placement)

    def _materialize_plan(self, placement: Placement) -> str:
        # the core puts each part on its device under one progress total; a failure or Cancel
        # makes the parts it made deferred again
        # the weights in the plan's precision (what its peaks count), else the bar's dtype
        host = self._host
        planned = convention((self.request or {}).get("precision")).weights
        dtype = planned or parse_dtype(host.dtype or None)
        materialize(
            host.module,
            placement=placement,
            dtype=dtype,
            rng=host.rng,
            keep_cache=True,  # so that Free can make them deferred again
            progress=host._progress,  # the widget's hook, which every job reports to
        )
        counts = ", ".join(f"{d}: {n}" for d, n in _parts_per_device(placement).items())
        values = "" if host.rng == "exact" else " (RNG fast: not eager's values)"
        cast = f" as {dtype_name(dtype)}" if dtype is not None else ""
        why = " (the plan's precision)" if planned is not None else ""
        return f"Materialized the plan{cast}{why} in {{took}}, parts per device: {counts}{values}."


def _float_dtypes(module: nn.Module) -> str:
    """The floating dtypes of ``module``'s parameters, in words ("float32", "float32 and
    bfloat16")."""
    dtypes = sorted({dtype_name(p.dtype) for p in module.parameters() if p.is_floating_point()})
    return " and ".join(dtypes) or "without floating parameters"


def _parts_per_device(placement: Placement) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, _, device, _ in placement.parts:
        out[device] = out.get(device, 0) + 1
    return out
