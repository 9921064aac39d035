"""Exceptions raised by the core. All derive from :class:`MetaInitError` (a ``RuntimeError``)."""

from __future__ import annotations

__all__ = [
    "DeferredDataError",
    "MaterializationError",
    "MetaInitError",
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
