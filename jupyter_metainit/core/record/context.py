"""``meta_init``: the block inside which every new tensor is deferred.

Entering the outermost block on a thread pushes two modes (thread-local, like every PyTorch
mode): a torch-function mode that rewrites device arguments and keeps user data as constants
(``torch_functions``), and a dispatch mode that sends every ATen call to the recorder
(``dispatch``).
While any block is active, a few process-wide functions are wrapped so that recording stays
invisible (counted, so nested and concurrent blocks share one wrapping; ``process_wrappers``):

* ``torch.get_rng_state`` (also what ``torch.random.fork_rng`` uses) first brings the default
  generator to its exact state (``rng.streams``: draws are accounted lazily while recording);
* ``torch.get_default_dtype``/``torch.set_default_dtype`` read and set the thread's own default
  inside a ``meta_init(dtype=...)`` block, so such a block changes no other thread's dtype;
* ``torch.nn.init.trunc_normal_`` is recorded as the one ``normal_`` it equals when nothing is
  redrawn (``trunc_normal``), instead of op by op with a read of the values;
* ``nn.Module`` lazy parameters become deferred when a dry run gives them a shape (``lazy``);
* the garbage collector's first threshold is raised (recording allocates many small objects,
  each full collection of a large heap costs 100+ ms); restored when the last block exits;
* ``HF_DEACTIVATE_ASYNC_LOAD`` is set: ``transformers`` then reads checkpoint tensors in the
  calling thread, inside the block, where reading is recorded, instead of in worker threads.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.core.record.dispatch.file_memory import release_held
from jupyter_metainit.core.record.dispatch.triage import handle_op
from jupyter_metainit.core.record.dispatch.views import (
    INIT_FUNCTIONS,
    NOT_A_VIEW,
    VIEW_METHODS,
    meta_factory,
    on_meta_tensor,
    view_method,
)
from jupyter_metainit.core.record.lazy import lazy_module_support
from jupyter_metainit.core.record.ops import user_frame
from jupyter_metainit.core.record.process_wrappers import process_wrappers
from jupyter_metainit.core.record.state import tls
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.torch_functions import (
    DATA_FACTORIES,
    FACTORIES,
    LIKE_FACTORIES,
    data_factory,
    handle_function,
    pending,
    requires_grad_kwarg,
    retarget,
    rewrite_device,
)
from jupyter_metainit.core.record.value_reader import value_reader
from jupyter_metainit.core.rng.streams import flush_all
from jupyter_metainit.core.runtime.arguments import check_floating_dtype, indexed_device
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
from jupyter_metainit.core.runtime.swap import install_swap_tensors

__all__ = ["at_meta_init_edges", "is_meta_init", "meta_init"]


def is_meta_init() -> bool:
    """Whether this thread runs inside a :func:`meta_init` block.

    Module authors can use it to take another path while their module is being deferred, e.g.
    to skip loading data from disk in ``__init__`` (the block records tensors, not files).
    Other threads are not inside the block, whatever this one does.

    Returns:
        ``True`` inside a ``meta_init`` block (nested ones too) on this thread.

    Examples:
        >>> from jupyter_metainit import is_meta_init, meta_init
        >>> is_meta_init()
        False
        >>> with meta_init():
        ...     is_meta_init()
        True
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
    torch.Tensor.is_floating_point, torch.Tensor.is_complex,
})  # fmt: skip


_FAST = VIEW_METHODS | INIT_FUNCTIONS  # answered without the general path when they can be


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
            if func in _FAST:  # no trip through ATen dispatch where it is not needed
                made = self._view(func, types, args, kwargs or {})
                if made is not NOT_A_VIEW:
                    return made
            elif func is _TO and DeferredTensor in types and _plain_to(args, kwargs):
                # ``t.to(...)`` (once per checkpoint tensor): what the general path ends in,
                # without its layers (an op it records finds its call site itself)
                return retarget(func, args[0], args[1:], dict(kwargs or {}))
            elif func in FACTORIES and _meta_factory_call(func, types, args, kwargs):
                # A model built on ``torch.device("meta")`` (as ``from_pretrained`` builds it):
                # what ``rewrite_device`` does with the call, without the general path's layers.
                with subclass_functions_off():
                    return meta_factory(func, args, kwargs)
            if tls.where is not None:
                return self._handle(func, types, args, kwargs or {})
            tls.where = user_frame()  # for every op this call dispatches
            try:
                return self._handle(func, types, args, kwargs or {})
            finally:
                tls.where = None

    @staticmethod
    def _view(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """Views of deferred tensors, and views and init functions of plain meta tensors,
        answered without the general path where they can be (``NOT_A_VIEW`` otherwise)."""
        if DeferredTensor in types:
            return view_method(func, args, kwargs) if func in VIEW_METHODS else NOT_A_VIEW
        return on_meta_tensor(func, args, kwargs)

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
            args, kwargs = _stand_in_for_meta_input(func, args, kwargs)
            made = rewrite_device(func, args, kwargs, in_context=True)
            return requires_grad_kwarg(made, kwargs, func)
        return func(*args, **kwargs)


_TO = torch.Tensor.to

# Factories that read only the metadata of their tensor argument (shape, strides, dtype).
_METADATA_INPUT = LIKE_FACTORIES | {
    torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_full,
    torch.Tensor.new_empty_strided,
}  # fmt: skip


def _stand_in_for_meta_input(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``torch.empty_like(meta_tensor, device="cpu")`` (``from_pretrained`` gives each
    non-persistent buffer and missing weight of a model built on ``torch.device("meta")`` a
    real placeholder so): eager makes a real tensor from the meta one's metadata alone. The
    meta tensor has no data to replay, so the call is recorded on a deferred stand-in with its
    geometry (an ``empty_strided``, replayed without a fill): the result is the same call's."""
    if func not in _METADATA_INPUT or kwargs.get("device") is None:
        return args, kwargs
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or isinstance(x, DeferredTensor) or not x.is_meta:
        return args, kwargs
    target = indexed_device(kwargs["device"])
    if target.type == "meta":
        return args, kwargs
    with pending(target):
        stand_in = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    if args:
        return (stand_in, *args[1:]), kwargs
    return args, {**kwargs, "input": stand_in}


def _plain_to(args: tuple, kwargs: Any) -> bool:
    """A ``.to`` call on a deferred tensor with no ``requires_grad=`` (which the general path
    treats apart)."""
    return (
        bool(args)
        and isinstance(args[0], DeferredTensor)
        and not (kwargs and "requires_grad" in kwargs)
    )


def _meta_factory_call(func: Any, types: Any, args: tuple, kwargs: Any) -> bool:
    """A factory given ``device=torch.device("meta")`` and no tensor."""
    device = kwargs.get("device") if kwargs else None
    return (
        type(device) is torch.device
        and device.type == "meta"
        and DeferredTensor not in types
        and func not in DATA_FACTORIES
        and not any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
    )


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


class meta_init(contextlib.ContextDecorator):
    """Defer every tensor created in the block: no memory, every operation recorded.

    Use it to build a model of any size for inspection, planning, saving or sharding, then
    :func:`materialize` the parts you need with exactly the values eager construction gives.
    Tensors report the shape, dtype, stride, ``requires_grad`` and device they would really have
    (an explicit ``device="cuda:1"`` is honoured even without a GPU), so code that reads them
    takes its eager path. Operations on deferred tensors after the block (``model.half()``,
    tying weights, ``model.apply(init)``) are recorded too.

    Re-entrant and thread-local: other threads are unaffected. After the outermost block, the
    random number generators are where eager construction would have left them. Usable as a
    decorator too.

    Args:
        device: device reported by tensors whose code names none (a device, its name, or a GPU
            index; default: PyTorch's default). ``"meta"`` is refused: the block allocates
            nothing anyway, and PyTorch's meta tensors (``with torch.device("meta")``) never
            hold values.
        dtype: default floating dtype inside the block (a ``torch.dtype`` or its name,
            ``"bf16"``), for this thread only: factories,
            ``torch.tensor`` data and ``torch.get_default_dtype()`` see it, other threads keep
            theirs. (PyTorch's default dtype is process-wide; the block never sets it, except
            for the duration of a single op whose result dtype comes from it, such as an
            integer tensor divided by an int, under a lock.)

    Raises:
        ArgumentError: ``device`` or ``dtype`` names no device or dtype (``dtype="bf17"``),
            or ``device="meta"``.
        ArgumentTypeError: ``dtype`` is not a floating dtype, or not a dtype at all.
        UnsupportedOperatorError: code in the block calls an operator that cannot be
            deferred (quantizing); the message names the line.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import is_deferred, materialize, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096))
        >>> model[0].weight.shape, model[0].weight.dtype, is_deferred(model)  # 128 MiB, unmade
        (torch.Size([4096, 4096]), torch.float32, True)
        >>> with meta_init(device="cuda:1", dtype="bf16"):  # a GPU is not needed to record
        ...     layer = nn.Linear(8, 8)
        >>> layer.weight.device, layer.weight.dtype
        (device(type='cuda', index=1), torch.bfloat16)
    """

    def __init__(
        self, device: str | torch.device | int | None = None, dtype: torch.dtype | str | None = None
    ) -> None:
        self.device = (
            indexed_device(device, "meta_init(device=...)") if device is not None else None
        )
        if self.device is not None and self.device.type == "meta":
            # A deferred tensor will have values; a PyTorch meta tensor never has any.
            raise ArgumentError(
                "meta_init(device='meta'): meta_init() allocates nothing already, and device= "
                "is the real device its tensors report and are materialized on (omit it, or "
                "use 'cpu', 'cuda:0'). For PyTorch's own meta tensors, which never hold values, "
                "use `with torch.device('meta'):` instead of meta_init"
            )
        self.dtype = check_floating_dtype(
            dtype,
            arg="dtype",
            use="it is the block's default floating dtype (use torch.bfloat16, torch.float16, "
            "torch.float32 or torch.float64)",
        )
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
                stack.enter_context(process_wrappers())
                stack.enter_context(lazy_module_support())
                stack.enter_context(_FunctionMode())
                stack.enter_context(_DispatchMode())
        except BaseException:
            release_interrupts(raise_pending=False)
            self.__exit__(None, None, None)
            raise
        release_interrupts(raise_pending=False)  # a Ctrl-C held back surfaces in the block
        if tls.depth == 1:
            _run_edge_callbacks()

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
                    release_held()  # a checkpoint's mapping may go once its reader closes
                    flush_all()
                    value_reader().forget_all()
        finally:
            # Our SIGINT handler goes last: once the previous one is back, a Ctrl-C raises at
            # once, and it must not land before the critical section is closed.
            release_interrupts(raise_pending=False)
            if handler is not None:
                handler.__exit__(None, None, None)
            if tls.depth == 0:
                _run_edge_callbacks()
            if exc[0] is None:
                check_interrupts()  # a Ctrl-C held back in here surfaces now


protect(meta_init.__enter__, meta_init.__exit__)


# Callbacks run when a thread enters or leaves its outermost ``meta_init`` block: what an upper
# layer must do once deferred models can exist (``jupyter_metainit``'s save_pretrained
# diversion), done then rather than when the package is imported. A callback is cheap and never
# raises; it runs outside the block's critical sections.
_block_edge_callbacks: list[Callable[[], None]] = []


def at_meta_init_edges(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever a thread enters or leaves its outermost ``meta_init`` block.

    For the upper layers: install what deferred models need (a diversion of a library's method)
    the first time deferred models can exist, with no side effect at import. Idempotent per
    callback.
    """
    if callback not in _block_edge_callbacks:
        _block_edge_callbacks.append(callback)


def _run_edge_callbacks() -> None:
    for callback in tuple(_block_edge_callbacks):
        callback()


at_meta_init_edges(install_swap_tensors)
