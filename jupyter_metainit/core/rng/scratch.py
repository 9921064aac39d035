"""Running a random op on a generator of our choosing, and re-running one on scratch memory.

:func:`run_random` gives an op the generator to draw from (ops without a ``generator`` argument,
dropout, run on their device's default generator, swapped under a lock);
:func:`default_generator_for` is the generator an op draws from eagerly when it names none;
:func:`scratch_op` re-runs a recorded op on scratch memory of the same layout, which moves a
generator exactly as the op would when its draw count is not known.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.rng.segments import BurnSpec, raw_get_state, raw_set_state
from jupyter_metainit.core.runtime.interrupts import critical

__all__ = ["default_generator_for", "run_random", "scratch_op"]

aten = torch.ops.aten


def _device_default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    raise RuntimeError(f"no default generator for {device}")


def default_generator_for(device: torch.device) -> torch.Generator | None:
    """The generator an op on ``device`` without an explicit one draws from eagerly: the
    device's default CUDA generator when that GPU is present at recording; otherwise None (the
    default CPU one; also for a tensor recorded for a GPU this machine lacks, ``cuda:1`` on a
    CPU-only machine, whose values are then the CPU stream's)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    torch.cuda.init()  # fills torch.cuda.default_generators (lazily, as eager code would)
    return torch.cuda.default_generators[index]


# Random ops that have no ``generator`` argument at all (dropout, fused attention, RNNs) must
# run on a device's default generator: it is swapped for ours and restored under this lock.
_default_swap_lock = threading.Lock()


def run_random(
    call: Callable[[torch.Generator | None], Any],
    generator: torch.Generator,
    has_generator: bool,
) -> Any:
    """Run a random op drawing from ``generator``.

    Ops with a ``generator`` argument get it; the few without one (``native_dropout``) run on
    the default generator of ``generator``'s device, set to ``generator``'s state and restored
    afterwards, under a process-wide lock: the caller's RNG state is unchanged, but another
    thread drawing from that default generator at that instant would be serialized with it
    only if it also went through here.
    """
    if has_generator:
        return call(generator)
    default = _device_default_generator(generator.device)
    with critical(), _default_swap_lock:
        saved = raw_get_state(default)
        raw_set_state(default, raw_get_state(generator))
        try:
            out = call(None)
            raw_set_state(generator, raw_get_state(default))
        finally:
            raw_set_state(default, saved)
    return out


def _scratch_tensor(x: Any, device: torch.device, func: Any) -> Any:
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
        _, size, stride, dtype = x
        t = torch.empty_strided(size, stride, dtype=dtype, device=device)
        # Values every random op accepts as input (probabilities, bounds); multinomial needs
        # weights that are not all zero.
        return t.fill_(1) if func is aten.multinomial.default else t.zero_()
    if isinstance(x, list):
        return [_scratch_tensor(v, device, func) for v in x]
    if isinstance(x, tuple):
        return tuple(_scratch_tensor(v, device, func) for v in x)
    return x


def scratch_op(spec: BurnSpec, generator: torch.Generator) -> None:
    """Re-run the op on scratch memory of the same layout: exact for any op whose consumption
    does not depend on the values it reads, memory = its size."""
    device = generator.device
    args = tuple(_scratch_tensor(a, device, spec.func) for a in spec.args)
    kwargs = {k: _scratch_tensor(v, device, spec.func) for k, v in spec.kwargs.items()}
    if any(a.name == "device" for a in spec.func._schema.arguments):
        kwargs["device"] = device

    def call(gen: torch.Generator | None) -> Any:
        kw = dict(kwargs)
        if gen is not None:
            kw["generator"] = gen
        return spec.func(*args, **kw)

    run_random(call, generator, spec.has_generator)
