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

    It is a ``RuntimeError`` (as it always was); argument errors are also ``ValueError`` or
    ``TypeError``.
    """


class ArgumentError(MetaInitError, ValueError):
    """An argument has the right type but a value the function cannot use (``dtype="bf17"``)."""


class ArgumentTypeError(MetaInitError, TypeError):
    """An argument has a type the function does not take (``pin=3`` where a dict is needed)."""


class UnsupportedOperatorError(MetaInitError):
    """An operator cannot run on deferred tensors (it has no meta kernel)."""


class DeferredDataError(MetaInitError):
    """Real values of a deferred tensor were needed and cannot be computed."""


class MaterializationError(MetaInitError):
    """Materialization failed; every tensor it touched is still deferred."""


class BusyError(MetaInitError):
    """Another materialization (or value read) of deferred tensors is running."""


class NotEnoughMemoryError(MaterializationError, MemoryError):
    """The device ran out of memory while materializing; everything is still deferred."""
