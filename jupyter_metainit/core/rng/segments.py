"""A random stream's record: the deferred random ops that consume one generator back to back.

Recording draws nothing, so each random op is stored as ``(segment, index)``
(``graph.RngUse``): op ``index`` of an :class:`RngSegment`, which starts from the generator
state ``start_state`` and keeps checkpoints (states before some ops) that replay starts from.
A :class:`BurnSpec` is enough of one op to re-run it on scratch memory.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from jupyter_metainit.core.runtime.interrupts import critical

__all__ = ["BurnSpec", "RngSegment", "live_segments", "raw_get_state", "raw_set_state"]


# The C methods themselves: while a block is active ``meta_init`` wraps ``torch.Generator``'s
# ``get_state``/``set_state`` (``record.process_wrappers``) so that user code reads exact
# states; the tracking (``streams``) reads and leaves marks, and must not flush on every op.
raw_get_state = torch._C.Generator.get_state


raw_set_state = torch._C.Generator.set_state


@dataclass(frozen=True)
class BurnSpec:
    """Enough of a random op to re-run it on scratch memory: same layout, same consumption."""

    func: Any
    args: tuple  # tensors replaced by ("tensor", size, stride, dtype)
    kwargs: dict
    has_generator: bool
    nbytes: int


class RngSegment:
    """Deferred random ops that consume one generator in order, from ``start_state``."""

    def __init__(self, start_state: torch.Tensor, device: torch.device) -> None:
        self.start_state = start_state
        self.device = device
        self.specs: list[BurnSpec] = []
        self.checkpoints: dict[int, torch.Tensor] = {0: start_state}
        self._keys: list[int] = [0]
        # States after ops whose draw count depends on the values they read (``poisson``):
        # measured at recording on the real inputs, never re-derivable from scratch memory, so
        # kept when the other checkpoints are cleared.
        self.fixed: dict[int, torch.Tensor] = {}
        self.seed_key = hashlib.blake2b(start_state.numpy().tobytes(), digest_size=16).digest()
        self.lock = threading.RLock()
        _segments.add(self)

    def add_checkpoint(self, index: int, state: torch.Tensor) -> None:
        with critical(), self.lock:
            if index not in self.checkpoints:
                self.checkpoints[index] = state
                bisect.insort(self._keys, index)

    def nearest_checkpoint(self, index: int) -> int:
        with critical(), self.lock:
            return self._keys[bisect.bisect_right(self._keys, index) - 1]

    def add_fixed(self, index: int, state: torch.Tensor) -> None:
        """``state`` is where op ``index - 1`` left the generator, measured on its real inputs."""
        with critical(), self.lock:
            self.fixed[index] = state
            self.checkpoints[index] = state
            if index not in self._keys:
                bisect.insort(self._keys, index)

    def clear_checkpoints(self) -> None:
        with critical(), self.lock:
            self.checkpoints = {0: self.start_state, **self.fixed}
            self._keys = sorted(self.checkpoints)


_segments: weakref.WeakSet[RngSegment] = weakref.WeakSet()


def live_segments() -> list[RngSegment]:
    return list(_segments)
