"""What ``meta_init`` patches process-wide while any block runs, and restores after the last.

Counted, so nested and concurrent blocks share one wrapping (:func:`process_wrappers`); the
list of what is wrapped, and why, is in ``context``'s docstring: the RNG state readers, the
default dtype, ``torch.Generator``'s state methods, ``Tensor._make_subclass`` (parameters),
``trunc_normal_``, lazy modules, the garbage collector's threshold and one environment variable.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from jupyter_metainit.core.errors import MetaInitError, UnsupportedOperatorError
from jupyter_metainit.core.record.dispatch.value_reads import read_value
from jupyter_metainit.core.record.ops import user_frame
from jupyter_metainit.core.record.state import (
    _global_default_dtype,
    dtype_override,
    tls,
)
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.trunc_normal import trunc_normal_
from jupyter_metainit.core.rng.streams import exact_state, flush_default
from jupyter_metainit.core.runtime.interrupts import (
    critical,
)

__all__ = ["process_wrappers"]


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
def process_wrappers() -> Iterator[None]:
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
