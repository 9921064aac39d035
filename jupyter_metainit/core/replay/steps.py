"""What a replay tells about its progress, also from inside one long op.

:class:`Progress` is what the run engine tells (``materialize`` turns it into bytes of memory):
each requested storage once its memory is final, phases in words, and, while an op runs that
takes long (a fill of gigabytes, made in steps: ``rng.split_fill``), how much of the requested
memory it has made so far. :func:`counting_ops` says how the bytes an op makes count there: as
the requested storages it finishes, or not at all for an intermediate; the steps still let a
Cancel from the progress callback stop the op within a step.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.graph import OpRecord, StorageRecord
from jupyter_metainit.core.runtime.interrupts import counting

__all__ = ["Progress", "bytes_written", "counting_ops"]


class Progress:
    """What a replay tells about its progress (``materialize`` turns it into bytes of memory).

    ``storage_done`` is called once per requested storage, when its last write has run: its
    memory is final. ``phase`` describes work that is not memory, in words. ``inside`` is told,
    on the replay's thread about every ``interrupts.TELL_S`` while ops run, the bytes (as
    ``share`` counts them) of requested storages made so far by ops still running; raising from
    it stops the replay within a step.
    """

    def storage_done(self, storage: StorageRecord) -> None:  # pragma: no cover - interface
        pass

    def phase(self, text: str) -> None:  # pragma: no cover - interface
        pass

    def inside(self, nbytes: int) -> None:  # pragma: no cover - interface
        pass

    def share(self, storages: list[StorageRecord]) -> int:
        """What ``storages`` count for in ``inside``: their bytes, unless told otherwise."""
        return sum(s.nbytes for s in storages)


def bytes_written(op: OpRecord, args: tuple) -> int:
    """The bytes an op makes: the tensor an in-place op writes (its real argument), else its
    outputs."""
    if op.mutates and args and isinstance(args[0], torch.Tensor):
        return args[0].nbytes
    return sum(r.storage.nbytes for r in op.outputs if r is not None)


def counting_ops(run: Any, indices: list[int], nbytes: int) -> counting:
    """The work of ops ``indices`` of ``run`` (a ``run.Run``; ``nbytes`` of memory they make),
    counted in its steps as the requested storages those ops finish (taken back when they are
    told done whole), or as raw bytes for a caller without progress (``save``'s batches)."""
    if run.progress is None:
        return counting(run.steps)
    finished = [s for i in indices for s in run.finishing.get(i, ())]
    share = run.progress.share(finished) if finished else 0
    return counting(run.steps, share / nbytes if nbytes else 0.0, take_back=True)
