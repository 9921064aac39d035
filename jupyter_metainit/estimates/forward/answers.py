"""What a dry run's forward read of values, replayed in a meta run of the same forward.

A forward on meta tensors stops at the first value it reads (``bool(mask.all())``,
``.item()``, ``.tolist()``) or at an op whose output's shape depends on values (``nonzero``,
a boolean mask): meta tensors hold none. A dry run under ``meta_init`` reads real values.
:class:`Answers` notes, in order, what each such read returned and the shapes such ops made;
:class:`Replay` gives the same answers to a later meta run of the same forward (the planner's
training trace), and raises :class:`Diverged` as soon as that run asks something else.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from jupyter_metainit.estimates.forward.nested import op_tensors

__all__ = ["Answers", "Diverged", "Replay", "shapes_depend_on_values"]

# The calls that turn a tensor's values into Python values.
_READS = frozenset(
    {
        torch.Tensor.__bool__,
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.__complex__,
        torch.Tensor.is_nonzero,
        torch.Tensor.equal,
        torch.equal,
        torch.is_nonzero,
    }
)


class Diverged(RuntimeError):
    """The meta run asked for a value the dry run did not read (or in another order)."""


def shapes_depend_on_values(func: Any) -> bool:
    """An ATen op whose outputs' shapes depend on its inputs' values (``nonzero``)."""
    return torch.Tag.dynamic_output_shape in getattr(func, "tags", ())


class Answers(TorchFunctionMode):
    """The values a forward read (``reads``) and the output shapes of its value-dependent ops
    (``shapes``, noted by the dry run's tracker through :meth:`note_shapes`), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[Any, Any]] = []
        self.shapes: list[tuple[Any, list[tuple[tuple[int, ...], torch.dtype]]]] = []

    def note_shapes(self, func: Any, out: Any) -> None:
        self.shapes.append((func, [(tuple(t.shape), t.dtype) for t in op_tensors(out)]))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        result = func(*args, **(kwargs or {}))
        if func in _READS:
            self.reads.append((func, result))
        return result


class Replay(TorchFunctionMode):
    """Answers a meta run's value reads with ``answers``' (:meth:`made` gives the outputs of
    its value-dependent ops, for the run's dispatch mode)."""

    def __init__(self, answers: Answers) -> None:
        super().__init__()
        self._reads: Iterator[tuple[Any, Any]] = iter(answers.reads)
        self._shapes: Iterator[tuple[Any, list]] = iter(answers.shapes)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func not in _READS:
            return func(*args, **(kwargs or {}))
        read, value = next(self._reads, (None, None))
        if read is not func:
            raise Diverged(
                f"the forward read a value ({getattr(func, '__name__', func)}) the dry run did not"
            )
        return value

    def made(self, func: Any) -> Any:
        """Meta outputs of the shapes the dry run's ``func`` made at this point."""
        noted, shapes = next(self._shapes, (None, []))
        if noted is not func:
            raise Diverged(f"{func} ran where the dry run ran {noted}")
        outs = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes]
        return outs[0] if len(outs) == 1 else tuple(outs)
