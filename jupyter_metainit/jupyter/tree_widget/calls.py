"""The widget's plan and save actions called from Python (``w.place(...)``, ``w.pin(...)``,
``w.materialize_plan()``, ``w.save(path)``): the same messages the page sends, so code and
clicks go through the same checks and the same worker thread."""

from __future__ import annotations

from typing import Any

__all__ = ["PlanningCalls"]


class PlanningCalls:
    """The plan and save actions from Python, as the page sends them (mixin of the widget)."""

    handle_action: Any
    wait: Any
    selected: Any

    def place(
        self,
        devices: str,
        *,
        batch: int = 1,
        seq_len: int | None = None,
        training: bool = False,
        inputs: str | None = None,
        precision: str | None = None,
        wait: bool = True,
    ) -> None:
        """Plan where each part goes (what *Plan…* does): ``devices`` as typed in the plan bar,
        ``"cuda:0=80GiB, cuda:1=80GiB"`` or ``"auto"``; ``inputs`` as its Inputs field,
        ``"(8, 3, 224, 224)"``, instead of ``seq_len``; ``precision`` as its Precision
        (``None``: as built, ``"bf16"``, ``"fp32"``, ``"bf16-mixed"``). The tree then shows
        the plan, and *Materialize plan* materializes the weights in that precision."""
        self.handle_action(
            {
                "action": "plan",
                "devices": devices,
                "batch": batch,
                "seq_len": seq_len,
                "training": training,
                "inputs": inputs,
                "precision": precision,
            }
        )
        if wait:
            self.wait()

    def pin(self, device: str, *, wait: bool = True) -> None:
        """Pin the selected subtrees to ``device`` and plan the rest around them."""
        self.handle_action({"action": "pin", "names": self.selected, "device": device})
        if wait:
            self.wait()

    def materialize_plan(self, *, wait: bool = True) -> None:
        """Materialize every part on the device the plan gives it (*Materialize plan*)."""
        self.handle_action({"action": "materialize_plan"})
        if wait:
            self.wait()

    def save(self, path: str, *, format: str = "safetensors", wait: bool = True) -> None:
        """Save the selected subtree (the whole model if none is selected) to ``path`` with
        :func:`jupyter_metainit.save`, as *Save…* does."""
        self.handle_action(
            {"action": "save", "path": path, "format": format, "names": self.selected}
        )
        if wait:
            self.wait()

    def measure_values(self, *, wait: bool = True) -> None:
        """Compute the statistics of the selected subtrees' values (the whole model if none is
        selected) with :func:`jupyter_metainit.stats`, as *Values* does; the model is not
        changed. The tree then shows them (``w.values`` holds them)."""
        self.handle_action({"action": "values", "names": self.selected})
        if wait:
            self.wait()

    def compare_with(self, other: str, *, wait: bool = True) -> None:
        """Compare the selected subtrees (the whole model if none is selected) with ``other``,
        a checkpoint path or the name of a model or state dict in the notebook, as
        *Compare with…* does (``w.comparison`` holds the result); neither side changes."""
        self.handle_action({"action": "compare", "other": other, "names": self.selected})
        if wait:
            self.wait()
