"""Eager's dtype errors during a dry run, which meta kernels do not raise.

A dry run on deferred or meta tensors would otherwise succeed where the real forward fails
(``mm`` of int64 by float32); :class:`EagerDtypeChecks` asks the real CPU kernel once per op
signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.nn.parameter import is_lazy

from jupyter_metainit.core import plain
from jupyter_metainit.estimates.forward.nested import map_tensors, tensors_in

__all__ = ["EagerDtypeChecks", "run_past_cuda_only_meta_checks"]

# Meta kernels that carry the CUDA kernel's dtype checks, which the CPU kernel does not have:
# the dtype their meta kernel takes. ``_grouped_mm`` (MoE experts in transformers) computes in
# float32 on the CPU, while its meta kernel refuses anything but bfloat16.
# Looked up by capability: torch 2.6 has no ``_grouped_mm``, and an op it lacks needs no entry.
_CUDA_ONLY_META_DTYPE = {
    getattr(torch.ops.aten, name).default: dtype
    for name, dtype in [("_grouped_mm", torch.bfloat16)]
    if hasattr(torch.ops.aten, name)
}


def run_past_cuda_only_meta_checks(
    func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor]
) -> Any:
    """``func(*args, **kwargs)``; for an op whose meta kernel refuses dtypes its CPU kernel
    computes in, the output's shape from the meta kernel in the dtype it takes, given the dtype
    the CPU kernel returns (``out_dtype``, else the first input's). The casts are the run's own
    scratch: what the caller sees is one output, as eager makes it. ``inputs``: the tensors
    in the arguments (``op_tensors``)."""
    wanted = _CUDA_ONLY_META_DTYPE.get(func)
    if wanted is None:
        return func(*args, **kwargs)
    if all(t.dtype == wanted for t in inputs if t.is_floating_point()):
        return func(*args, **kwargs)
    eager_dtype = kwargs.get("out_dtype") or args[0].dtype

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(wanted) if t.is_floating_point() else t

    out = func(*map_tensors(args, cast), **map_tensors(kwargs, cast))
    return out.to(eager_dtype)


class EagerDtypeChecks:
    """Refuse the dtype combinations eager refuses, which meta kernels let through.

    Meta kernels check shapes but many skip the dtype checks of the real ones (``mm``,
    ``addmm``, ``conv``, ``layer_norm``, ``index_select`` ... accept int64 against float32).
    Each ATen op is probed once per signature (its tensor arguments' dtypes and devices) with
    the real CPU kernel on zero-filled tensors of the same dtypes: the real shapes when they are
    small, else every dimension 1. A probe error about dtypes is eager's error and is raised;
    any other probe error (a shape the shrunken probe cannot take) says nothing and is ignored.
    Random ops (their draws) and non-ATen ops (collectives) are never probed.
    """

    _SMALL = 1 << 16  # elements: probe with the real shapes below this
    # torch's dtype checks say one of these ("not implemented for 'Long'": a kernel's dtypes)
    _DTYPE_WORDS = ("dtype", "scalar type", "datatype", "scalartype", "not implemented for '")

    # Shared by every dry run (a probe's answer depends on the signature only); bounded.
    refused: ClassVar[dict[Any, tuple[type[BaseException], str] | None]] = {}
    _MAX_SIGNATURES = 1 << 14

    @staticmethod
    def _probed(func: Any) -> bool:
        return (
            func.namespace == "aten"
            and torch.Tag.nondeterministic_seeded not in func.tags
            and "generator" not in func._schema.arguments.__repr__()
        )

    def check(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        """Raise eager's dtype error for this op, if eager has one (``tensors``: those in the
        arguments, ``op_tensors``)."""
        if not tensors or any(is_lazy(t) for t in tensors):  # shapeless until inferred
            return
        # Metadata reads without each tensor subclass's __torch_function__ (every op: cheap).
        with torch._C.DisableTorchFunctionSubclass():
            small = sum(t.numel() for t in tensors) <= self._SMALL
            key = (
                func,
                small,
                *((t.dtype, t.device.type, t.shape if small else t.dim()) for t in tensors),
            )
        if key not in self.refused:
            if len(self.refused) >= self._MAX_SIGNATURES:
                self.refused.clear()
            self.refused[key] = (
                self._probe(func, args, kwargs, small) if self._probed(func) else None
            )
        refused = self.refused[key]
        if refused is not None:
            error_type, message = refused
            raise error_type(message)

    def _probe(
        self, func: Any, args: tuple, kwargs: dict, small: bool
    ) -> tuple[type[BaseException], str] | None:
        def probe_on(device: str) -> Callable[[torch.Tensor], torch.Tensor]:
            def probe_tensor(t: torch.Tensor) -> torch.Tensor:
                shape = t.shape if small else (1,) * t.dim()
                return torch.zeros(shape, dtype=t.dtype, device=device)

            return probe_tensor

        def run(device: str) -> Any:
            to_probe = probe_on(device)
            with plain():
                return func(*map_tensors(args, to_probe), **map_tensors(kwargs, to_probe))

        with contextlib.suppress(Exception):
            # On the meta device first: an output too large to compute cheaply (`new_zeros`
            # of a big size, `repeat`) is not probed on the CPU.
            if sum(t.numel() for t in tensors_in(run("meta"))) > self._SMALL:
                return None
        try:
            run("cpu")
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as e:
            message = str(e).splitlines()[0] if str(e) else ""
            lowered = message.lower()
            if not any(word in lowered for word in self._DTYPE_WORDS):
                return None
            # "not implemented for 'Half'" is a fact about the CPU kernel; a tensor recorded
            # for another device (or a meta model, headed anywhere) may have the kernel there.
            elsewhere = any(t.device.type != "cpu" for t in tensors_in((args, kwargs)))
            if "not implemented for" in lowered and elsewhere:
                return None
            return type(e), message
        except Exception:
            return None
        return None
