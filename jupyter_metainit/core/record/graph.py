"""The recording: storages, the tensors that view them, and the operations that write them.

A deferred tensor holds a :class:`TensorRecord` (its geometry over a :class:`StorageRecord`).
Each storage keeps the ordered list of the operations that wrote it (the first one created it).
Records reference each other only downwards in time, so a recording lives exactly as long as a
deferred tensor (or a kept shadow) still needs it, and is freed by reference counting.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

_seq = itertools.count()


def next_seq() -> int:
    return next(_seq)


class StorageRecord:
    """A storage that will exist after replay; ``writes`` are in recording order."""

    __slots__ = ("__weakref__", "device", "dtype", "nbytes", "writes")

    def __init__(self, nbytes: int, dtype: torch.dtype, device: torch.device) -> None:
        self.writes: list[OpRecord] = []
        self.nbytes = nbytes
        self.dtype = dtype
        self.device = device


class TensorRecord:
    """Geometry of one tensor over a storage: what ``as_strided`` needs to rebuild it, plus the
    lazy conjugate/negative bits of views such as ``x.conj()`` (``conj``, ``neg``)."""

    __slots__ = ("__weakref__", "conj", "dtype", "neg", "offset", "size", "storage", "stride")

    def __init__(self, storage: StorageRecord, meta: torch.Tensor) -> None:
        self.storage = storage
        self.size = tuple(meta.shape)
        self.stride = tuple(meta.stride())
        self.offset = meta.storage_offset()
        self.dtype = meta.dtype
        self.conj = meta.is_conj()
        self.neg = meta.is_neg()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n * self.dtype.itemsize


@dataclass(eq=False, slots=True)
class External:
    """A real tensor used by a recorded op; it must not be written before replay.

    ``version`` catches in-place ops; ``digest`` (of its memory, see ``_digest``) catches the
    writes the version counter misses (``.data``, numpy views). Small real inputs are not kept
    as ``External`` at all but copied (``Constant``).
    """

    tensor: torch.Tensor
    version: int
    where: Any  # _ops.Where: str() gives "file:line in function"
    digest: tuple = ()


@dataclass(eq=False, slots=True)
class Constant:
    """Data given by the user inside ``meta_init`` (``torch.tensor([...])``), kept as is."""

    tensor: torch.Tensor


def constant_op(c: Constant) -> torch.Tensor:
    """The "op" that created a constant: replay hands back the kept tensor."""
    return c.tensor


constant_op.host_op = True  # type: ignore[attr-defined]  # runs on the CPU (see _replay)


@dataclass(eq=False, slots=True)
class RngUse:
    """Position of a random op in its generator's stream (see ``rng.streams``)."""

    segment: Any
    index: int


@dataclass(eq=False)
class OpRecord:
    """One recorded ATen call. ``args``/``kwargs`` hold records in place of tensors."""

    seq: int
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    reads: tuple[StorageRecord, ...]
    outputs: tuple[TensorRecord | None, ...]  # new storages created by this op, per return
    rng: RngUse | None
    where: Any  # _ops.Where: str() gives "file:line in function"
    # The default dtype this op's result dtype came from (an integer tensor divided by an int,
    # ``int_tensor * 0.5``), so that replay does not depend on the default in force then; None
    # for the ops (nearly all) whose result does not depend on it.
    default_dtype: torch.dtype | None = None
    mutates: tuple[StorageRecord, ...] = ()  # existing storages this op writes in place
    # Storages this op writes completely without reading them (``normal_``, ``zero_``, a
    # ``copy_`` into the whole storage): what was written there before is dead for later readers.
    overwrites: tuple[StorageRecord, ...] = ()

    # Set only on an op eager autograd made a node of (recorded in grad mode, an input
    # requiring grad): the ids of its ``TensorRecord`` arguments that required grad. A gradient
    # taken while recording (``GradCall``) replays such ops in grad mode.
    grad_args: ClassVar[frozenset[int] | None] = None

    def __hash__(self) -> int:
        return self.seq


@dataclass(eq=False)
class GradCall(OpRecord):
    """``torch.autograd.grad`` (or ``backward``) called while recording, as one op: ``args`` are
    (outputs, inputs), ``outputs`` the gradients. Replay runs the ops of ``span`` (the forward
    from ``inputs`` to the outputs, by ``seq``) in grad mode, the storages of ``leaves`` (the
    inputs') made tensors that require grad, then takes the gradient of the real tensors.
    ``span_storages``: what those ops create or write (never started from a cached value)."""

    span: frozenset[int] = frozenset()
    leaves: frozenset[int] = frozenset()
    span_storages: tuple[StorageRecord, ...] = ()

    __hash__ = OpRecord.__hash__
