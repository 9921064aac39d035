"""Repeated blocks in a dry run: the first of identical blocks measured, the others reused.

A 70B decoder runs 80 identical layers, and following every activation op by op through each
is most of a dry run's own time. A block identical to one measured before it, for what the
measurement sees, still runs (its side effects, the KV cache's update among them, are the
model's own) with the op-by-op tracking paused, and the measured block's figures are applied
to it: at each op where the measured block noted a peak, the same bytes of its own on top of
what was live before it. Identical means: the same structural fingerprint
(:mod:`~jupyter_metainit.estimates.repeats`), the same attributes in every module of the block
but its index (``layer_idx``, by the blocks' distance), the same hooks, inputs of the same
metadata that the run tracked alike, and a measured block that read no values (``.item()``,
a data-dependent shape: a mixture of experts' routing). While a reused block runs, each op
is checked against the measured block's (the same op, outputs of the same shapes and dtypes)
and at its end what it left tracked against what the measured one left (same tensors, same
references, nothing from before it dropped); any difference raises :class:`ReuseMismatch`
and the dry run starts over with every block tracked, so the figures are always those of a
run that tracks every op.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from sys import getrefcount
from typing import Any

import torch
from torch import nn

from jupyter_metainit.estimates.forward.activations import ActivationTracker
from jupyter_metainit.estimates.forward.nested import op_tensors
from jupyter_metainit.estimates.repeats import children, repeated_blocks, structural_fingerprint

__all__ = ["BlockReuse", "ReuseMismatch"]

_DEPTH = 6  # how deep a block's inputs and output are searched for tensors (cache -> layers)
_VALUE_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_PLAIN = (float, str, bytes, type(None), torch.dtype, torch.device, torch.layout)


class ReuseMismatch(Exception):
    """A reused block behaved unlike its measured twin: measure again, every block tracked."""


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def _code(fn: Any) -> Any:
    """What a hook is, closures aside (the planner's own hooks differ by the name they note)."""
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # bound method
    return getattr(fn, "__code__", type(fn))


def _same_type(a: Any, b: Any) -> bool:
    """The same class, or two module classes one factory made alike: transformers (5.25, with
    ``kernels``) keeps in each attention layer a ``Func`` module whose class a factory creates
    per layer, closing over the same function."""
    ta, tb = type(a), type(b)
    if ta is tb:
        return True
    if not (isinstance(a, nn.Module) and isinstance(b, nn.Module)):
        return False
    return (ta.__qualname__, ta.__module__) == (tb.__qualname__, tb.__module__) and _same(
        ta.forward, tb.forward, 0, _DEPTH
    )


def _same(a: Any, b: Any, shift: int, depth: int = 0) -> bool:
    """``a`` (an attribute of the measured block) and ``b`` (the same one of a block ``shift``
    positions later) make the forward do the same; unknown objects only when identical."""
    if a is b:
        return True
    if depth > _DEPTH or not _same_type(a, b):
        return False
    if isinstance(a, nn.Module):  # a module kept outside _modules (in a dict, say)
        return same_attributes(a, b, shift)
    if isinstance(a, (bool, *_PLAIN)):
        return bool(a == b)
    if isinstance(a, int):
        return a == b
    if isinstance(a, torch.Tensor):
        return _meta(a) == _meta(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(
            _same(x, y, shift, depth + 1) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, (set, frozenset)):
        return a == b
    if isinstance(a, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k], shift, depth + 1) for k in a)
    if isinstance(a, functools.partial):
        return _same((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), shift, depth)
    if isinstance(a, types.FunctionType):
        cells = [c.cell_contents for c in a.__closure__ or ()]
        other = [c.cell_contents for c in b.__closure__ or ()]
        return a.__code__ is b.__code__ and _same(cells, other, shift, depth + 1)
    return False


def _is_index(name: str) -> bool:
    """An attribute naming the block's position (``layer_idx``, ``layer_id``, ``block_index``)."""
    return name.endswith(("idx", "index", "layer_id", "block_id"))


def _compared(module: nn.Module) -> dict[str, Any]:
    """A module's attributes that can make its forward differ: not its tensors and children
    (in the fingerprint) nor this package's own records."""
    return {
        name: value
        for name, value in module.__dict__.items()
        if name not in ("_parameters", "_buffers", "_modules")
        and not name.startswith(("_jmi", "_jupyter_metainit"))
    }


def same_attributes(ref: nn.Module, block: nn.Module, shift: int) -> bool:
    """Every module of ``block`` has the attributes, hooks and mode of its twin in ``ref``."""
    for a, b in zip(ref.modules(), block.modules(), strict=True):
        mine, theirs = _compared(a), _compared(b)
        if not _same_type(a, b) or mine.keys() != theirs.keys():
            return False
        for name, value in mine.items():
            other = theirs[name]
            if value is other or (isinstance(value, dict) and not value and other == {}):
                continue
            if name.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called")):
                if [_code(v) for v in value.values()] != [_code(v) for v in other.values()]:
                    return False
            elif _is_index(name) and type(value) is int and type(other) is int:
                if other - value != shift:  # an index differs by the blocks' distance
                    return False
            elif not _same(value, other, shift):
                return False
    return True


def _signature(obj: Any, tracked: Mapping[int, int], depth: int = 0) -> Any:
    """A block's inputs as the measurement sees them: tensors' metadata and whether the run
    tracks them, plain values, other objects by identity (the same cache object)."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", *_meta(obj), id(obj) in tracked)
    if isinstance(obj, (bool, int, *_PLAIN)):
        return (type(obj), obj)
    if depth < _DEPTH and isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_signature(o, tracked, depth + 1) for o in obj))
    if depth < _DEPTH and isinstance(obj, Mapping):
        return (type(obj), tuple((k, _signature(v, tracked, depth + 1)) for k, v in obj.items()))
    return ("object", id(obj))


_Output = tuple[int, int]  # (op index in the block, position among that op's outputs)


@dataclass
class _Measured:
    """What a measured block did, op by op, apart from what was tracked before it started."""

    module: nn.Module
    position: int
    name: str
    # the ops it ran, in order, with their outputs' shapes and dtypes
    funcs: list[tuple[Any, list]] = field(default_factory=list)
    # op index -> bytes of the block's own tracked tensors when that op noted the peak
    notes: dict[int, int] = field(default_factory=dict)
    # tracked at its end, in the tracker's order: (output, its base's output or None, bytes,
    # metadata, reference count); an output is (op index, position among the op's outputs)
    kept: list[tuple[_Output, _Output | None, int, tuple, int]] = field(default_factory=list)
    usable: bool = True


@dataclass
class _Running:
    module: nn.Module
    name: str
    measured: _Measured
    reusing: bool
    ops: int = 0
    reads: int = 0
    created: dict[int, _Output] = field(default_factory=dict)  # measuring: id -> output
    wanted: dict[int, list[int]] = field(default_factory=dict)  # reusing: op -> positions
    pending: bool = True  # reusing: tracked tensors may be dying
    held: dict[_Output, torch.Tensor] = field(default_factory=dict)


def _refcounts(tensors: list[torch.Tensor]) -> list[int]:
    return [getrefcount(t) for t in tensors]


class BlockReuse:
    """Hooks on every repeated block of ``root`` that measure the first of identical ones
    and reuse its figures for the others (see the module's docstring)."""

    def __init__(self, root: nn.Module, tracker: ActivationTracker) -> None:
        self.tracker = tracker
        memo: dict[int, str] = {}
        modules = dict(root.named_modules())
        # id -> module, name, key (group, fingerprint), position among its siblings
        self.blocks: dict[int, tuple[nn.Module, str, tuple, int]] = {}
        for name, group in repeated_blocks(root).items():
            module = modules[name]
            kids = [m for _, m in children(modules[group])]
            position = next(i for i, m in enumerate(kids) if m is module)
            key = (group, structural_fingerprint(module, memo))
            self.blocks[id(module)] = (module, name, key, position)
        self.measured: dict[tuple, list[_Measured]] = {}
        self.seen: set[int] = set()
        self.running: _Running | None = None
        self.handles: list[Any] = []
        self._reads: dict[Any, bool] = {}
        self.mismatch = False

    def __enter__(self) -> BlockReuse:
        for module, *_ in self.blocks.values():
            self.handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.post, with_kwargs=True))
        self.tracker.watch = self
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.tracker.watch = None
        self.tracker.paused = False
        self.running = None

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.running is not None or id(module) in self.seen:
            return  # inside a block already, or a block run twice: tracked as any module
        self.seen.add(id(module))
        _, name, key, position = self.blocks[id(module)]
        key = (key, _signature((args, kwargs), self.tracker.index))
        twins = self.measured.setdefault(key, [])
        twin = next(
            (m for m in twins if same_attributes(m.module, module, position - m.position)), None
        )
        if twin is not None and not twin.usable:
            return  # its twin could not be reused: track this one too
        reusing = twin is not None
        if twin is None:
            twin = _Measured(module, position, name)
            twins.append(twin)
        self.running = _Running(module, name, twin, reusing)
        if reusing:
            for (op, n), *_ in twin.kept:
                self.running.wanted.setdefault(op, []).append(n)
            self.tracker.paused = True

    def saw(self, func: Any, out: Any) -> None:
        """Every op while a block runs, after it ran: what it made, whether it read values;
        in a reused block, the measured twin's peak where it noted one."""
        running = self.running
        if running is None:
            return
        reads = self._reads.get(func)
        if reads is None:
            tags = getattr(func, "tags", ())
            reads = self._reads[func] = any(tag in tags for tag in _VALUE_TAGS)
        if reads or not isinstance(out, (torch.Tensor, list, tuple, type(None))):
            running.reads += 1
        op = running.ops
        running.ops += 1
        if running.reusing:
            self._reused_op(running, func, out, op)
            return
        outputs = op_tensors(out)
        running.measured.funcs.append((func, [(t.shape, t.dtype) for t in outputs]))
        index, created = self.tracker.index, running.created
        for n, t in enumerate(outputs):
            if id(t) not in index:
                created[id(t)] = (op, n)

    def _reused_op(self, running: _Running, func: Any, out: Any, op: int) -> None:
        measured = running.measured
        outputs = op_tensors(out)
        if (
            op >= len(measured.funcs)
            or measured.funcs[op][0] is not func
            or measured.funcs[op][1] != [(t.shape, t.dtype) for t in outputs]
        ):
            running.reads += 1  # not the twin's op: a mismatch at the block's end
            return
        positions = running.wanted.get(op)
        if positions is not None:
            for n in positions:
                if n < len(outputs):
                    running.held[(op, n)] = outputs[n]
        own = measured.notes.get(op)
        if own is not None:  # the tracker would collect and note here: the same peak
            tracker = self.tracker
            if running.pending:
                # Until nothing tracked is dying, collect as the tracker would; after that,
                # what is tracked stays alive to the block's end (checked there: a tensor
                # alive at the end was alive all along).
                tracker._collect()
                running.pending = any(getrefcount(t) <= 3 for t in tracker.tensors)
            tracker.live += own
            tracker.note_peak()
            tracker.live -= own

    def noted(self) -> None:
        """After the tracker noted a peak in a measured block: the block's own share."""
        running = self.running
        if running is None or running.reusing:
            return
        tracker, created = self.tracker, running.created
        own = sum(
            n for t, n in zip(tracker.tensors, tracker.nbytes, strict=True) if id(t) in created
        )
        running.measured.notes[running.ops - 1] = own

    def post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        running = self.running
        if running is None or running.module is not module:
            return
        self.running = None
        self.tracker.paused = False
        if running.reusing:
            try:
                self._apply(running)
            except ReuseMismatch:
                self.mismatch = True  # raised again after the forward, should it be caught
                raise
        else:
            self._measure(running)

    def _measure(self, running: _Running) -> None:
        tracker, measured, created = self.tracker, running.measured, running.created
        tensors = tracker.tensors
        start = next((i for i, t in enumerate(tensors) if id(t) in created), len(tensors))
        counts = _refcounts(tensors)[start:]
        usable = not running.reads
        for i in range(start, len(tensors)):
            t, base = tensors[i], tracker.base[i]
            if id(t) not in created or (base != i and id(tensors[base]) not in created):
                usable = False  # an earlier tensor among the block's, or a view of one
                break
            base_output = None if base == i else created[id(tensors[base])]
            measured.kept.append(
                (created[id(t)], base_output, tracker.nbytes[i], _meta(t), counts[i - start])
            )
        measured.usable = usable

    def _apply(self, running: _Running) -> None:
        tracker, measured, held = self.tracker, running.measured, running.held
        if running.reads or running.ops != len(measured.funcs) or len(held) != len(measured.kept):
            raise ReuseMismatch(f"{running.name} ran unlike {measured.name}")
        start = len(tracker.tensors)
        for n, base, nbytes, meta, _ in measured.kept:
            if _meta(held[n]) != meta or id(held[n]) in tracker.index:
                raise ReuseMismatch(f"{running.name} made other tensors than {measured.name}")
            tracker.track(held[n], None if base is None else tracker.index[id(held[base])])
            if tracker.nbytes[-1] != nbytes:
                raise ReuseMismatch(f"{running.name} made other tensors than {measured.name}")
        held.clear()
        running.held = held = {}
        counts = _refcounts(tracker.tensors)
        # Once it stopped collecting, nothing from before the block may have died since.
        dying = not running.pending and min(counts[:start], default=4) <= 3
        if counts[start:] != [k[4] for k in measured.kept] or dying:
            raise ReuseMismatch(f"{running.name} keeps other tensors alive than {measured.name}")
