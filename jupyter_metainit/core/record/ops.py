"""What the recorder needs to know about an ATen operator, computed once per overload."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any, NamedTuple

import torch

__all__ = ["OpInfo", "Where", "bind_arguments", "op_info", "user_frame"]

_RANDOM_TAG = torch.Tag.nondeterministic_seeded
_INPLACE_VIEW_TAG = torch.Tag.inplace_view
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class OpInfo:
    """Aliasing, randomness and factory facts of one ``OpOverload``, read from its schema."""

    arg_names: tuple[str, ...]
    mutated: tuple[int, ...]  # indices of arguments the op writes (in-place self, out=)
    return_alias: tuple[int | None, ...]  # per return: index of the argument it aliases
    return_writes: tuple[bool, ...]  # per return: True if the alias is a write (in-place/out)
    is_random: bool
    has_generator: bool
    # The overload of the same op that takes ``generator=`` (``rand.default`` ->
    # ``rand.generator``), for random ops without one; replay always passes its own generator.
    generator_overload: torch._ops.OpOverload | None
    returns_tensors: bool
    takes_tensors: bool  # False for factories (``empty``, ``arange``, ``full``, ...)
    dtype_index: int | None  # position of the ``dtype`` argument, if any
    is_inplace_view: bool  # ``t_``, ``squeeze_``, ``as_strided_``: change metadata, not data
    # Arguments the kernel writes although the schema does not say so (see ``_UNDECLARED``):
    # (argument index, index of the bool argument that must be true for the write, or None).
    undeclared_writes: tuple[tuple[int, int | None], ...] = ()

    def arg_index(self, name: str) -> int:
        return self.arg_names.index(name)

    def written(self, bound: list[Any]) -> tuple[int, ...]:
        """Indices of the arguments this call writes: declared ones and undeclared ones."""
        if not self.undeclared_writes:
            return self.mutated
        extra = tuple(
            i
            for i, flag in self.undeclared_writes
            if bound[i] is not None and (flag is None or bool(bound[flag]))
        )
        return self.mutated + extra


# Kernels that write inputs their schema does not mark ``(a!)``: batch norm's running
# statistics (eager updates them in place in training mode; ``_native_batch_norm_legit`` and
# ``_batch_norm_with_update`` declare the same writes). Found by running every op of PyTorch's
# op and module databases on real tensors and comparing each input before and after
# (tests/test_op_db.py keeps checking it), and by reading every schema with these argument
# names. Op name -> (written argument names, the bool argument that enables the write).
_UNDECLARED: dict[str, tuple[tuple[str, ...], str | None]] = {
    "native_batch_norm": (("running_mean", "running_var"), "training"),
    "cudnn_batch_norm": (("running_mean", "running_var"), "training"),
    "miopen_batch_norm": (("running_mean", "running_var"), "training"),
    "_batch_norm_impl_index": (("running_mean", "running_var"), "training"),
    "batch_norm": (("running_mean", "running_var"), "training"),
    "instance_norm": (("running_mean", "running_var"), "use_input_stats"),
    "batch_norm_update_stats": (("running_mean", "running_var"), None),
    "batch_norm_gather_stats": (("running_mean", "running_var"), None),
    "batch_norm_gather_stats_with_counts": (("running_mean", "running_var"), None),
}


def _undeclared_writes(
    schema: Any, names: tuple[str, ...], mutated: list[int]
) -> tuple[tuple[int, int | None], ...]:
    entry = _UNDECLARED.get(schema.name.split("::")[-1])
    if entry is None:
        return ()
    written, flag = entry
    flag_index = names.index(flag) if flag is not None and flag in names else None
    return tuple(
        (names.index(n), flag_index)
        for n in written
        if n in names and names.index(n) not in mutated
    )


_CACHE: dict[Any, OpInfo] = {}


def _is_tensor_type(t: Any) -> bool:
    return "Tensor" in str(t)


def _generator_overload(func: torch._ops.OpOverload, names: tuple[str, ...]) -> Any:
    packet = getattr(torch.ops.aten, func._schema.name.split("::")[-1], None)
    if packet is None:
        return None
    for name in packet.overloads():
        other = getattr(packet, name)
        other_names = tuple(a.name for a in other._schema.arguments)
        if (
            "generator" in other_names
            and tuple(n for n in other_names if n != "generator") == names
        ):
            return other
    return None


def op_info(func: torch._ops.OpOverload) -> OpInfo:
    info = _CACHE.get(func)
    if info is not None:
        return info
    schema = func._schema
    names = tuple(a.name for a in schema.arguments)
    sets: dict[str, int] = {}
    mutated = []
    for i, a in enumerate(schema.arguments):
        alias = a.alias_info
        if alias is None:
            continue
        for s in alias.before_set:
            sets.setdefault(s, i)
        if alias.is_write:
            mutated.append(i)
    ret_alias: list[int | None] = []
    ret_writes: list[bool] = []
    for r in schema.returns:
        alias = r.alias_info
        if alias is None:
            ret_alias.append(None)
            ret_writes.append(False)
            continue
        idx = next((sets[s] for s in alias.before_set if s in sets), None)
        ret_alias.append(idx)
        ret_writes.append(bool(alias.is_write))
    is_random = _RANDOM_TAG in func.tags
    has_generator = "generator" in names
    info = OpInfo(
        arg_names=names,
        mutated=tuple(mutated),
        return_alias=tuple(ret_alias),
        return_writes=tuple(ret_writes),
        is_random=is_random,
        has_generator=has_generator,
        generator_overload=(
            _generator_overload(func, names) if is_random and not has_generator else None
        ),
        returns_tensors=any(_is_tensor_type(r.type) for r in schema.returns),
        takes_tensors=any(_is_tensor_type(a.type) for a in schema.arguments),
        dtype_index=names.index("dtype") if "dtype" in names else None,
        is_inplace_view=_INPLACE_VIEW_TAG in func.tags,
        undeclared_writes=_undeclared_writes(schema, names, mutated),
    )
    _CACHE[func] = info
    return info


def bind_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """The op's arguments in schema order (defaults as ``None`` placeholders are not filled)."""
    names = op_info(func).arg_names
    bound = list(args) + [None] * (len(names) - len(args))
    if kwargs:
        for k, v in kwargs.items():
            if k in names:
                bound[names.index(k)] = v
    return bound


class Where(NamedTuple):
    """Where user code made a call: formatted only when an error message needs it."""

    code: CodeType | None
    line: int

    def __str__(self) -> str:
        if self.code is None:
            return "<unknown>"
        return f"{self.code.co_filename}:{self.line} in {self.code.co_name}"


_UNKNOWN = Where(None, 0)
_internal_codes: dict[CodeType, bool] = {}


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    # typing_extensions' ``@deprecated`` wrapper (quantize_dynamic has one) only passes the call on
    return (
        path.startswith((_PACKAGE_DIR, _TORCH_DIR))
        or "importlib" in path
        or os.path.basename(path) == "typing_extensions.py"
    )


def user_frame() -> Where:
    """The innermost caller outside torch and this package (``str()`` gives ``file:line in fn``).

    Called for every recorded op, so it walks raw frames and remembers per code object.
    """
    frame = sys._getframe(1)
    known = _internal_codes
    while frame is not None:
        code = frame.f_code
        internal = known.get(code)
        if internal is None:
            internal = known[code] = _is_internal(code.co_filename)
        if not internal:
            return Where(code, frame.f_lineno)
        frame = frame.f_back
    return _UNKNOWN
