"""``DeferredTensor``: a tensor with no storage that reports the device it will really have."""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from jupyter_metainit.core.errors import UnsupportedOperatorError
from jupyter_metainit.core.record.graph import TensorRecord
from jupyter_metainit.core.record.ops import user_frame
from jupyter_metainit.core.runtime.interrupts import hold_interrupts, protect, release_interrupts
from jupyter_metainit.core.runtime.plain import iter_args
from jupyter_metainit.core.runtime.swap import content_references

__all__ = [
    "SAVE_INSTEAD",
    "SHARE_MEMORY_ATTR",
    "DeferredTensor",
    "as_parameter",
    "grad_leaves",
    "NO_DEVICE_GUARD",
    "without_device_guard",
]

# Storage -> the deferred leaf that requires grad over it (weakly: a parameter). Materializing a
# non-leaf computed from it links its autograd graph to that object (``_autograd_links``); the
# object keeps its identity when it turns real, so the link reaches the model's parameter.
grad_leaves: weakref.WeakKeyDictionary[Any, weakref.ref] = content_references()  # swappable


def _note_leaf(t: DeferredTensor) -> None:
    if t._rg and not t._derived:
        grad_leaves[t._rec.storage] = weakref.ref(t)


# Attributes of ours in a deferred tensor's __dict__; everything else there is the user's
# (e.g. transformers' ``_is_hf_initialized``) and is carried over on materialization.
INTERNAL_ATTRS = frozenset({"_meta", "_rec", "_rg", "_derived", "_view_of", "_jmi_share_memory"})

# ``t.share_memory_()`` on a deferred tensor (``model.share_memory()`` in or after ``meta_init``):
# there is no memory to share yet, so it is noted here and done to the real tensor.
SHARE_MEMORY_ATTR = "_jmi_share_memory"


def _not_registered(*_args: Any) -> Any:
    raise RuntimeError("jupyter_metainit.core.record was not imported (its __init__ installs this)")


def _outside_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run outside ``torch.compile``'s tracing: compiling a deferred model would trace into
    the recorder and fail deep inside it (a dynamo assertion). Skipped, every call on a deferred
    tensor is a graph break that runs as in eager mode (outputs deferred, as an eager forward's).

    ``torch._dynamo`` takes seconds to import: until something has imported it nothing can be
    compiling, and the plain function runs.
    """
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def outside_dynamo(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            import torch._dynamo

            disabled = torch._dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return outside_dynamo


_cpp_device = torch._C.TensorBase.device.__get__
_NoSubclassFunctions = torch._C.DisableTorchFunctionSubclass
_cpp_requires_grad = torch._C.TensorBase.requires_grad.__get__
_cpp_is_leaf = torch._C.TensorBase.is_leaf.__get__


# What to do instead of writing a deferred tensor with torch.save, safetensors or save_pretrained.
SAVE_INSTEAD = (
    "To write a deferred or partly deferred model to files without materializing it, use "
    "jupyter_metainit.save(model, directory) (what save_pretrained writes, or format='dcp'); "
    "or materialize it first (jupyter_metainit.materialize)"
)


class DeferredTensor(torch.Tensor):
    """A deferred tensor: shape, dtype, stride and device are real; the values are a recording.

    It is a wrapper subclass over a ``meta`` tensor. ``requires_grad`` is kept in Python rather
    than in autograd, because autograd would need a device implementation for the reported device
    (CUDA on a CPU-only build) and would hold references that block in-place materialization.
    """

    _meta: torch.Tensor
    _rec: TensorRecord
    _rg: bool
    _derived: bool  # computed from tensors that require grad, in grad mode (not a leaf)

    # ``jupyter_metainit.core.record`` (its ``__init__``) installs the recorder's handlers here:
    # this module defines the tensor and imports nothing of the recorder (no import cycle).
    handle_op: ClassVar[Callable[..., Any]] = staticmethod(_not_registered)
    handle_function: ClassVar[Callable[..., Any]] = staticmethod(_not_registered)
    set_data: ClassVar[Callable[..., Any]] = staticmethod(_not_registered)

    @staticmethod
    def __new__(
        cls: type[DeferredTensor],
        meta: torch.Tensor,
        rec: TensorRecord,
        device: torch.device,
        requires_grad: bool = False,
        derived: bool = False,
    ) -> DeferredTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=False,
        )
        if meta.is_conj():
            torch._C._set_conj(t, True)
        if meta.is_neg():
            torch._C._set_neg(t, True)
        t._meta = meta
        t._rec = rec
        t._rg = requires_grad
        t._derived = derived
        _note_leaf(t)
        return t

    # Never traced by dynamo (see ``_outside_dynamo``).
    @classmethod
    @_outside_dynamo
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return DeferredTensor.handle_op(func, args, kwargs or {})

    @classmethod
    @_outside_dynamo
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        return DeferredTensor.handle_function(func, args, kwargs or {})

    # Metadata reads answered in Python, skipping __torch_function__: estimates and trees read
    # them for every tensor of a 70B model.
    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._meta.dtype

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._meta.shape

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        # The device it reports (the wrapper's own): what __torch_function__ ends up returning,
        # without its bookkeeping (materialize reads it for every tensor it makes). What
        # ``subclass_functions_off`` does, inlined: recording reads it for nearly every op.
        if _hosted:  # during a call run on a host impl (``host_impls``)
            reported = _hosted.get(id(self))
            if reported is not None:
                return reported
        hold_interrupts()
        try:
            with _NoSubclassFunctions():
                return _cpp_device(self)
        finally:
            release_interrupts()

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return self._meta.ndim

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    def numel(self) -> int:  # type: ignore[override]
        return self._meta.numel()

    def dim(self) -> int:  # type: ignore[override]
        return self._meta.dim()

    def element_size(self) -> int:  # type: ignore[override]
        return self._meta.element_size()

    def is_floating_point(self) -> bool:  # type: ignore[override]
        return self._meta.is_floating_point()

    # ``nn.Parameter(deferred)`` (or a subclass: ``class MyParam(nn.Parameter)``) takes PyTorch's
    # path for custom tensors: it returns the deferred tensor itself, flagged ``_is_param``, and
    # the class asked for is lost. Setting the flag is the one moment the class is in reach (the
    # caller's frame), so it is kept then, to make the real tensor of that class.
    @property
    def _is_param(self) -> bool:
        return self.__dict__.get("_is_param", False)

    @_is_param.setter
    def _is_param(self, value: bool) -> None:
        self.__dict__["_is_param"] = value
        caller = sys._getframe(1)
        if caller.f_code is _PARAMETER_NEW:
            cls = caller.f_locals.get("cls")
            if isinstance(cls, type) and cls is not torch.nn.Parameter:
                self.__dict__["_param_cls"] = cls

    # requires_grad lives in Python (see class docstring).
    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        # C++ sets autograd's own flag on outputs of a custom ``autograd.Function``.
        return self._rg or _cpp_requires_grad(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._rg = bool(value)
        _note_leaf(self)

    def requires_grad_(self, requires_grad: bool = True) -> DeferredTensor:  # type: ignore[override]
        self._rg = bool(requires_grad)
        _note_leaf(self)
        return self

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return self.detach()  # a recorded view that does not require grad

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        DeferredTensor.set_data(self, new)

    @property
    def grad_fn(self) -> None:  # type: ignore[override]
        return None

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        # As in eager: a tensor computed (in grad mode) from tensors that require grad is not
        # a leaf; every other tensor is.
        return not (self._rg and self._derived) and _cpp_is_leaf(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        prefix = "Parameter containing:\n" if getattr(self, "_is_param", False) else ""
        parts = [f"size={tuple(self.shape)}", f"device='{self.device}'"]
        if self.dtype != torch.get_default_dtype():
            parts.append(f"dtype={self.dtype}")
        if self._rg:
            parts.append("requires_grad=True")
        return f"{prefix}tensor(..., {', '.join(parts)}, deferred)"

    def as_subclass(self, cls: type) -> torch.Tensor:  # type: ignore[override]
        # The result would share this tensor's memory as another Python type; a deferred
        # tensor's Python object is always a DeferredTensor (torch would fail internally).
        raise UnsupportedOperatorError(
            f"`tensor.as_subclass({getattr(cls, '__name__', cls)})` cannot be applied to a "
            f"deferred tensor (called at {user_frame()}); call it after materializing "
            "(jupyter_metainit.materialize), or build this tensor outside meta_init"
        )

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError(f"a deferred tensor has no values to pickle or copy. {SAVE_INSTEAD}")

    def __deepcopy__(self, memo: dict) -> DeferredTensor:
        # Eager deepcopy clones the values (nn.TransformerEncoder copies its layer this way);
        # here the clone is recorded like any other op.
        if id(self) in memo:
            return memo[id(self)]
        new = self.clone(memory_format=torch.preserve_format)
        if isinstance(new, DeferredTensor):
            new._rg, new._derived = self._rg, False
        else:  # a view of memory made real: cloned now, as eagerly (``reads.realized_inputs``)
            new = new.detach().requires_grad_(self._rg)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in INTERNAL_ATTRS:
                setattr(new, k, copy.deepcopy(v, memo))
        return new


_PARAMETER_NEW = torch.nn.Parameter.__new__.__code__

# Our bookkeeping in a deferred parameter's ``__dict__`` that the real tensor does not carry as
# attributes (it is a Parameter of that class instead).
PARAMETER_ATTRS = frozenset({"_is_param", "_param_cls"})


def as_parameter(deferred: torch.Tensor, real: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``real`` as the parameter ``deferred`` stands for: of its class (a ``nn.Parameter``
    subclass stays one), made the way ``nn.Parameter.__new__`` makes it for a plain tensor."""
    cls = deferred.__dict__.get("_param_cls", torch.nn.Parameter)
    if type(real) is not torch.Tensor and type(real) is not torch.nn.Parameter:
        return torch.nn.Parameter(real, requires_grad=requires_grad)
    return torch.Tensor._make_subclass(cls, real, requires_grad)


# id -> the device a deferred tensor reports while one call runs on a host impl of it.
_hosted: dict[int, torch.device] = {}
_CPU = torch.device("cpu")


# What c10 says when a binding sets a device guard for a device this build has none for.
NO_DEVICE_GUARD = "is not linked with support for"


def without_device_guard(
    call: Callable[..., Any], func: Any, args: tuple, kwargs: dict, error: Exception
) -> Any:
    """``call(func, args, kwargs)`` again, its deferred tensors of a device with no guard in
    this build on host impls (:func:`_host_impls`), after its Python binding's device guard
    failed (``error``) before it dispatched anything: the same ops are recorded."""
    hosted = {
        id(x): x
        for x in iter_args(args, kwargs)
        if isinstance(x, DeferredTensor) and x.device.type not in ("cpu", "meta")
    }
    if not hosted:
        raise error
    with _host_impls(list(hosted.values())):
        return call(func, args, kwargs)


@contextmanager
def _host_impls(tensors: list[DeferredTensor]) -> Iterator[None]:
    """For one call, ``tensors`` (deferred, reporting a device such as ``cuda`` that this build
    has no device guard for) hold a CPU impl of the same geometry and still report their device.

    Used to retry a call whose Python binding failed before dispatching anything: bindings
    such as ``Tensor.copy_``, ``__setitem__``, ``__float__`` or ``nonzero`` set a device guard
    on ``self``'s device first, and a CPU-only PyTorch has none for CUDA ("PyTorch is not
    linked with support for cuda devices"), while ops dispatched as ATen calls (``add_``) never
    need one. Helper tensors the binding makes from ``self``'s options (list indices, a scalar
    value) are then real CPU tensors, kept as constants as in a CPU recording. Run it in a
    critical section (the swaps must not be cut).
    """
    swapped: list[tuple[DeferredTensor, torch.Tensor]] = []
    try:
        for t in tensors:
            meta = t._meta
            twin = torch.Tensor._make_wrapper_subclass(
                DeferredTensor,
                meta.shape,
                strides=meta.stride(),
                storage_offset=meta.storage_offset(),
                dtype=meta.dtype,
                device=_CPU,
            )
            if meta.is_conj():
                torch._C._set_conj(twin, True)
            if meta.is_neg():
                torch._C._set_neg(twin, True)
            _hosted[id(t)] = t.device
            torch._C._swap_tensor_impl(t, twin)
            swapped.append((t, twin))
        yield
    finally:
        for t, twin in reversed(swapped):
            # An in-place view op (``t.t_()``) gave ``t`` a new impl of its reported device.
            if _cpp_device(t).type == "cpu":
                torch._C._swap_tensor_impl(t, twin)
            del _hosted[id(t)]


protect(DeferredTensor.device.fget)  # Ctrl-C waits from its first bytecode
