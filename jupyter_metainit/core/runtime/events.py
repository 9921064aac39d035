"""Tensors changed state: whatever shows them (the widget) wants to know, whoever changed them.

``materialize``, ``dematerialize`` (and through them the magics, widgets and
``materialize_sharded``) publish the tensor objects they changed; a subscriber checks whether
any is one it shows. Subscribers are held weakly, so a view that is gone costs nothing, and a
subscriber that raises is dropped from that delivery without affecting the caller.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.runtime.interrupts import critical

__all__ = ["publish", "subscribe"]

Callback = Callable[[str, list[torch.Tensor]], None]
_subscribers: list[Any] = []  # weakref.WeakMethod or weakref.ref
_lock = threading.Lock()


def subscribe(callback: Callback) -> None:
    """Call ``callback(kind, tensors)`` after every change; held weakly (bound methods too)."""
    ref: Any = (
        weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
    )
    with critical(), _lock:
        _subscribers.append(ref)


def publish(kind: str, tensors: list[torch.Tensor]) -> None:
    """Tell every live subscriber that ``tensors`` were ``kind`` (``"materialized"``, ...)."""
    if not tensors:
        return
    with critical(), _lock:
        live = [(ref, ref()) for ref in _subscribers]
        _subscribers[:] = [ref for ref, fn in live if fn is not None]
    for _ref, fn in live:
        if fn is None:
            continue
        with contextlib.suppress(Exception):  # a view's problem is not the caller's
            fn(kind, tensors)
