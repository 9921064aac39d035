"""The exceptions ``jupyter_metainit`` raises on purpose: one family under :class:`MetaInitError`.

``except jupyter_metainit.MetaInitError`` catches every one of them. Argument errors are also
the built-in exception Python code expects for them (:class:`ArgumentError` is a ``ValueError``,
:class:`ArgumentTypeError` a ``TypeError``), so ``except ValueError`` keeps working too. Every
layer raises these (upper layers import this module directly); the package root exports them.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BusyError",
    "DeferredDataError",
    "MaterializationError",
    "MetaInitError",
    "NotEnoughMemoryError",
    "UnsupportedOperatorError",
]


class MetaInitError(RuntimeError):
    """Base class of every error ``jupyter_metainit`` raises on purpose.

    Catch it to handle whatever the package refuses or fails at, with one ``except``: a bad
    argument, an operator that cannot be deferred, a failed materialization. It is a
    ``RuntimeError`` (as it always was); argument errors are also ``ValueError`` or
    ``TypeError``. Whatever raised it left the model as it was: deferred tensors stay deferred
    and materializable.

    Examples:
        >>> import jupyter_metainit
        >>> from torch import nn
        >>> with jupyter_metainit.meta_init():
        ...     layer = nn.Linear(4, 4)
        >>> try:
        ...     jupyter_metainit.materialize(layer, dtype="bf17")
        ... except jupyter_metainit.MetaInitError as error:
        ...     print(type(error).__name__)
        ArgumentError
        >>> jupyter_metainit.is_deferred(layer)  # a refused call changes nothing
        True
    """


class ArgumentError(MetaInitError, ValueError):
    """An argument has the right type but a value the function cannot use (``dtype="bf17"``).

    The message names the argument as you wrote it and what it accepts. It is a ``ValueError``
    too, so code that catches ``ValueError`` keeps working.

    Examples:
        >>> import jupyter_metainit
        >>> from torch import nn
        >>> with jupyter_metainit.meta_init():
        ...     layer = nn.Linear(4, 4)
        >>> try:
        ...     jupyter_metainit.materialize(layer, dtype="bf17")
        ... except ValueError as error:  # or jupyter_metainit.ArgumentError
        ...     print(error)
        dtype='bf17' is not a dtype: use a torch.dtype (torch.bfloat16) or its name ...
    """


class ArgumentTypeError(MetaInitError, TypeError):
    """An argument has a type the function does not take (``pin=3`` where a dict is needed).

    The message names the argument and the types it accepts. It is a ``TypeError`` too, so code
    that catches ``TypeError`` keeps working.

    Examples:
        >>> import jupyter_metainit
        >>> from torch import nn
        >>> with jupyter_metainit.meta_init():
        ...     layer = nn.Linear(4, 4)
        >>> try:
        ...     jupyter_metainit.materialize(layer, dtype=3)
        ... except TypeError as error:  # or jupyter_metainit.ArgumentTypeError
        ...     print(type(error).__name__)
        ArgumentTypeError
    """


class UnsupportedOperatorError(MetaInitError):
    """An operator cannot run on deferred tensors (it has no meta kernel).

    Raised where the operator is called (inside ``meta_init``, or on a deferred tensor after
    it), naming your line and what to do instead, usually: materialize first, then call it.
    Quantizing and reading a deferred tensor's storage bytes are the common cases.

    Examples:
        >>> import torch
        >>> import jupyter_metainit
        >>> with jupyter_metainit.meta_init():
        ...     weights = torch.randn(4)
        >>> try:
        ...     torch.quantize_per_tensor(weights, 0.1, 0, torch.qint8)
        ... except jupyter_metainit.UnsupportedOperatorError as error:
        ...     print(error)
        aten.quantize_per_tensor.default makes a quantized tensor, which cannot be deferred ...
        >>> jupyter_metainit.materialize(weights)  # materialize first, then quantize
        tensor([...])
    """


class DeferredDataError(MetaInitError):
    """Real values of a deferred tensor were needed and cannot be computed.

    Raised when a deferred tensor has no recorded origin to replay. The model is left as it
    was.

    Examples:
        >>> import jupyter_metainit
        >>> issubclass(jupyter_metainit.DeferredDataError, jupyter_metainit.MetaInitError)
        True
    """


class MaterializationError(MetaInitError):
    """Materialization failed; every tensor it touched is still deferred.

    The message says why and what to do: a lazy module that has not run a forward pass yet, a
    plain PyTorch meta tensor that holds no recording, a real input changed since it was
    recorded, a tensor ``dematerialize`` cannot make deferred again. Nothing was allocated or
    changed, so fix the cause and call again.

    Examples:
        >>> import jupyter_metainit
        >>> from torch import nn
        >>> with jupyter_metainit.meta_init():
        ...     lazy = nn.LazyLinear(3)  # its input size is known after a forward pass
        >>> try:
        ...     jupyter_metainit.materialize(lazy)
        ... except jupyter_metainit.MaterializationError as error:
        ...     print(type(error).__name__)
        MaterializationError
        >>> jupyter_metainit.is_deferred(lazy)
        True
    """


class BusyError(MetaInitError):
    """Another materialization (or value read) of deferred tensors is running.

    The package's own calls wait for the running one instead of raising this (one lock
    serializes ``materialize``, ``dematerialize`` and value reads across threads); it is the
    error of a caller that asks not to wait.

    Examples:
        >>> import jupyter_metainit
        >>> issubclass(jupyter_metainit.BusyError, jupyter_metainit.MetaInitError)
        True
    """


class NotEnoughMemoryError(MaterializationError, MemoryError):
    """The device ran out of memory while materializing; everything is still deferred.

    The message says how much was needed and how much is free. Materialize a smaller part, in
    a smaller dtype, or check first with ``jupyter_metainit.fits``. It is a ``MemoryError`` and
    a ``MaterializationError`` too.

    Examples:
        >>> import torch
        >>> import jupyter_metainit
        >>> with jupyter_metainit.meta_init():
        ...     huge = torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: fine while deferred
        >>> try:
        ...     jupyter_metainit.materialize(huge)
        ... except MemoryError as error:  # or jupyter_metainit.NotEnoughMemoryError
        ...     print(error)
        not enough memory on cpu to materialize a tensor of shape (4611686018427387904,): ...
        >>> jupyter_metainit.is_deferred(huge)
        True
    """
