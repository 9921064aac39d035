"""Exact random fills on all cores: one ``normal_``/``uniform_`` split at its stream offsets.

The CPU generator is one sequential MT19937 stream, so an eager ``normal_`` over a billion
elements runs on one core. But the kernels consume a fixed number of 32-bit draws per element
(``normal_`` builds its values from uniforms in blocks of 16), so the chunk of a fill that starts
at element ``a`` (a multiple of 16) starts at draw ``a * draws_per_element``: a generator moved
there by jump-ahead produces exactly the values the single stream gives at those positions, and
the last chunk ends where the single stream ends. Chunks run in threads (the kernels release the
GIL); the result is bit-identical to the serial fill, which is checked once per op and dtype in
each process before it is trusted.

Used by exact-mode replay (``_replay``) for fills on the CPU; ``fast`` mode is parallel by
construction (one stream per op).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from jupyter_metainit.core._mt19937 import jump_state
from jupyter_metainit.core._plain import plain

__all__ = ["available_cores", "split_fill"]

aten = torch.ops.aten

# op -> the chunk alignment its kernel needs (normal_ works in blocks of 16 elements)
_ALIGN = {aten.normal_.default: 16, aten.uniform_.default: 1}
_DRAWS_PER_ELEMENT = {
    torch.float32: 1,
    torch.bfloat16: 1,
    torch.float16: 1,
    torch.float64: 2,
}
# Below this many elements per chunk, a thread and a jump cost more than they save.
MIN_CHUNK = 1 << 20

_verified: dict[tuple[Any, torch.dtype], bool] = {}
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def available_cores() -> int:
    """Cores this process may run on (``taskset`` and cgroup CPU sets respected)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jmi-fill")
        return _pool


def _chunks(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    size = -(-n // parts)
    size = -(-size // align) * align
    bounds = [(a, min(n, a + size)) for a in range(0, n, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < 16:
        # normal_ takes another path below 16 elements: fold the short tail into its neighbour
        bounds.pop()
        bounds[-1] = (bounds[-1][0], n)
    return bounds


def _fill_in_chunks(
    target: torch.Tensor,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: torch.Generator,
    bounds: list[tuple[int, int]],
    per_element: int,
    parallel: bool,
) -> None:
    flat = target.view(-1)
    state = generator.get_state()
    jobs = []
    for a, b in bounds:
        gen = torch.Generator()
        gen.set_state(state)
        jobs.append((flat[a:b], gen))
        state = jump_state(state, (b - a) * per_element)
    if parallel:
        list(_executor(len(jobs)).map(lambda job: fill(*job), jobs))
    else:
        for job in jobs:
            fill(*job)
    generator.set_state(jobs[-1][1].get_state())  # the last chunk ends where the stream ends


def _split_is_exact(func: Any, dtype: torch.dtype, fill: Callable) -> bool:
    """Check once per op and dtype that chunked fills equal the serial one, values and state."""
    key = (func, dtype)
    ok = _verified.get(key)
    if ok is None:
        ok = True
        with plain():
            for n, parts in ((16 * 37 + 5, 3), (16 * 40, 4), (16 * 29 + 15, 2)):
                serial = torch.empty(n, dtype=dtype)
                chunked = torch.empty(n, dtype=dtype)
                a, b = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
                fill(serial, a)
                bounds = _chunks(n, parts, _ALIGN[func])
                _fill_in_chunks(chunked, fill, b, bounds, _DRAWS_PER_ELEMENT[dtype], False)
                same_values = torch.equal(serial.view(torch.uint8), chunked.view(torch.uint8))
                ok = ok and same_values and torch.equal(a.get_state(), b.get_state())
        _verified[key] = ok
    return ok


def split_fill(
    func: Any,
    target: Any,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: torch.Generator,
    workers: int | None = None,
) -> bool:
    """Run ``fill(target, generator)`` (an in-place ``normal_``/``uniform_``) as chunks on
    ``workers`` threads, bit-identical to the serial call, leaving ``generator`` where the serial
    call would. Returns False (and does nothing) where that is not possible or not worth it:
    another op, a non-contiguous or small tensor, a CUDA generator, or one core."""
    workers = available_cores() if workers is None else workers
    if (
        workers < 2
        or func not in _ALIGN
        or not isinstance(target, torch.Tensor)
        or target.device.type != "cpu"
        or generator.device.type != "cpu"
        or target.dtype not in _DRAWS_PER_ELEMENT
        or not target.is_contiguous()
        or target.numel() < 2 * MIN_CHUNK
    ):
        return False

    def fill_plainly(t: torch.Tensor, g: torch.Generator) -> Any:
        with plain():
            return fill(t, g)

    if not _split_is_exact(func, target.dtype, fill_plainly):
        return False
    parts = min(workers, target.numel() // MIN_CHUNK)
    bounds = _chunks(target.numel(), parts, _ALIGN[func])
    _fill_in_chunks(
        target, fill_plainly, generator, bounds, _DRAWS_PER_ELEMENT[target.dtype], True
    )
    return True
