"""Live activation bytes and per-module outputs of a dry run's forward pass.

:class:`ActivationTracker` follows every tensor derived from the inputs op by op (a peak per
module); :class:`ModuleStack` knows which modules are running and what each returned.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from sys import getrefcount
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from jupyter_metainit.estimates.forward.answers import shapes_depend_on_values
from jupyter_metainit.estimates.forward.dtype_checks import (
    EagerDtypeChecks,
    run_past_cuda_only_meta_checks,
)
from jupyter_metainit.estimates.forward.nested import op_tensors, tensor_bytes, tensors_in

__all__ = ["ActivationTracker", "ModuleStack"]


# Ops whose output shares its input's memory although their schema does not say so.
_ALIASING_OPS = frozenset({torch.ops.aten._unsafe_view.default})


class ActivationTracker(TorchDispatchMode):
    """Follows activations (tensors derived from the inputs, and every tensor the forward makes
    otherwise: masks, positions, casts of weights) through every op.

    Live bytes rise with each new activation and fall when Python drops the last reference
    (checked with ``sys.getrefcount``; tensors are held strongly only during the run, never
    through weakrefs). Views cost nothing and keep their base alive.
    """

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.tensors: list[torch.Tensor] = []  # tracked activations (strong refs, run only)
        self.nbytes: list[int] = []
        self.base: list[int] = []  # index of the tensor owning the bytes (itself for non-views)
        self.index: dict[int, int] = {}  # id(tensor) -> position, valid while tracked
        self.live = 0
        self.peak = 0
        self.module_peak: dict[str, int] = {}
        self.dtype_checks = EagerDtypeChecks()
        # A repeated block's reuse (forward/reuse.py) sees every op; while it pauses the
        # tracking, ops only run (a block identical to a measured one).
        self.watch: Any = None
        self.paused = False
        # Notes the shapes of value-dependent ops' outputs (forward/answers.py), if set.
        self.answers: Any = None

    def track(self, t: torch.Tensor, base: int | None = None) -> None:
        i = len(self.tensors)
        self.tensors.append(t)
        self.index[id(t)] = i
        if base is None:
            self.base.append(i)
            size = tensor_bytes(t)
        else:
            self.base.append(self.base[base])
            size = 0
        self.nbytes.append(size)
        self.live += size

    def _collect(self) -> None:
        """Drop activations nobody else references (3 = our list, the loop name, the call arg)."""
        tensors = self.tensors
        alive = [getrefcount(t) > 3 for t in tensors]
        if False not in alive:
            return
        base = self.base
        for i, b in enumerate(base):
            if b != i and alive[i]:
                alive[b] = True
        keep = [i for i, ok in enumerate(alive) if ok]
        remap = {old: new for new, old in enumerate(keep)}
        nbytes = self.nbytes
        self.live -= sum(n for n, ok in zip(nbytes, alive, strict=True) if not ok)
        self.tensors = [tensors[i] for i in keep]
        self.nbytes = [nbytes[i] for i in keep]
        self.base = [remap[base[i]] for i in keep]
        self.index = {id(t): n for n, t in enumerate(self.tensors)}

    def note_peak(self) -> None:
        live = self.live
        if live > self.peak:
            self.peak = live
        peaks = self.module_peak
        for name in self.stack:
            if live > peaks.get(name, -1):
                peaks[name] = live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        inputs = op_tensors(args, kwargs)  # holding them keeps nothing alive: args do
        self.dtype_checks.check(func, args, kwargs, inputs)
        out = run_past_cuda_only_meta_checks(func, args, kwargs, inputs)
        if self.answers is not None and shapes_depend_on_values(func):
            self.answers.note_shapes(func, out)
        if self.watch is not None:
            self.watch.saw(func, out)
            if self.paused:
                return out
        index = self.index
        aliasing = func.is_view or func in _ALIASING_OPS
        if any(id(a) in index for a in inputs):
            self._collect()
            index = self.index
            sources = [index[id(a)] for a in inputs if id(a) in index]
            view_of = sources[0] if aliasing else None
            made = [t for t in op_tensors(out) if id(t) not in index]
        elif aliasing:
            return out  # a view of a weight, a buffer or a constant: no memory of its own
        else:
            # Made from no activation (a mask, position ids, a weight cast): new memory too.
            made = op_tensors(out)
            if not made:
                return out
            self._collect()
            index = self.index
            view_of = None
        ids = {id(a) for a in inputs}
        for t in made:
            if id(t) not in ids:  # an in-place op returns its input: no new memory
                self.track(t, view_of)
        self.note_peak()
        if self.watch is not None:
            self.watch.noted()
        return out


class ModuleStack:
    """Qualified names of the modules currently running, plus per-module outputs."""

    def __init__(self, root: nn.Module) -> None:
        self.names = {id(m): n for n, m in root.named_modules()}
        self.stack: list[str] = []
        self.shapes: dict[str, Any] = {}
        self.out_bytes: dict[str, int] = {}
        self.handles: list[Any] = []

    def pre(self, mod: nn.Module, args: Any) -> None:
        name = self.names.get(id(mod))
        if name is not None:
            self.stack.append(name)

    def post(self, mod: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(mod))
        if name is None:
            return
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        elif name in self.stack:
            del self.stack[len(self.stack) - 1 - self.stack[::-1].index(name)]
        tensors = list(tensors_in(output))
        shapes = [tuple(t.shape) for t in tensors]
        if name not in self.shapes:
            self.shapes[name] = shapes[0] if len(shapes) == 1 else shapes
        self.out_bytes[name] = self.out_bytes.get(name, 0) + sum(tensor_bytes(t) for t in tensors)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        pre = nn.modules.module.register_module_forward_pre_hook(self.pre)
        post = nn.modules.module.register_module_forward_hook(self.post)
        try:
            yield
        finally:
            pre.remove()
            post.remove()
