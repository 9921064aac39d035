"""The answer of :func:`~jupyter_metainit.plan.place`: where each part goes and what it costs."""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from jupyter_metainit.core import format_bytes
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.plan.apply import materialize_parts
from jupyter_metainit.plan.partition import Costs

__all__ = ["Placement"]

_COST_COLUMNS = ("weights", "cache", "transient", "saved", "grads", "states")


@dataclass
class Placement:
    """Where each part of a model goes and what every device will hold: what
    :func:`~jupyter_metainit.place` returns.

    Use ``device_map`` with ``accelerate.dispatch_model`` or ``from_pretrained(device_map=...)``,
    or the plan itself with ``materialize(model, placement=plan)``; read ``fits``, ``over``,
    ``advice`` and ``table`` to see whether it fits and why. In a notebook it shows a bar per
    device.

    Attributes:
        device_map: module name -> device, in pipeline order (a module's own tensors beside
            its children by their names).
        peak: the predicted peak bytes per device (per rank with ``strategy="fsdp"``, every
            rank alike).
        capacity: the bytes each device was given.
        parts: ``(name, type, device, costs)`` of every part, in the order the forward runs
            them.
        strategy: ``"pipeline"``, ``"fsdp"``, or ``"given"`` (from :meth:`from_device_map`).
        training: whether a training step was planned.
        workload: the workload in words (``"batch 8, seq_len 4096"``).
        precision: the precision in words.
        advice: what would make it fit, when it does not.
        notes: what the plan could not model, in words.
        units: with ``strategy="fsdp"``: the modules to ``fully_shard``, innermost first, the
            root last.
        world_size: with ``strategy="fsdp"``: the number of ranks.
        seconds: the planning time, the measurement included.
        measure_seconds: the time of the dry run (and meta forwards), 0 when reused.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import meta_init, place
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
        >>> plan = place(model, {"cuda:0": "2MiB", "cuda:1": "2MiB"}, inputs=[(8, 1024)])
        >>> plan.fits, sorted(plan.over)  # each device would need 2.10 MiB more
        (False, ['cuda:0', 'cuda:1'])
        >>> plan.advice[0]
        "no number of 2.00 MiB devices holds it as a pipeline (part '...' alone is too large):
        use strategy='fsdp'"
    """

    device_map: dict[str, str]
    peak: dict[str, int]
    capacity: dict[str, int]
    # (name, type, device, costs); a module's own tensors beside its children are one part,
    # named by their names ("cls_token, pos_embed"), of type "tensors of <its class>"
    parts: list[tuple[str, str, str, Costs]]
    strategy: str = "pipeline"
    training: bool = False
    workload: str = ""
    precision: str = ""
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    units: list[str] = field(default_factory=list)
    world_size: int | None = None
    seconds: float = 0.0  # planning, measurement included
    measure_seconds: float = 0.0  # the dry run (and meta forwards), 0 when reused

    @classmethod
    def from_device_map(cls, device_map: Mapping[str, str | int | torch.device]) -> Placement:
        """A placement of an existing device map (accelerate's, a hand-written one), to
        materialize with ``materialize(model, placement=...)``; it predicts nothing.

        Use it when the device map comes from elsewhere (``infer_auto_device_map``, a
        checkpoint's ``hf_device_map``, your own) and you want each part materialized onto its
        device in one call, with one progress total.

        Args:
            device_map: module name -> device (``""`` for the whole model).

        Returns:
            A placement with that device map and no predictions (``strategy="given"``).

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import is_deferred, materialize, meta_init
            >>> from jupyter_metainit.plan import Placement
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            >>> plan = Placement.from_device_map({"0": "cpu", "1": "cpu"})
            >>> _ = materialize(model, placement=plan)
            >>> is_deferred(model)
            False
        """
        return cls(device_map=dict(device_map), peak={}, capacity={}, parts=[], strategy="given")

    def materialize_parts(self, model: nn.Module, **options: Any) -> nn.Module:
        """Materialize each part of ``model`` onto its device: what
        ``materialize(model, placement=self)`` runs.

        Prefer ``materialize(model, placement=plan, ...)``; this is the plan's side of it.

        Args:
            model: the model the plan was made for.
            **options: ``materialize``'s keyword arguments (``dtype``, ``rng``,
                ``keep_cache``, ``progress``, ``checkpoint``, ``missing``, ``root``).

        Returns:
            ``model``, each planned part real on its device.

        Raises:
            ArgumentError: the plan is an FSDP plan (use
                ``jupyter_metainit.distributed.materialize_sharded`` on every rank), or its
                device map names modules ``model`` does not have.
            MaterializationError: as ``materialize`` raises; nothing changed.

        Examples:
            >>> import torch
            >>> from torch import nn
            >>> from jupyter_metainit import is_deferred, meta_init
            >>> from jupyter_metainit.plan import Placement
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            >>> plan = Placement.from_device_map({"": "cpu"})
            >>> plan.materialize_parts(model, dtype=torch.bfloat16)
            Sequential(
              (0): Linear(in_features=4, out_features=4, bias=True)
              (1): Linear(in_features=4, out_features=4, bias=True)
            )
            >>> model[1].weight.dtype, is_deferred(model)
            (torch.bfloat16, False)
        """
        if self.strategy == "fsdp":
            raise ArgumentError(
                "an FSDP plan shards every part over the ranks: on every rank, "
                "jupyter_metainit.distributed.materialize_sharded(model, mesh, placement=plan)"
            )
        return materialize_parts(self.device_map, model, **options)

    @property
    def fits(self) -> bool:
        """Every device's predicted peak is within its capacity."""
        return all(self.peak[d] <= self.capacity[d] for d in self.peak)

    @property
    def over(self) -> dict[str, int]:
        """Bytes beyond capacity, per device that does not fit."""
        return {
            d: self.peak[d] - self.capacity[d] for d in self.peak if self.peak[d] > self.capacity[d]
        }

    @property
    def balance(self) -> float:
        """Most loaded device / mean load (peak / capacity) over all the devices given: 1.0 is
        perfectly even; a device left empty counts as unloaded."""
        loads = [self.peak[d] / self.capacity[d] for d in self.peak]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    @property
    def table(self) -> pd.DataFrame:
        """One row per part (index: device, part) with its costs in bytes, and per device a
        ``(peak)`` row with the predicted peak against ``capacity``."""
        rows = []
        for device in self.peak:
            rows.append(
                {
                    "device": device,
                    "part": "(peak)",
                    "type": "",
                    "peak": self.peak[device],
                    "capacity": self.capacity[device],
                    "use": self.peak[device] / self.capacity[device],
                }
            )
            for name, kind, where, costs in self.parts:
                if where == device:
                    row = {"device": device, "part": name or "(root)", "type": kind}
                    row.update({c: getattr(costs, c) for c in _COST_COLUMNS})
                    rows.append(row)
        frame = pd.DataFrame(rows).set_index(["device", "part"])
        keep = [c for c in _COST_COLUMNS if c in frame and frame[c].fillna(0).any()]
        return frame[["type", *keep, "peak", "capacity", "use"]]

    def _headline(self) -> str:
        verdict = "fits" if self.fits else "DOES NOT FIT"
        kind = "training" if self.training else "inference"
        ranks = f" x {self.world_size} ranks" if self.world_size else ""
        return (
            f"Placement ({self.strategy}{ranks}, {kind}, {self.workload}, precision "
            f"{self.precision}): {verdict}"
        )

    def _device_lines(self) -> list[str]:
        lines = []
        for device, peak in self.peak.items():
            capacity = self.capacity[device]
            n = sum(1 for _, _, where, _ in self.parts if where == device)
            bar = "#" * min(20, round(20 * peak / capacity)) if capacity else ""
            flag = "" if peak <= capacity else f"  over by {format_bytes(peak - capacity)}"
            lines.append(
                f"  {device:>8} [{bar:<20}] {format_bytes(peak):>10} of "
                f"{format_bytes(capacity):>10} ({peak / capacity:4.0%}), {n} parts{flag}"
            )
        return lines

    def __repr__(self) -> str:
        lines = [self._headline(), *self._device_lines()]
        if self.units:
            lines.append(f"  fully_shard units: {len(self.units)} ({_short(self.units)})")
        else:
            first = {}
            for name, _, device, _ in self.parts:
                first.setdefault(device, name)
            lines.append(
                "  first part per device: "
                + ", ".join(f"{d}: {n or 'the whole model'}" for d, n in first.items())
            )
        lines += [f"  to fit: {a}" for a in self.advice]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{html.escape(d)}</td><td style='width:200px'><div style='background:"
            f"{'#d9534f' if p > self.capacity[d] else '#5b9bd5'};height:10px;width:"
            f"{min(100, 100 * p / self.capacity[d]):.0f}%'></div></td><td>"
            f"{html.escape(format_bytes(p))} / {html.escape(format_bytes(self.capacity[d]))}"
            "</td></tr>"
            for d, p in self.peak.items()
        )
        extra = "".join(f"<li>{html.escape(a)}</li>" for a in self.advice + self.notes)
        return f"<p><b>{html.escape(self._headline())}</b></p><table>{body}</table>" + (
            f"<ul>{extra}</ul>" if extra else ""
        )


def _short(names: list[str]) -> str:
    shown = [n or "the whole model" for n in names]
    return ", ".join(shown[:3]) + (f", ... {shown[-1]}" if len(shown) > 3 else "")
