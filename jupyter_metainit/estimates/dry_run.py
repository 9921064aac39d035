"""Run a model's forward pass on deferred inputs: shapes, activations and FLOPs, no memory.

Use :func:`dry_run` to learn what a forward pass would produce and cost before allocating
anything, and to infer the shapes of lazy modules (``nn.LazyLinear`` ...) on a deferred model.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

from jupyter_metainit.core import tensor_state
from jupyter_metainit.estimates._arguments import parse_dtype, require_module
from jupyter_metainit.estimates.memory import DRY_RUN_ATTR, MemoryTable, memory_table

__all__ = ["dry_run"]


def _cpu_flash_sdpa_flops(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """FLOPs of the CPU flash-attention kernel, which FlopCounterMode does not map (torch 2.13).

    Grouped-query attention (fewer key/value heads) counts as its heads repeated, which is the
    work the kernel does; older ``sdpa_flop_count`` (torch 2.11) refuses unequal head counts.
    """
    heads = query_shape[1]
    key_shape = (key_shape[0], heads, *key_shape[2:])
    value_shape = (value_shape[0], heads, *value_shape[2:])
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _extra_flop_formulas() -> dict[Any, Any]:
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op in flop_registry:
        return {}
    return {op: _cpu_flash_sdpa_flops}


def _track_forward_only(flops: FlopCounterMode) -> FlopCounterMode:
    """Keep ``flops``' module tracker off autograd: the dry run has no backward.

    Its hooks register gradient hooks on a module's inputs and outputs that require grad;
    on deferred tensors (no autograd graph) that fails whenever a module is called on a
    parameter (``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``, a learned
    query fed to a Linear). The same names are pushed and popped without them.
    """
    tracker = getattr(flops, "mod_tracker", None)
    name_of = getattr(tracker, "_get_mod_name", None)
    push = getattr(tracker, "_get_append_fn", None)
    pop = getattr(tracker, "_get_pop_fn", None)
    if name_of is None or push is None or pop is None:  # another torch: keep its own hooks
        return flops

    def pre_hook(mod: nn.Module, args: Any) -> None:
        push(name_of(mod), False)()

    def post_hook(mod: nn.Module, args: Any, output: Any) -> None:
        pop(name_of(mod), False)()

    # ModuleTracker.__enter__ registers these instance attributes as its global hooks.
    tracker._fw_pre_hook = pre_hook  # type: ignore[union-attr]
    tracker._fw_post_hook = post_hook  # type: ignore[union-attr]
    return flops


def _core_meta_init() -> Callable[..., Any] | None:
    try:
        from jupyter_metainit.core import meta_init
    except ImportError:
        return None
    return meta_init


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


def _nested(obj: Any, kind: type) -> Iterator[Any]:
    """Instances of ``kind`` in nested lists, tuples and mappings (transformers' ModelOutput)."""
    if isinstance(obj, kind):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _nested(item, kind)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _nested(item, kind)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in nested outputs (tuples, lists, dicts, transformers' ModelOutput)."""
    return _nested(obj, torch.Tensor)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _is_shape(obj: Any) -> bool:
    return (
        isinstance(obj, (torch.Size, tuple, list))
        and all(isinstance(d, int) and not isinstance(d, bool) for d in obj)
        and len(obj) > 0
    )


class _EagerDtypeChecks:
    """Refuse the dtype combinations eager refuses, which meta kernels let through.

    Meta kernels check shapes but many skip the dtype checks of the real ones (``mm``,
    ``addmm``, ``conv``, ``layer_norm``, ``index_select`` ... accept int64 against float32).
    Each ATen op is probed once per signature (its tensor arguments' dtypes and devices) with
    the real CPU kernel on zero-filled tensors of the same dtypes: the real shapes when they are
    small, else every dimension 1. A probe error about dtypes is eager's error and is raised;
    any other probe error (a shape the shrunken probe cannot take) says nothing and is ignored.
    Random ops (their draws) and non-ATen ops (collectives) are never probed.
    """

    _SMALL = 1 << 16  # elements: probe with the real shapes below this
    # torch's dtype checks say one of these ("not implemented for 'Long'": a kernel's dtypes)
    _DTYPE_WORDS = ("dtype", "scalar type", "datatype", "scalartype", "not implemented for '")

    # Shared by every dry run (a probe's answer depends on the signature only); bounded.
    refused: ClassVar[dict[Any, tuple[type[BaseException], str] | None]] = {}
    _MAX_SIGNATURES = 1 << 14

    @staticmethod
    def _probed(func: Any) -> bool:
        return (
            func.namespace == "aten"
            and torch.Tag.nondeterministic_seeded not in func.tags
            and "generator" not in func._schema.arguments.__repr__()
        )

    def check(self, func: Any, args: tuple, kwargs: dict) -> None:
        tensors = list(_tensors((args, kwargs)))
        if not tensors or any(is_lazy(t) for t in tensors):  # shapeless until inferred
            return
        # Metadata reads without each tensor subclass's __torch_function__ (every op: cheap).
        with torch._C.DisableTorchFunctionSubclass():
            small = sum(t.numel() for t in tensors) <= self._SMALL
            key = (
                func,
                small,
                *((t.dtype, t.device.type, t.shape if small else t.dim()) for t in tensors),
            )
        if key not in self.refused:
            if len(self.refused) >= self._MAX_SIGNATURES:
                self.refused.clear()
            self.refused[key] = (
                self._probe(func, args, kwargs, small) if self._probed(func) else None
            )
        refused = self.refused[key]
        if refused is not None:
            error_type, message = refused
            raise error_type(message)

    def _probe(
        self, func: Any, args: tuple, kwargs: dict, small: bool
    ) -> tuple[type[BaseException], str] | None:
        from jupyter_metainit.core.runtime.plain import plain

        def probe_on(device: str) -> Callable[[torch.Tensor], torch.Tensor]:
            def probe_tensor(t: torch.Tensor) -> torch.Tensor:
                shape = t.shape if small else (1,) * t.dim()
                return torch.zeros(shape, dtype=t.dtype, device=device)

            return probe_tensor

        def run(device: str) -> Any:
            to_probe = probe_on(device)
            with plain():
                return func(*_map_tensors(args, to_probe), **_map_tensors(kwargs, to_probe))

        with contextlib.suppress(Exception):
            # On the meta device first: an output too large to compute cheaply (`new_zeros`
            # of a big size, `repeat`) is not probed on the CPU.
            if sum(t.numel() for t in _tensors(run("meta"))) > self._SMALL:
                return None
        try:
            run("cpu")
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as e:
            message = str(e).splitlines()[0] if str(e) else ""
            lowered = message.lower()
            if not any(word in lowered for word in self._DTYPE_WORDS):
                return None
            # "not implemented for 'Half'" is a fact about the CPU kernel; a tensor recorded
            # for another device (or a meta model, headed anywhere) may have the kernel there.
            elsewhere = any(t.device.type != "cpu" for t in _tensors((args, kwargs)))
            if "not implemented for" in lowered and elsewhere:
                return None
            return type(e), message
        except Exception:
            return None
        return None


# Ops whose output shares its input's memory although their schema does not say so.
_ALIASING_OPS = frozenset({torch.ops.aten._unsafe_view.default})


class _ActivationTracker(TorchDispatchMode):
    """Follows activations (tensors derived from the inputs) through every op.

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
        self.dtype_checks = _EagerDtypeChecks()

    def track(self, t: torch.Tensor, base: int | None = None) -> None:
        i = len(self.tensors)
        self.tensors.append(t)
        self.index[id(t)] = i
        if base is None:
            self.base.append(i)
            size = _tensor_bytes(t)
        else:
            self.base.append(self.base[base])
            size = 0
        self.nbytes.append(size)
        self.live += size

    def _collect(self) -> None:
        """Drop activations nobody else references (3 = our list, the loop name, the call arg)."""
        tensors = self.tensors
        alive = [sys.getrefcount(t) > 3 for t in tensors]
        for i, ok in enumerate(alive):
            if ok and self.base[i] != i:
                alive[self.base[i]] = True
        if all(alive):
            return
        keep = [i for i, ok in enumerate(alive) if ok]
        remap = {old: new for new, old in enumerate(keep)}
        self.live -= sum(self.nbytes[i] for i, ok in enumerate(alive) if not ok)
        self.tensors = [tensors[i] for i in keep]
        self.nbytes = [self.nbytes[i] for i in keep]
        self.base = [remap[self.base[i]] for i in keep]
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
        self.dtype_checks.check(func, args, kwargs)
        out = func(*args, **kwargs)
        index = self.index
        sources = [index[id(a)] for a in _tensors((args, kwargs)) if id(a) in index]
        if sources:
            self._collect()
            index = self.index
            sources = [index[id(a)] for a in _tensors((args, kwargs)) if id(a) in index]
            aliases = func.is_view or func in _ALIASING_OPS
            view_of = sources[0] if aliases and sources else None
            for t in _tensors(out):
                if id(t) not in index:
                    self.track(t, view_of)
            self.note_peak()
        return out


class _ModuleStack:
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
        tensors = list(_tensors(output))
        shapes = [tuple(t.shape) for t in tensors]
        if name not in self.shapes:
            self.shapes[name] = shapes[0] if len(shapes) == 1 else shapes
        self.out_bytes[name] = self.out_bytes.get(name, 0) + sum(_tensor_bytes(t) for t in tensors)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        pre = nn.modules.module.register_module_forward_pre_hook(self.pre)
        post = nn.modules.module.register_module_forward_hook(self.post)
        try:
            yield
        finally:
            pre.remove()
            post.remove()


def _default_input_dtype(module: nn.Module) -> torch.dtype:
    """Token-id models (first leaf with parameters is an Embedding) take int64 inputs."""
    for m in module.modules():
        if next(iter(m._modules.values()), None) is None and m._parameters:
            return torch.long if isinstance(m, nn.Embedding) else torch.get_default_dtype()
    return torch.get_default_dtype()


def _uses_meta(module: nn.Module) -> bool:
    """True for models built on the ``meta`` device (uninitialized lazy tensors do not count)."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta and not is_lazy(t) for t in tensors)


_PLAIN_DICTS = (dict, OrderedDict)


def _inferred_in_meta_init(t: Any) -> bool:
    """An uninitialized lazy tensor made inside ``meta_init``: a dry run may give it its shape.

    ``core._lazy`` marks those with the device their deferred replacement reports.
    """
    return isinstance(t, torch.Tensor) and is_lazy(t) and "_jmi_device" in t.__dict__


def _stand_in(t: torch.Tensor, on_meta: bool) -> torch.Tensor:
    """A tensor like ``t`` that the run may read and write instead of ``t``.

    Inside ``meta_init`` a deferred clone: its values are ``t``'s if the forward needs them,
    and a write lands on the clone only. On the meta path an empty meta tensor.
    """
    if is_lazy(t):
        # A fresh uninitialized tensor of the same kind: shape inference fills it in place.
        return type(t)(requires_grad=t.requires_grad, device=t.device, dtype=t.dtype)
    with torch.no_grad():
        if on_meta:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        else:
            new = t.detach().clone()
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    elif t.requires_grad:
        new.requires_grad_(True)
    # What code reads off the tensor object in forward (`weight.quant_state`, a user's tag);
    # underscore names are bookkeeping, the core's own included, and stay with ``t``.
    for name, value in getattr(t, "__dict__", {}).items():
        if not name.startswith("_"):
            setattr(new, name, value)
    return new


def _generators(obj: Any) -> Iterator[torch.Generator]:
    """Generators in nested inputs (lists, tuples, dicts)."""
    return _nested(obj, torch.Generator)


class _ModelGuard:
    """Leaves a model as it was found around a forward run for an estimate.

    Every tensor the model holds (parameters, buffers, tensor attributes, tied ones once) is
    swapped for a stand-in while the forward runs, so in-place writes (BatchNorm's running
    stats, counters, caches) never reach the model's tensors, real or deferred (a write on a
    deferred tensor would be recorded and change what it materializes to). Afterwards every
    module gets back its attributes, tensors and train/eval mode, and the random generators
    (CPU, CUDA, generators kept on modules or passed in) their states: Dropout in the run
    draws nothing the user sees. Lazy modules built inside ``meta_init`` keep their inferred
    (deferred) parameters: giving them a shape is what a dry run is for. Any other lazy module
    (a real model's) runs on fresh uninitialized stand-ins and stays lazy, class included.
    """

    def __init__(self, root: nn.Module, inputs: Any = ()) -> None:
        self.modules = list(root.modules())
        self.training = [m.training for m in self.modules]
        self.classes = [type(m) for m in self.modules]
        self.lazy = [
            any(
                _inferred_in_meta_init(t)
                for t in (*m._parameters.values(), *m._buffers.values())
                if t is not None
            )
            for m in self.modules
        ]
        self.attributes = [dict(m.__dict__) for m in self.modules]
        # Contents of every dict a module holds (hook tables included: shape inference
        # removes a lazy module's hooks from them in place; RemovableHandles point at them).
        self.dict_contents = [
            {name: dict(v) for name, v in m.__dict__.items() if type(v) in _PLAIN_DICTS}
            for m in self.modules
        ]
        self.parameters = [dict(m._parameters) for m in self.modules]
        self.buffers = [dict(m._buffers) for m in self.modules]
        self.transient = [set(m._non_persistent_buffers_set) for m in self.modules]
        generators = {id(torch.default_generator): torch.default_generator}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for g in torch.cuda.default_generators:
                generators[id(g)] = g
        for m in self.modules:
            for v in m.__dict__.values():
                if isinstance(v, torch.Generator):
                    generators[id(v)] = v
        for g in _generators(inputs):  # `dry_run(model, x, generator=g)`
            generators[id(g)] = g
        self.generators = list(generators.values())
        # `torch.get_rng_state` inside a block first settles draws recorded so far (see
        # core._context); the generator's own get_state is the same after that.
        torch.get_rng_state()
        self.rng_states = [g.get_state() for g in self.generators]

    def swap_in_stand_ins(self, on_meta: bool) -> None:
        made: dict[int, torch.Tensor] = {}

        def stand_in(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or _inferred_in_meta_init(t):
                return t
            if id(t) not in made:
                made[id(t)] = _stand_in(t, on_meta)
            return made[id(t)]

        for m in self.modules:
            for slots in (m._parameters, m._buffers):
                for name, t in slots.items():
                    slots[name] = stand_in(t)
            for name, v in list(m.__dict__.items()):
                if isinstance(v, torch.Tensor):
                    m.__dict__[name] = stand_in(v)
                elif type(v) in (list, tuple) and any(isinstance(x, torch.Tensor) for x in v):
                    m.__dict__[name] = type(v)(stand_in(x) for x in v)

    def restore(self) -> None:
        for i, m in enumerate(self.modules):
            if self.lazy[i]:
                # Keep what shape inference made of the lazy slots (and the class it became).
                for slots, saved in ((m._parameters, self.parameters[i]),
                                     (m._buffers, self.buffers[i])):  # fmt: skip
                    for name, t in saved.items():
                        if t is not None and not is_lazy(t):
                            slots[name] = t
            else:
                m.__class__ = self.classes[i]  # shape inference turns LazyLinear into Linear
                m.__dict__.clear()
                m.__dict__.update(self.attributes[i])
                for name, saved in self.dict_contents[i].items():
                    slots = m.__dict__[name]
                    slots.clear()
                    slots.update(saved)
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(self.transient[i])
            m.training = self.training[i]
        for g, state in zip(self.generators, self.rng_states, strict=True):
            g.set_state(state)


def dry_run(
    module: nn.Module,
    *example_inputs: Any,
    input_dtype: torch.dtype | str | None = None,
    **kwargs: Any,
) -> MemoryTable:
    """Run ``module(*example_inputs, **kwargs)`` on deferred tensors and record what it costs.

    When to use: to learn output shapes, activation sizes, FLOPs and peak forward memory of a
    model (deferred, partially materialized or real) without allocating activations, and to
    infer the shapes of lazy modules on a deferred model. Lazy modules built inside
    ``meta_init`` keep their inferred shapes and their initialization is recorded, so
    materializing them afterwards equals an eager forward with the same seed; any other model,
    lazy modules included, is left exactly as it was.

    Inputs may be real tensors (converted with ``torch.empty_like`` inside ``meta_init``, dtype
    kept), deferred tensors, or shapes (``(1, 4096)`` or ``torch.Size``), which become deferred
    tensors of ``input_dtype`` (a ``torch.dtype`` or its name, ``"float16"``; default:
    ``torch.long`` when the model starts with an ``nn.Embedding``, else the default float
    dtype). Keyword arguments go to ``forward`` (tensors in them are converted the same way).

    The forward runs under ``torch.no_grad()`` with forward hooks (output shapes and bytes per
    module) and ``torch.utils.flop_counter.FlopCounterMode`` (FLOPs per module, subtree
    inclusive). Live activation bytes are followed op by op; a module's peak is the largest
    live activation total seen while it runs (including what its callers keep alive, e.g. the
    KV cache and residual stream). Results are stored on ``module`` keyed by qualified name and
    appear as columns ``output_shape``, ``activation_bytes``, ``flops``, ``peak_forward_bytes``
    (= the subtree's weights + that peak) in later :func:`memory_table` calls.

    The model's own forward hooks run as in eager, and see the run's tensors: deferred tensors
    (meta tensors for a model on the meta device) standing in for its weights and activations,
    never real values.

    Returns ``memory_table(module)`` with those columns.
    """
    require_module(module, "dry_run")
    meta_init = _core_meta_init()
    use_meta = meta_init is None or _uses_meta(module)
    shape_dtype = parse_dtype(input_dtype, "input_dtype") or _default_input_dtype(module)
    ctx: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext() if use_meta else meta_init()
    )
    modules = _ModuleStack(module)
    tracker = _ActivationTracker(modules.stack)
    start = time.perf_counter()
    flops = _track_forward_only(
        FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
    )
    guard = _ModelGuard(module, (example_inputs, kwargs))
    try:
        with ctx:
            guard.swap_in_stand_ins(on_meta=use_meta)

            def convert(t: torch.Tensor) -> torch.Tensor:
                # A copy, never the caller's tensor: an in-place op of the forward
                # (`ReLU(inplace=True)`) must not write (or record a write on) it.
                if use_meta:
                    return torch.empty_like(t, device="meta")
                return t.detach().clone() if tensor_state(t) == "deferred" else torch.empty_like(t)

            def from_shape(shape: Any) -> torch.Tensor:
                if use_meta:
                    return torch.empty(tuple(shape), dtype=shape_dtype, device="meta")
                return torch.empty(tuple(shape), dtype=shape_dtype)

            args = [
                from_shape(a) if _is_shape(a) else _map_tensors(a, convert) for a in example_inputs
            ]
            kw = {k: _map_tensors(v, convert) for k, v in kwargs.items()}
            for t in _tensors((args, kw)):
                tracker.track(t)
            with torch.no_grad(), modules.hooks(), flops, tracker:
                tracker.note_peak()
                output = module(*args, **kw)
            out_shapes = [tuple(t.shape) for t in _tensors(output)]
            del output, args, kw
    finally:
        guard.restore()
    seconds = time.perf_counter() - start
    tracker.tensors.clear()
    tracker.index.clear()

    root_label = type(module).__name__
    known = set(modules.names.values())
    flop_by_name: dict[str, int] = {name: 0 for name in modules.shapes}
    for key, per_op in flops.get_flop_counts().items():
        if key == root_label:
            name = ""
        elif key.startswith(root_label + "."):
            name = key[len(root_label) + 1 :]
        else:
            continue
        if name in known:
            flop_by_name[name] = int(sum(per_op.values()))
    run = {
        "inputs": [tuple(a) if _is_shape(a) else _describe(a) for a in example_inputs],
        "kwargs": {k: _describe(v) for k, v in kwargs.items()},
        "output_shapes": out_shapes,
        "flops": int(flops.get_total_flops()),
        "peak_activation_bytes": tracker.peak,
        "seconds": seconds,
    }
    # Each module keeps its own figures (plain numbers and shapes, no tensors), so tables of
    # submodules show them too; modules this forward did not reach lose stale figures.
    for name, mod in module.named_modules():
        if name in modules.shapes:
            record = {
                "output_shape": modules.shapes[name],
                "activation_bytes": modules.out_bytes.get(name, 0),
                "flops": flop_by_name.get(name, 0),
                "peak_activation_bytes": tracker.module_peak.get(name, 0),
            }
            if mod is module:
                record["run"] = run
            object.__setattr__(mod, DRY_RUN_ATTR, record)
        else:
            mod.__dict__.pop(DRY_RUN_ATTR, None)
    return memory_table(module)


def _describe(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return f"{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
    return type(obj).__name__
