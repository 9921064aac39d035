"""``meta_init``: the block inside which every new tensor is deferred.

Entering the outermost block on a thread pushes two modes (thread-local, like every PyTorch
mode): a torch-function mode that rewrites device arguments and keeps user data as constants
(``_devices``), and a dispatch mode that sends every ATen call to the recorder (``_record``).
While any block is active, a few process-wide functions are wrapped so that recording stays
invisible (counted, so nested and concurrent blocks share one wrapping):

* ``torch.get_rng_state`` (also what ``torch.random.fork_rng`` uses) first brings the default
  generator to its exact state (``_rng``: draws are accounted lazily while recording);
* ``torch.get_default_dtype``/``torch.set_default_dtype`` read and set the thread's own default
  inside a ``meta_init(dtype=...)`` block, so such a block changes no other thread's dtype;
* ``torch.nn.init.trunc_normal_`` is recorded as the one ``normal_`` it equals when nothing is
  redrawn (``_trunc_normal``), instead of op by op with a read of the values;
* ``nn.Module`` lazy parameters become deferred when a dry run gives them a shape (``_lazy``);
* the garbage collector's first threshold is raised (recording allocates many small objects,
  each full collection of a large heap costs 100+ ms); restored when the last block exits;
* ``HF_DEACTIVATE_ASYNC_LOAD`` is set: ``transformers`` then reads checkpoint tensors in the
  calling thread, inside the block, where reading is recorded, instead of in worker threads.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from jupyter_metainit.core.errors import MetaInitError, UnsupportedOperatorError
from jupyter_metainit.core.record.devices import (
    DATA_FACTORIES,
    FACTORIES,
    data_factory,
    handle_function,
    requires_grad_kwarg,
    rewrite_device,
)
from jupyter_metainit.core.record.dispatch.reads import read_value
from jupyter_metainit.core.record.dispatch.triage import handle_op
from jupyter_metainit.core.record.lazy import lazy_module_support
from jupyter_metainit.core.record.ops import user_frame
from jupyter_metainit.core.record.state import (
    _global_default_dtype,
    canonical_device,
    dtype_override,
    tls,
)
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.trunc_normal import trunc_normal_
from jupyter_metainit.core.record.value_reader import value_reader
from jupyter_metainit.core.rng.streams import exact_state, flush_all, flush_default
from jupyter_metainit.core.runtime.interrupts import (
    check as check_interrupts,
)
from jupyter_metainit.core.runtime.interrupts import (
    critical,
    handling_interrupts,
    hold_interrupts,
    protect,
    release_interrupts,
)
from jupyter_metainit.core.runtime.plain import subclass_functions_off

__all__ = ["is_meta_init", "meta_init"]


def is_meta_init() -> bool:
    """True inside a :func:`meta_init` block on this thread.

    Module authors can use it to take another path while their module is being deferred, e.g. to
    skip loading data from disk in ``__init__``.
    """
    return tls.depth > 0


# Calls that read metadata or autograd's switch: nothing to record, no op dispatched, so they
# are answered at once. They are a third of the calls a model's constructor makes (``no_grad``
# in every init function; ``dim``/``shape`` read on the meta tensor behind a deferred one).
_METADATA_CALLS = frozenset({
    torch._C._set_grad_enabled, torch.is_grad_enabled, torch.Tensor.dim, torch.Tensor.size,
    torch.Tensor.stride, torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.storage_offset,
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.is_meta.__get__, torch.Tensor.layout.__get__,
})  # fmt: skip


class _FunctionMode(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if func in _METADATA_CALLS:
            if DeferredTensor in types:
                with subclass_functions_off():
                    return func(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
        # Each torch-level call is a critical section (see _interrupts): a Ctrl-C lands between
        # two calls of the user's code, never inside torch's own guards (`no_grad`, ...).
        with critical():
            if tls.where is not None:
                return self._handle(func, types, args, kwargs or {})
            tls.where = user_frame()  # for every op this call dispatches
            try:
                return self._handle(func, types, args, kwargs or {})
            finally:
                tls.where = None

    @staticmethod
    def _handle(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        if DeferredTensor in types:
            # What DeferredTensor.__torch_function__ would do next, one call earlier.
            return handle_function(func, args, kwargs)
        if func is torch.Tensor.__deepcopy__ and type(args[0]) is torch.Tensor:
            return _deep_copy_of_real(*args, **kwargs)
        if func in DATA_FACTORIES:
            return requires_grad_kwarg(data_factory(func, args, dict(kwargs)), kwargs)
        if "device" in kwargs or func in FACTORIES:
            made = rewrite_device(func, args, kwargs, in_context=True)
            return requires_grad_kwarg(made, kwargs, func)
        return func(*args, **kwargs)


def _deep_copy_of_real(tensor: torch.Tensor, memo: dict) -> torch.Tensor:
    """``copy.deepcopy`` of a real tensor inside a block: a deferred copy, as ``clone`` gives
    (torch's own ``__deepcopy__`` builds the copy with ``new_empty``, deferred here, and then
    refuses the mix of a real and a deferred tensor)."""
    if id(tensor) in memo:
        return memo[id(tensor)]
    if not tensor.is_leaf:
        return torch.Tensor.__deepcopy__(tensor, memo)  # torch's own error for non-leaves
    with torch.no_grad():
        copied = tensor.clone()
    copied.requires_grad_(tensor.requires_grad)
    memo[id(tensor)] = copied
    for name, value in tensor.__dict__.items():
        setattr(copied, name, copy.deepcopy(value, memo))
    return copied


class _DispatchMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._disable_dynamo wrapper around every op: nothing compiles here

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        return handle_op(func, args, kwargs or {})


# ---------------------------------------------------------------------------------------------
# process-wide wrappers, active while any block is


_orig_get_rng_state = torch.random.get_rng_state
_orig_set_default_dtype = torch.set_default_dtype


def _get_rng_state() -> torch.Tensor:
    flush_default()
    return _orig_get_rng_state()


def _get_default_dtype() -> torch.dtype:
    override = dtype_override()
    return override if override is not None else _global_default_dtype()


def _set_default_dtype(d: torch.dtype) -> None:
    if dtype_override() is not None:
        if not (isinstance(d, torch.dtype) and d.is_floating_point):
            _orig_set_default_dtype(d)  # raises PyTorch's own error for a bad dtype
        tls.dtypes[-1] = d
        return
    _orig_set_default_dtype(d)


_orig_make_subclass = torch.Tensor._make_subclass


def _make_subclass(
    cls: type, data: torch.Tensor, requires_grad: bool = False, **kwargs: Any
) -> torch.Tensor:
    # On a deferred tensor PyTorch fails with "already associated to a python object of type
    # DeferredTensor": a deferred tensor's Python object is always a DeferredTensor. (The
    # signature is PyTorch's: dynamo, imported inside a block, checks it against its polyfill.)
    if isinstance(data, DeferredTensor):
        raise UnsupportedOperatorError(
            f"`torch.Tensor._make_subclass({getattr(cls, '__name__', cls)}, ...)` cannot make a "
            f"deferred tensor of another class (called at {user_frame()}; bitsandbytes' "
            "Int8Params and other tensor subclasses do this). Build this part outside "
            "meta_init, or materialize first (jupyter_metainit.materialize) and convert after; "
            "a `class MyParam(nn.Parameter)` made with `MyParam(data)` can be deferred"
        )
    return _orig_make_subclass(cls, data, requires_grad, **kwargs)


_wrapped = (
    (torch.Tensor, "_make_subclass", staticmethod(_make_subclass)),
    (torch, "get_rng_state", _get_rng_state),
    (torch.random, "get_rng_state", _get_rng_state),
    (torch, "get_default_dtype", _get_default_dtype),
    (torch, "set_default_dtype", _set_default_dtype),
    (torch.nn.init, "trunc_normal_", trunc_normal_),
)


# ``torch.Generator``'s methods are C methods of an immutable type: ``setattr`` refuses them, so
# its type dict is edited instead (and the type's method cache invalidated). Reads of a state
# flush the generator first: a state saved mid-build is the exact one, usable anywhere (another
# generator, outside any block, a file). ``set_state`` accepts a state transformed inside a block
# (``st.clone()``, ``torch.tensor(st.numpy())``: deferred tensors) by computing its values.
def _generator_type_dict() -> dict | None:
    try:
        import ctypes

        referents = gc.get_referents(torch._C.Generator.__dict__)
        modified = ctypes.pythonapi.PyType_Modified
    except (AttributeError, OSError):  # not CPython: states read mid-build may be placeholders
        return None
    if len(referents) != 1 or not isinstance(referents[0], dict):
        return None
    modified.argtypes = [ctypes.py_object]
    modified.restype = None
    return referents[0]


_generator_dict = _generator_type_dict()
_generator_methods = {
    name: torch._C.Generator.__dict__[name]
    for name in ("get_state", "set_state", "clone_state", "__reduce__")
    if name in torch._C.Generator.__dict__
}


def _exact_then(name: str) -> Any:
    original = _generator_methods[name]

    def method(self: torch.Generator, *args: Any) -> Any:
        exact_state(self)
        return original(self, *args)

    method.__name__ = name
    return method


def _generator_set_state(self: torch.Generator, new_state: torch.Tensor) -> Any:
    if isinstance(new_state, DeferredTensor):
        try:
            new_state = read_value(new_state)
        except MetaInitError as e:
            raise MetaInitError(
                "set_state() got a tensor computed inside meta_init whose values cannot be "
                f"computed ({e}); pass the tensor that get_state() returned, or a copy made "
                "outside the block"
            ) from e
    return _generator_methods["set_state"](self, new_state)


def _generator_get_state(self: torch.Generator) -> torch.Tensor:
    return exact_state(self)


def _generator_wrappers() -> dict[str, Any]:
    wrappers: dict[str, Any] = {"get_state": _generator_get_state}
    if "set_state" in _generator_methods:
        wrappers["set_state"] = _generator_set_state
    for name in ("clone_state", "__reduce__"):
        if name in _generator_methods:
            wrappers[name] = _exact_then(name)
    return wrappers


def _set_generator_methods(methods: dict[str, Any]) -> None:
    if _generator_dict is None:
        return
    import ctypes

    _generator_dict.update(methods)
    ctypes.pythonapi.PyType_Modified(torch._C.Generator)


_wrap_count = 0
_wrap_lock = threading.Lock()
_saved: list[tuple[Any, str, Any]] = []


# Recording creates many small long-lived objects; at Python's default (700 allocations) they
# trigger collections of the whole heap, each 100+ ms in a notebook with torch and transformers
# loaded. Collections still run, ~15 times less often, until the last block exits.
_GC_THRESHOLD = 10_000
_saved_gc_threshold: list[int] = []

_ENVIRONMENT = {"HF_DEACTIVATE_ASYNC_LOAD": "1"}
_saved_environment: dict[str, str | None] = {}


@contextlib.contextmanager
def _process_wrappers() -> Iterator[None]:
    global _wrap_count
    with critical(), _wrap_lock:
        if _wrap_count == 0:
            _saved_gc_threshold[:] = gc.get_threshold()
            first, *rest = _saved_gc_threshold
            gc.set_threshold(max(first, _GC_THRESHOLD), *rest)
            for owner, name, wrapper in _wrapped:
                _saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, wrapper)
            _set_generator_methods(_generator_wrappers())
            for key, value in _ENVIRONMENT.items():
                _saved_environment[key] = os.environ.get(key)
                os.environ[key] = value
        _wrap_count += 1
    try:
        yield
    finally:
        with critical(), _wrap_lock:
            _wrap_count -= 1
            if _wrap_count == 0:
                for owner, name, original in reversed(_saved):
                    setattr(owner, name, original)
                _saved.clear()
                _set_generator_methods(_generator_methods)
                for key, value in _saved_environment.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                _saved_environment.clear()
                if _saved_gc_threshold:
                    gc.set_threshold(*_saved_gc_threshold)
                    _saved_gc_threshold.clear()


def _check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"meta_init(dtype=...) is the default floating dtype of the block; got {dtype!r} "
            "(use torch.bfloat16, torch.float16, torch.float32 or torch.float64)"
        )
    return dtype


class meta_init(contextlib.ContextDecorator):
    """Defer every tensor created in the block: no memory, every operation recorded.

    Use it to build a model of any size for inspection, sharding or partial use, then
    :func:`materialize` the parts you need with exactly the values eager construction gives.
    Tensors report the shape, dtype, stride, ``requires_grad`` and device they would really have
    (an explicit ``device="cuda:1"`` is honoured even without a GPU).

    Args:
        device: device reported by tensors whose code names none (default: PyTorch's default).
        dtype: default floating dtype inside the block, for this thread only: factories,
            ``torch.tensor`` data and ``torch.get_default_dtype()`` see it, other threads keep
            theirs. (PyTorch's default dtype is process-wide; the block never sets it, except
            for the duration of a single op whose result dtype comes from it, such as an
            integer tensor divided by an int, under a lock.)

    Re-entrant and thread-local: other threads are unaffected. After the outermost block, the
    random number generators are where eager construction would have left them. Usable as a
    decorator too.
    """

    def __init__(self, device: Any = None, dtype: torch.dtype | None = None) -> None:
        self.device = canonical_device(device) if device is not None else None
        self.dtype = _check_dtype(dtype)
        self._entered: list[tuple[bool, Any, contextlib.ExitStack]] = []

    def __enter__(self) -> None:
        # Entering and leaving are protected from Ctrl-C (see _interrupts.protect): an
        # interrupt cannot leave this thread "inside" a block that has ended.
        hold_interrupts()
        try:
            outermost = tls.depth == 0
            handler = handling_interrupts() if outermost else contextlib.nullcontext()
            handler.__enter__()
            tls.devices.append(self.device)
            tls.dtypes.append(self.dtype)
            tls.depth += 1
            stack = contextlib.ExitStack()
            self._entered.append((outermost, handler, stack))
            if outermost:
                stack.enter_context(_process_wrappers())
                stack.enter_context(lazy_module_support())
                stack.enter_context(_FunctionMode())
                stack.enter_context(_DispatchMode())
        except BaseException:
            release_interrupts(raise_pending=False)
            self.__exit__(None, None, None)
            raise
        release_interrupts(raise_pending=False)  # a Ctrl-C held back surfaces in the block

    def __exit__(self, *exc: Any) -> None:
        hold_interrupts()
        handler: Any = None
        try:
            if not self._entered:
                return
            outermost, handler, stack = self._entered.pop()
            try:
                stack.close()
            finally:
                tls.depth -= 1
                tls.devices.pop()
                tls.dtypes.pop()
                if outermost:
                    flush_all()
                    value_reader().forget_all()
        finally:
            # Our SIGINT handler goes last: once the previous one is back, a Ctrl-C raises at
            # once, and it must not land before the critical section is closed.
            release_interrupts(raise_pending=False)
            if handler is not None:
                handler.__exit__(None, None, None)
            if exc[0] is None:
                check_interrupts()  # a Ctrl-C held back in here surfaces now


protect(meta_init.__enter__, meta_init.__exit__)
