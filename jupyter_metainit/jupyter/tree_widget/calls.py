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
        """Plan where each part goes, as *Plan…* does: :func:`~jupyter_metainit.place` on the
        worker thread; the tree then shows a device per part and a bar per device.

        Args:
            devices: as typed in the plan bar: ``"cuda:0=80GiB, cuda:1=80GiB"`` or ``"auto"``.
            batch: samples per step.
            seq_len: tokens per sample.
            training: plan a training step.
            inputs: as the Inputs field, ``"(8, 3, 224, 224)"``, instead of ``seq_len``.
            precision: as the Precision field (``None``: as built, ``"bf16"``, ``"fp32"``,
                ``"bf16-mixed"``); *Materialize plan* then materializes the weights in it.
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
            >>> w = explore(model)
            >>> w.place("cuda:0=6MiB, cuda:1=6MiB", inputs="(8, 1024)")
            >>> w.status
            'Planned in ... It fits: cuda:0 4.10 MiB of 6.00 MiB, cuda:1 4.10 MiB of 6.00 MiB.'
            >>> w.plan["device_map"]
            {'0': 'cuda:0', '1': 'cuda:0', '2': 'cuda:1'}
        """
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
        """Pin the selected subtrees to ``device`` and plan the rest around them, as a row's
        *Pin* does (after :meth:`place`).

        Args:
            device: one of the plan's devices.
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
            >>> w = explore(model)
            >>> w.place("cuda:0=6MiB, cuda:1=6MiB", inputs="(8, 1024)")
            >>> w.selected = ["0"]
            >>> w.pin("cuda:1")
            >>> w.status
            'Planned in ... Pinned: model[0] → cuda:1.'
        """
        self.handle_action({"action": "pin", "names": self.selected, "device": device})
        if wait:
            self.wait()

    def materialize_plan(self, *, wait: bool = True) -> None:
        """Materialize every part on the device the plan gives it, as *Materialize plan* does
        (after :meth:`place`).

        Args:
            wait: block until it is done.

        Examples:
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> w.place("cpu=1GiB", inputs="(8, 64)")
            >>> w.materialize_plan()
            >>> is_deferred(model), model[1].weight.device
            (False, device(type='cpu'))
        """
        self.handle_action({"action": "materialize_plan"})
        if wait:
            self.wait()

    def save(self, path: str, *, format: str = "safetensors", wait: bool = True) -> None:
        """Save the selected subtree (the whole model if none is selected) to ``path`` with
        :func:`~jupyter_metainit.save`, as *Save…* does, on the worker thread with progress.

        Args:
            path: the directory to write (``~`` expands).
            format: ``"safetensors"`` or ``"dcp"``.
            wait: block until it is done.

        Examples:
            >>> import os, tempfile
            >>> from torch import nn
            >>> from jupyter_metainit import explore, is_deferred, meta_init
            >>> with meta_init():
            ...     model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
            >>> w = explore(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     w.save(directory)
            ...     os.listdir(directory)
            ['model.safetensors']
            >>> is_deferred(model)  # saved without materializing
            True
        """
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
