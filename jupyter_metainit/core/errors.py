"""Exceptions raised by the core. All derive from :class:`MetaInitError` (a ``RuntimeError``)."""

from __future__ import annotations

__all__ = [
    "BusyError",
    "DeferredDataError",
    "MaterializationError",
    "MetaInitError",
    "NotEnoughMemoryError",
    "UnsupportedOperatorError",
]


class MetaInitError(RuntimeError):
    """Base class of every error raised by ``jupyter_metainit``."""


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
