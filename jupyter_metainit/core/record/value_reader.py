"""The seam through which recording gets exact values: the reader the replay stage installs.

Recording sometimes needs the values of deferred tensors (``.item()``, ``bool(t)``, an op with no
meta kernel, a random op whose draw count depends on its inputs). Computing them is replay's job,
and replay sits above recording, so recording does not import it: it asks the
:class:`ValueReader` held here. ``jupyter_metainit.core.replay`` (its ``__init__``) installs its
reader with :func:`use_value_reader` when the replay stage is imported, which importing any part
of ``jupyter_metainit.core`` does first; the import graph shows it as replay importing this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from jupyter_metainit.core.errors import MetaInitError
from jupyter_metainit.core.record.graph import StorageRecord, TensorRecord

__all__ = ["ValueReader", "use_value_reader", "value_reader"]


class ValueReader(Protocol):
    """What recording needs from the stage that computes values."""

    def values(self, records: list[TensorRecord]) -> list[torch.Tensor]:
        """The exact current values of ``records``, as new real CPU tensors."""
        ...

    def keep(self, storage: StorageRecord, writes: int, value: torch.Tensor) -> None:
        """``value`` is ``storage`` after its first ``writes`` writes (computed anyway): later
        reads may start from it."""
        ...

    def forget_all(self) -> None:
        """Drop every kept value (the outermost ``meta_init`` block has ended)."""
        ...

    def real_view(self, record: TensorRecord, grad: bool) -> torch.Tensor | None:
        """The real tensor ``record`` now views: a view of the memory an earlier
        ``materialize`` made of its storage, while nothing was recorded on it since (an op on
        such a deferred view runs on that memory, as eagerly); else ``None``, the common case,
        answered without a look-up when no storage was made real. With ``grad``, a view of the
        real tensor itself (its autograd graph reaches it); else a detached one."""
        ...


class _NoReader:
    def values(self, records: list[TensorRecord]) -> list[torch.Tensor]:
        raise MetaInitError("no value reader installed: import jupyter_metainit.core")

    def keep(self, storage: StorageRecord, writes: int, value: torch.Tensor) -> None:
        pass

    def forget_all(self) -> None:
        pass

    def real_view(self, record: TensorRecord, grad: bool) -> torch.Tensor | None:
        return None


_reader: ValueReader = _NoReader()


def use_value_reader(reader: ValueReader) -> None:
    """Install the reader recording uses from now on (called by the replay stage)."""
    global _reader
    _reader = reader


def value_reader() -> ValueReader:
    """The installed reader."""
    return _reader
