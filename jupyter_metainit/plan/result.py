"""The answer of :func:`~jupyter_metainit.plan.place`: where each part goes and what it costs."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from torch import nn

from jupyter_metainit.core import format_bytes
from jupyter_metainit.plan.apply import materialize_parts
from jupyter_metainit.plan.partition import Costs

__all__ = ["Placement"]

_COST_COLUMNS = ("weights", "cache", "transient", "saved", "grads", "states")


@dataclass
class Placement:
    """A plan: ``device_map`` (module name -> device, for ``accelerate.dispatch_model`` and
    ``from_pretrained(device_map=...)``), ``peak`` (predicted peak bytes per device),
    ``capacity``, ``fits``; when it does not fit, ``over`` (bytes beyond capacity per device)
    and ``advice`` (what would make it fit); ``table`` per device and per part.

    With ``strategy="fsdp"``: ``units`` (the modules to ``fully_shard``, innermost first, the
    root last) and ``peak`` per rank (every rank alike).
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
    def from_device_map(cls, device_map: dict[str, Any]) -> Placement:
        """A placement of an existing device map (accelerate's, a hand-written one), to
        materialize with ``materialize(model, placement=...)``; it predicts nothing."""
        return cls(device_map=dict(device_map), peak={}, capacity={}, parts=[],
                   strategy="given")  # fmt: skip

    def materialize_parts(self, model: nn.Module, **options: Any) -> nn.Module:
        """What ``materialize(model, placement=self)`` runs: each part onto its device."""
        if self.strategy == "fsdp":
            raise ValueError(
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
        return {d: self.peak[d] - self.capacity[d] for d in self.peak
                if self.peak[d] > self.capacity[d]}  # fmt: skip

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
            rows.append({"device": device, "part": "(peak)", "type": "", "peak": self.peak[device],
                         "capacity": self.capacity[device],
                         "use": self.peak[device] / self.capacity[device]})  # fmt: skip
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
            lines.append("  first part per device: " + ", ".join(
                f"{d}: {n or 'the whole model'}" for d, n in first.items()))  # fmt: skip
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
