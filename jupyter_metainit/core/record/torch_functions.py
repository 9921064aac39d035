"""Torch-function level: make calls that name a device create deferred tensors instead.

PyTorch's argument parser turns ``device="cuda:1"`` into a real device before any dispatch
happens (and fails without CUDA), so device arguments are rewritten to ``meta`` here, one level
above ATen, while the device the result must *report* is remembered in ``tls.pending_device``
for the recorder (``dispatch``) to pick up. Data handed over by the user (``torch.tensor([...])``,
``from_numpy``) is copied and kept as a constant of the recording. ``t.to(...)``/``t.cuda()`` on
a deferred tensor become a recorded copy that reports the new device.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.errors import UnsupportedOperatorError
from jupyter_metainit.core.record.dispatch.file_memory import storage_region
from jupyter_metainit.core.record.dispatch.inputs import wrap_constant, wrap_file_region
from jupyter_metainit.core.record.dispatch.value_reads import read_value
from jupyter_metainit.core.record.dispatch.views import meta_factory
from jupyter_metainit.core.record.dispatch.whole_calls import (
    SUBCLASS_SENSITIVE,
    record_autograd,
    record_call,
)
from jupyter_metainit.core.record.ops import user_frame
from jupyter_metainit.core.record.state import default_device, dtype_override, tls
from jupyter_metainit.core.record.tensor import (
    NO_DEVICE_GUARD,
    SAVE_INSTEAD,
    SHARE_MEMORY_ATTR,
    DeferredTensor,
    without_device_guard,
)
from jupyter_metainit.core.runtime.arguments import indexed_device
from jupyter_metainit.core.runtime.interrupts import critical, handling_interrupts
from jupyter_metainit.core.runtime.plain import plain, subclass_functions_off

__all__ = [
    "DATA_FACTORIES",
    "FACTORIES",
    "LIKE_FACTORIES",
    "TO_METHODS",
    "data_factory",
    "handle_function",
    "requires_grad_kwarg",
    "retarget",
    "rewrite_device",
]

META = torch.device("meta")

# Python functions that create tensors from data the user hands over: kept as constants.
DATA_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.from_numpy,
    torch.Tensor.new_tensor,
}
# torch functions whose default device is the current default device.
FACTORIES = {
    torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.arange, torch.range, torch.linspace,
    torch.logspace, torch.eye, torch.scalar_tensor, torch.tril_indices, torch.triu_indices,
    torch.normal, torch.empty_permuted, torch.zeros_like, torch.ones_like, torch.empty_like,
    torch.full_like, torch.rand_like, torch.randn_like, torch.randint_like,
}  # fmt: skip
# Factories shaped after their tensor argument (its metadata only, never its values).
LIKE_FACTORIES = frozenset({
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like,
})  # fmt: skip
TO_METHODS = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type}
# Autograd entry points: deferred tensors keep ``requires_grad`` in Python and have no graph of
# their own; a gradient is recorded as one call (``whole_calls.record_autograd``).
_AUTOGRAD_CALLS = {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}


class pending:
    """Tensors recorded inside report ``device`` (their call was rewritten to ``meta``).

    Also turns torch-function handling of subclasses off for the block, in one critical section
    (see ``_plain.subclass_functions_off``).
    """

    __slots__ = ("_device", "_guard", "_saved")

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def __enter__(self) -> None:
        self._guard = subclass_functions_off()
        self._guard.__enter__()
        self._saved = tls.pending_device
        tls.pending_device = self._device

    def __exit__(self, *exc: Any) -> None:
        tls.pending_device = self._saved
        self._guard.__exit__(*exc)


def _has_tensor_argument(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))


def rewrite_device(func: Any, args: tuple, kwargs: dict, in_context: bool) -> Any:
    """Call ``func`` with ``device=meta``, remembering the device the result must report.

    Inside ``meta_init`` a factory that names no device gets the block's default device. A
    factory overload that takes tensors (``torch.normal(mean_t, std_t)``) has no ``device``
    argument: its result follows its inputs, so it is left alone.
    """
    device = kwargs.get("device")
    implicit = device is None
    if implicit and not (in_context and func in FACTORIES and func not in LIKE_FACTORIES):
        with subclass_functions_off():
            return func(*args, **kwargs)
    if implicit and _has_tensor_argument(args, kwargs):
        with subclass_functions_off():
            return func(*args, **kwargs)
    target = indexed_device(device) if device is not None else default_device()
    if target.type == "meta":
        with subclass_functions_off():
            if func in FACTORIES and not _has_tensor_argument(args, kwargs):
                return meta_factory(func, args, kwargs)
            return func(*args, **kwargs)
    kwargs = dict(kwargs)
    kwargs["device"] = META
    with pending(target):
        return func(*args, **kwargs)


def _python_data(data: Any) -> bool:
    """True for data whose floating values take the default dtype (lists, Python numbers)."""
    if isinstance(data, (list, tuple)):
        return all(_python_data(x) for x in data)
    return isinstance(data, (bool, int, float, complex))


def data_factory(func: Any, args: tuple, kwargs: dict) -> DeferredTensor:
    """``torch.tensor(data)`` and friends inside ``meta_init``: a constant of the recording."""
    if func is torch.Tensor.new_tensor:
        self, data = args[0], args[1]
        kwargs.setdefault("dtype", self.dtype)
        kwargs.setdefault("device", self.device)
        func, args = torch.tensor, (data,)
    device = kwargs.pop("device", None)
    target = indexed_device(device) if device is not None else default_device()
    data = args[0] if args else kwargs.get("obj", kwargs.get("data"))
    region = (
        storage_region(data) if isinstance(data, (torch.UntypedStorage, torch.Tensor)) else None
    )
    if region is not None and func in (torch.asarray, torch.as_tensor):
        # Memory-mapped file bytes (how safetensors hands over a tensor): recorded as a read
        # of that file region, then viewed with the requested dtype.
        return _from_file(region, data, kwargs.get("dtype"), target)
    override = dtype_override()
    if (
        override is not None
        and kwargs.get("dtype") is None
        and func is torch.tensor
        and args
        and _python_data(args[0])
    ):
        with plain():
            probe = torch.tensor(args[0])
        if probe.is_floating_point():
            kwargs["dtype"] = override
    with plain():
        real = func(*args, **kwargs)
        if real.device.type != "cpu":
            real = real.cpu()
        if func is not torch.tensor:
            # as_tensor/from_numpy share the caller's memory: keep the values as they are now.
            real = real.clone()
    return wrap_constant(real, target)


def _from_file(
    region: Any, data: Any, dtype: torch.dtype | None, device: torch.device
) -> DeferredTensor:
    raw = wrap_file_region(region, device)
    if isinstance(data, torch.Tensor):  # a tensor over the mapping: its own geometry
        with subclass_functions_off():
            typed = raw.view(data.dtype) if data.dtype.itemsize != 1 else raw
            result = typed.as_strided(data.shape, data.stride(), data.storage_offset())
    else:
        result = raw
    if dtype is not None and dtype != result.dtype:
        with subclass_functions_off():
            result = result.to(dtype)
    return result


def retarget(func: Any, self: DeferredTensor, args: tuple, kwargs: dict) -> Any:
    """``t.to(...)``, ``t.cuda()``, ``t.cpu()``: a recorded copy that reports the new device."""
    if func is torch.Tensor.cpu:
        device, dtype, copy = torch.device("cpu"), None, False
    elif func is torch.Tensor.cuda:
        device = args[0] if args else kwargs.get("device")
        device, dtype, copy = (
            indexed_device(device if device is not None else "cuda"),
            None,
            False,
        )
    elif func is torch.Tensor.type:
        with subclass_functions_off():
            return func(self, *args, **kwargs)
    else:
        copy = bool(kwargs.pop("copy", False))
        bools = [i for i, a in enumerate(args) if isinstance(a, bool)]
        if len(bools) > 1:  # to(dtype, non_blocking, copy): the second bool is `copy`
            copy = copy or args[bools[1]]
            args = args[: bools[1]] + args[bools[1] + 1 :]
        device, dtype, _nb, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is not None and memory_format != torch.preserve_format:
            with subclass_functions_off():
                return torch.ops.aten._to_copy.default(
                    self, dtype=dtype or self.dtype, memory_format=memory_format
                )
        if device is not None:
            device = indexed_device(device)
    device = device or self.device
    dtype = dtype or self.dtype
    if device == self.device and dtype == self.dtype and not copy:
        return self
    with pending(device):
        return torch.ops.aten._to_copy.default(self, dtype=dtype, device=META)


_sets_requires_grad: dict[Any, bool] = {}


def _binding_sets_requires_grad(func: Any) -> bool:
    """Torch's Python bindings of ``*_like`` and ``new_*`` functions set the result's
    ``requires_grad`` to their ``requires_grad=`` argument (default False) after the op, whatever
    autograd made of it (``randint_like(param)`` does not require grad)."""
    known = _sets_requires_grad.get(func)
    if known is None:
        name = getattr(func, "__name__", "")
        known = _sets_requires_grad[func] = name.endswith("_like") or name.startswith("new_")
    return known


def requires_grad_kwarg(result: Any, kwargs: dict, func: Any = None) -> Any:
    """``requires_grad=`` of a factory (``torch.randn(3, requires_grad=True)``,
    ``torch.tensor(data, requires_grad=True)``, ``x.new_ones(2, requires_grad=True)``): torch
    sets it in C++ after the op, where a deferred tensor's Python flag does not see it."""
    if not isinstance(result, DeferredTensor):
        return result
    if kwargs.get("requires_grad"):
        result._rg, result._derived = True, False
    elif func is not None and _binding_sets_requires_grad(func):
        result._rg, result._derived = False, False
    return result


def handle_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """``DeferredTensor.__torch_function__``: device-changing calls, everything else unchanged."""
    if "requires_grad" in kwargs or _binding_sets_requires_grad(func):
        return requires_grad_kwarg(_handle_requires_grad_free(func, args, kwargs), kwargs, func)
    return _handle_requires_grad_free(func, args, kwargs)


def _handle_requires_grad_free(func: Any, args: tuple, kwargs: dict) -> Any:
    if tls.where is not None:
        return _handle_function(func, args, kwargs)
    if tls.depth == 0:
        # Outside meta_init (model.half(), model.apply(init) later): Ctrl-C must not land in
        # the middle of our bookkeeping either (meta_init installs this for its whole block).
        with handling_interrupts(), critical():
            return _handle_outermost(func, args, kwargs)
    with critical():
        return _handle_outermost(func, args, kwargs)


def _handle_outermost(func: Any, args: tuple, kwargs: dict) -> Any:
    tls.where = user_frame()  # for every op this call dispatches
    try:
        return _handle_function(func, args, kwargs)
    finally:
        tls.where = None


def _handle_function(func: Any, args: tuple, kwargs: dict) -> Any:
    # most calls (``F.linear``, ``x.view``) are none of the special ones: one look-up, not ten
    if func in _SPECIAL:
        handled = _handle_special(func, args, kwargs)
        if handled is not _NOT_SPECIAL:
            return handled
    if "device" in kwargs:
        return rewrite_device(func, args, kwargs, in_context=False)
    return _run(func, args, kwargs)


_NOT_SPECIAL = object()  # _handle_special's answer for a call it leaves to the general path


def _handle_special(func: Any, args: tuple, kwargs: dict) -> Any:
    """The calls treated otherwise than by running them (``_SPECIAL``), or ``_NOT_SPECIAL``
    when this call of one of them is an ordinary one (a method on a real tensor)."""
    if func in TO_METHODS and args and isinstance(args[0], DeferredTensor):
        return retarget(func, args[0], args[1:], dict(kwargs))
    if func is torch.Tensor.numpy or func is torch.Tensor.tolist:
        value = read_value(args[0])
        return func(value, *args[1:], **kwargs)
    if func is torch.Tensor.new_tensor:
        return data_factory(func, args, dict(kwargs))
    if func in _AUTOGRAD_CALLS:  # GradInit-style code: a gradient in ``__init__``
        return record_autograd(func, args, kwargs)
    if func is torch.Tensor.share_memory_ and args and isinstance(args[0], DeferredTensor):
        # No memory to share yet (the storage call would crash): done when materialized.
        args[0].__dict__[SHARE_MEMORY_ATTR] = True
        return args[0]
    if func is torch.Tensor.is_shared and args and isinstance(args[0], DeferredTensor):
        return bool(args[0].__dict__.get(SHARE_MEMORY_ATTR, False))
    if func in SUBCLASS_SENSITIVE:
        return record_call(func, args, kwargs)
    if func is torch.Tensor.storage and args and isinstance(args[0], DeferredTensor):
        return _typed_storage(args[0])
    if func is torch.Tensor.untyped_storage and args and isinstance(args[0], DeferredTensor):
        with subclass_functions_off():
            storage = func(*args, **kwargs)
        if type(storage) is torch.UntypedStorage:
            # The same object (its identity, size and device are real), whose data reads say
            # what to do instead of PyTorch's "data is not allocated yet".
            storage.__class__ = _DeferredStorage
        return storage
    return _NOT_SPECIAL


# The calls ``_handle_special`` treats otherwise than by running them.
_SPECIAL = frozenset({
    *TO_METHODS, *_AUTOGRAD_CALLS, *SUBCLASS_SENSITIVE, torch.Tensor.numpy, torch.Tensor.tolist,
    torch.Tensor.new_tensor, torch.Tensor.share_memory_, torch.Tensor.is_shared,
    torch.Tensor.storage, torch.Tensor.untyped_storage,
})  # fmt: skip


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """The call itself, on the meta tensors' wrappers (reads of index values as needed)."""
    try:
        return _call(func, args, kwargs)
    except RuntimeError as e:
        if NO_DEVICE_GUARD not in str(e):
            raise
        return without_device_guard(_call, func, args, kwargs, e)


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    try:
        with subclass_functions_off():
            return func(*args, **kwargs)
    except RuntimeError as e:
        if "data is not allocated yet" not in str(e):
            raise
        return _with_index_values(func, args, kwargs, e)


class _DeferredStorage(torch.UntypedStorage):
    """The storage of a deferred tensor: no memory yet, so reading its bytes is refused, and so
    is its address (what writers of files ask for first: safetensors, ``save_pretrained``)."""

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise UnsupportedOperatorError(
            f"the storage of a deferred tensor has no memory to read (called at {user_frame()}):"
            " read the tensor instead (t.tolist(), t.numpy(): its values are computed), or "
            "materialize first (jupyter_metainit.materialize)"
        )

    def _no_address(self, *_args: Any, **_kwargs: Any) -> Any:
        raise UnsupportedOperatorError(
            f"a deferred tensor has no memory yet, so no address (called at {user_frame()}). "
            f"{SAVE_INSTEAD}"
        )

    __getitem__ = __iter__ = __bytes__ = tolist = _refuse
    data_ptr = _data_ptr = _no_address


def _typed_storage(t: DeferredTensor) -> torch.TypedStorage:
    """``t.storage()``: the legacy typed storage over :class:`_DeferredStorage`, so that its
    ``data_ptr()`` (safetensors' ``storage_ptr``) refuses as clearly."""
    return torch.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True)


def _with_index_values(func: Any, args: tuple, kwargs: dict, error: Exception) -> Any:
    """Some functions read an integer tensor argument's values in C++ before any op is
    dispatched (``torch.tensor_split(x, indices_tensor)``): give them those values (exact, by
    replay) and keep the data argument deferred."""
    replaced = False

    def value(x: Any) -> Any:
        nonlocal replaced
        if isinstance(x, DeferredTensor) and not (x.is_floating_point() or x.is_complex()):
            replaced = True
            return read_value(x)
        return x

    new_args = (args[0], *(value(a) for a in args[1:])) if args else ()
    new_kwargs = {k: value(v) for k, v in kwargs.items()}
    if not replaced:
        raise error
    with subclass_functions_off():
        return func(*new_args, **new_kwargs)
