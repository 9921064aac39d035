"""Exchange the contents of two tensor objects, so that every reference sees the new one.

:func:`swap_in_place` is the package's own exchange (materialize, dematerialize).
:func:`swap_tensors` is ``torch.utils.swap_tensors`` for tensors the package keeps weak references
to, put in its place when a thread first enters a ``meta_init`` block
(:func:`install_swap_tensors`; importing the package changes nothing in torch): PyTorch refuses to
swap a tensor that any weak reference points at, and the package's side tables (where a
materialized tensor's values came from, what dematerialize needs, the deferred leaf over a storage)
hold exactly such references. So ``torch.utils.swap_tensors`` on a materialized parameter, and
everything that calls it (``model.double()`` or ``.to()`` under
``torch.__future__.set_swap_module_params_on_conversion(True)``, ``load_state_dict`` then, FSDP2)
failed where it works on eager tensors. Each table registers here, saying what its entries mean
(:func:`identity_table`, :func:`content_references`, :func:`cache_by_id`); for the swap its
references to the two tensors are taken out, PyTorch's own function runs with all its other checks
(references the package does not hold still make it refuse), and they are put back."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

import torch

from jupyter_metainit.core.runtime.interrupts import critical

__all__ = [
    "ContentReferences",
    "cache_by_id",
    "content_references",
    "identity_table",
    "swap_in_place",
    "install_swap_tensors",
    "swap_tensors",
]


def swap_in_place(old: torch.Tensor, new: torch.Tensor) -> None:
    """After this call ``old`` (the object every reference points at) holds ``new``'s tensor,
    class and attributes, and ``new`` holds what ``old`` had.

    Like ``torch.utils.swap_tensors`` but without its use-count and weak-reference checks: a
    deferred tensor's implementation may also be held by views of it, which only ever see the
    deferred side, and weak references (``nn.LSTM`` keeps some to its weights) follow the object,
    whose identity is exactly what we preserve.
    """
    old_cls, new_cls = type(old), type(new)
    old.__class__, new.__class__ = new_cls, old_cls
    old_dict, new_dict = old.__dict__, new.__dict__
    old.__dict__, new.__dict__ = new_dict, old_dict
    torch._C._swap_tensor_impl(old, new)


# What a table does to let a swap of ``t`` (with ``other``) through: it drops its references
# to ``t`` and returns how to put them back, told whether the swap happened; None: it held none.
_Putback = Callable[[bool], None]
_Release = Callable[[torch.Tensor, torch.Tensor], "_Putback | None"]
_releases: list[_Release] = []
_lock = threading.RLock()

Table = TypeVar("Table", bound=MutableMapping)


def identity_table(table: Table) -> Table:
    """Register a table keyed weakly by tensor objects (``torch.utils.weak.WeakIdKeyDictionary``)
    whose entries belong to the object, whatever it holds: after a swap they are on the same
    objects, as after ``t.data = ...`` (what they say is checked against the tensor's memory
    where it matters). Returns ``table``."""

    def release(t: torch.Tensor, other: torch.Tensor) -> _Putback | None:
        if t not in table:
            return None
        value = table.pop(t)
        return lambda _swapped: table.__setitem__(t, value)

    _releases.append(release)
    return table


class ContentReferences(weakref.WeakKeyDictionary):
    """A table keyed weakly (by a storage's record) whose values are a weak reference to the
    tensor object holding some content (the real tensor over that storage, the leaf it belongs
    to), or a tuple starting with one: after ``torch.utils.swap_tensors`` the reference names
    the other object, which holds that content now. Made by :func:`content_references`; write
    entries as ``table[key] = value`` (that keeps the index a swap looks them up by)."""

    def __init__(self) -> None:
        super().__init__()
        # id of the weak reference in a value -> weak reference to its key: a swap finds the
        # entries naming a tensor among the tensor's weak references, without a scan.
        self._keys_by_reference: dict[int, weakref.ref] = {}

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._keys_by_reference[id(_reference(value))] = weakref.ref(key)
        if len(self._keys_by_reference) > 2 * len(self) + 64:  # drop what dead entries left
            self._keys_by_reference = {id(_reference(v)): weakref.ref(k) for k, v in self.items()}

    def keys_naming(self, t: torch.Tensor) -> list[Any]:
        """The keys whose value's weak reference is to ``t``."""
        keys = []
        for ref in weakref.getweakrefs(t):
            key_ref = self._keys_by_reference.get(id(ref))
            key = key_ref() if key_ref is not None else None
            value = self.get(key) if key is not None else None
            if value is not None and _reference(value) is ref:
                keys.append(key)
        return keys


def content_references() -> ContentReferences:
    """A new :class:`ContentReferences` table, registered: a swap re-points its references."""
    table = ContentReferences()

    def release(t: torch.Tensor, other: torch.Tensor) -> _Putback | None:
        found = [(key, _without_reference(table.pop(key))) for key in table.keys_naming(t)]
        if not found:
            return None

        def put_back(swapped: bool) -> None:
            for key, rest in found:
                table[key] = _with_reference(rest, other if swapped else t)

        return put_back

    _releases.append(release)
    return table


def cache_by_id(table: Table) -> Table:
    """Register a cache keyed by ``id(tensor)`` whose values are a weak reference to the tensor,
    or a tuple starting with one (a digest of its memory): a swap drops the entry, which no
    longer says anything about what the object holds. Returns ``table``."""

    def release(t: torch.Tensor, other: torch.Tensor) -> _Putback | None:
        value = table.get(id(t))
        if value is None or _reference(value)() is not t:
            return None
        del table[id(t)]
        rest = _without_reference(value)
        return lambda swapped: (
            None if swapped else table.__setitem__(id(t), _with_reference(rest, t))
        )

    _releases.append(release)
    return table


def _reference(value: Any) -> weakref.ref:
    return value if isinstance(value, weakref.ref) else value[0]


# A taken-out entry keeps no reference to the tensor (PyTorch would count it): only the rest.
def _without_reference(value: Any) -> tuple | None:
    return None if isinstance(value, weakref.ref) else tuple(value[1:])


def _with_reference(rest: tuple | None, target: torch.Tensor) -> Any:
    ref = weakref.ref(target)
    return ref if rest is None else (ref, *rest)


# PyTorch's own (this module imported again, as by importlib.reload, must not wrap its wrapper)
_torch_swap_tensors = getattr(torch.utils.swap_tensors, "_jmi_wraps", torch.utils.swap_tensors)


@functools.wraps(_torch_swap_tensors, assigned=("__module__", "__name__", "__qualname__"))
def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """``torch.utils.swap_tensors``, also for tensors the package keeps weak references to (see
    the module docstring): ``t1`` gets ``t2``'s contents and the reverse, as PyTorch does it."""
    if not (weakref.getweakrefs(t1) or weakref.getweakrefs(t2)):
        return _torch_swap_tensors(t1, t2)
    put_backs: list[_Putback] = []
    swapped = False
    with critical(), _lock:  # a Ctrl-C in the middle would lose the entries taken out
        try:
            for t, other in ((t1, t2), (t2, t1)) if t1 is not t2 else ((t1, t2),):
                for release in _releases:
                    put_back = release(t, other)
                    if put_back is not None:
                        put_backs.append(put_back)
            _torch_swap_tensors(t1, t2)
            swapped = True
        finally:
            for put_back in put_backs:
                put_back(swapped)
    return None


swap_tensors._jmi_wraps = _torch_swap_tensors  # type: ignore[attr-defined]


def install_swap_tensors() -> None:
    """Put :func:`swap_tensors` in ``torch.utils.swap_tensors`` (idempotent).

    Called when a thread first enters a ``meta_init`` block (``record/context``), the only way
    tensors the package keeps weak references to come to exist: importing the package changes
    nothing in torch.
    """
    if torch.utils.swap_tensors is not swap_tensors:
        torch.utils.swap_tensors = swap_tensors
