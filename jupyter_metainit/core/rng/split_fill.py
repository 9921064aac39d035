"""Exact random fills on all cores: one ``normal_``/``uniform_`` split at its stream offsets.

The CPU generator is one sequential MT19937 stream, so an eager ``normal_`` over a billion
elements runs on one core. But the kernels consume a fixed number of 32-bit draws per element
(``normal_`` builds its values from uniforms in blocks of 16), so the chunk of a fill that starts
at element ``a`` (a multiple of 16) starts at draw ``a * draws_per_element``: a generator moved
there by jump-ahead produces exactly the values the single stream gives at those positions, and
the last chunk ends where the single stream ends. Chunks run in threads (the kernels release the
GIL); the result is bit-identical to the serial fill, which is checked once per op and dtype in
each process before it is trusted.

A large fill is also made in steps of :data:`STEP_ELEMENTS` on each thread, the generator running
on from one step into the next (the same facts: a step ends on a block boundary): between two
steps it counts its bytes into the caller's progress (``runtime.interrupts.current_meter``) and
stops there if the caller cancelled, so a fill of gigabytes reports as it goes and a Cancel or
Ctrl-C takes effect within milliseconds.

Used by replay (``core.replay``) for fills on the CPU, in both random modes: exact mode's
generator is the eager stream's, fast mode's the op's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from jupyter_metainit.core.rng.draws import draws_per_element
from jupyter_metainit.core.rng.mt19937 import jump_state
from jupyter_metainit.core.rng.native_fill import NATIVE_OPS, native_covers
from jupyter_metainit.core.runtime.interrupts import Meter, current_meter
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.pool import available_cores, core_pool

__all__ = [
    "ALIGN",
    "FILLS",
    "STEP_ELEMENTS",
    "cut_point",
    "fill_region",
    "fill_region_into",
    "fill_seconds",
    "split_fill",
    "split_is_exact",
    "steps",
    "worth_cutting",
]

aten = torch.ops.aten

# op -> the chunk alignment its kernel needs (normal_ works in blocks of 16 elements)
ALIGN = {aten.normal_.default: 16, aten.uniform_.default: 1}
FILLS = frozenset(ALIGN)
# Below this many elements per chunk, a jump-ahead (up to about 10 ms) costs more than the chunk's
# share of the fill saves (about 7 ns an element on one core).
MIN_CHUNK = 1 << 22
# A region fill costs a jump to its start: worth it when it skips at least this many elements
# (and their memory: a shard's peak stays its own size).
MIN_SKIP = 1 << 22
# A jump-ahead to a new distance costs about this long (its polynomial power, then applying it);
# a fill on one core, about this long an element on the native kernels and on torch's. A fill is
# cut across cores only where that saves a quarter of its time (:func:`worth_cutting`): with the
# native kernels a 64 MiB batch on two cores is made faster by one thread than by two, one of
# which jumps first.
JUMP_SECONDS = 0.015
_NATIVE_SECONDS, _TORCH_SECONDS = 1.5e-9, 6e-9


def fill_seconds(func: Any, dtype: torch.dtype, elements: int) -> float:
    """About how long a fill of ``elements`` takes on one core."""
    native = func in NATIVE_OPS and native_covers(NATIVE_OPS[func], dtype)
    return elements * (_NATIVE_SECONDS if native else _TORCH_SECONDS)


def worth_cutting(seconds: float, parts: int) -> int:
    """``parts``, or 1 where cutting ``seconds`` of fills into that many parts (each part but
    the first after a jump) would not save a quarter of the time."""
    if parts > 1 and JUMP_SECONDS + seconds / parts > 0.75 * seconds:
        return 1
    return parts


# A fill over this many elements is made in steps of about this many on each thread (about 10 to
# 30 ms each): between two, its progress is counted and a Cancel or Ctrl-C stops it. A step costs
# a few microseconds of Python.
STEP_ELEMENTS = 1 << 22

_verified: dict[tuple[Any, torch.dtype], bool] = {}


def cut_point(n: int, e: int, align: int) -> int:
    """Where a fill of ``n`` elements may be cut near element ``e``: the kernel's block boundary
    at or below it, leaving at least 16 elements on each side (``normal_`` takes another path
    below 16), or one of its ends. The one rule for a fill cut alone (here) and for a run of
    fills cut as one (``stream_fill``)."""
    e = e // align * align
    if e < 16:
        return 0
    if n - e < 16:
        return n
    return e


def _chunks(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[0, n)`` in up to ``parts`` chunks of about equal size, cut where the fill may be."""
    cuts = sorted({0, n, *(cut_point(n, n * k // parts, align) for k in range(1, parts))})
    return list(itertools.pairwise(cuts))


def steps(n: int, a: int, b: int, align: int, step: int) -> list[tuple[int, int]]:
    """``[a, b)`` of a fill of ``n`` elements in consecutive steps of about ``step`` elements,
    each ending where the fill may be cut (one generator runs on through them)."""
    out = []
    while a < b:
        stop = b if b - a <= step else max(a, min(b, cut_point(n, a + step, align)))
        if stop <= a or b - stop < 16:
            stop = b
        out.append((a, stop))
        a = stop
    return out


def _fill_in_steps(
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    flat: torch.Tensor,
    gen: torch.Generator,
    bounds: list[tuple[int, int]],
    meter: Meter | None,
) -> None:
    """``fill`` each ``flat[a:b]`` of ``bounds`` in turn from ``gen``, counting each step."""
    for a, b in bounds:
        if meter is not None:
            meter.step()
        fill(flat[a:b], gen)
        if meter is not None:
            meter.step((b - a) * flat.element_size())


def _fill_in_chunks(
    target: torch.Tensor,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: torch.Generator,
    bounds: list[tuple[int, int]],
    per_element: int,
    parallel: bool,
    align: int = 16,
    meter: Meter | None = None,
) -> None:
    """Fill chunk ``bounds`` of ``target`` from a generator jumped to each's start (on
    threads if ``parallel``), each in :func:`steps` counted by ``meter``."""
    flat = target.view(-1)
    state = generator.get_state()
    gens = [torch.Generator() for _ in bounds]

    def run(k: int) -> None:
        a, b = bounds[k]
        # Each chunk's thread jumps to its start itself (a jump takes 10 ms to a second, the
        # first in a process the longest): the first chunk fills meanwhile, progress is told.
        gens[k].set_state(jump_state(state, a * per_element) if a else state)
        _fill_in_steps(fill, flat, gens[k], steps(flat.numel(), a, b, align, STEP_ELEMENTS), meter)

    if parallel:
        meter = meter or current_meter()
        meter.wait([core_pool(len(bounds)).submit(run, k) for k in range(len(bounds))])
    else:
        for k in range(len(bounds)):
            run(k)
    generator.set_state(gens[-1].get_state())  # the last chunk ends where the stream ends


def split_is_exact(func: Any, dtype: torch.dtype, fill: Callable) -> bool:
    """Check once per op and dtype that chunked fills equal the serial one, values and state."""
    key = (func, dtype)
    ok = _verified.get(key)
    if ok is None:
        ok = True
        align = ALIGN[func]
        with plain():
            for n, parts in ((16 * 37 + 5, 3), (16 * 40, 4), (16 * 29 + 15, 2)):
                serial = torch.empty(n, dtype=dtype)
                a = torch.Generator().manual_seed(n)
                fill(serial, a)
                for how in ("chunks", "steps"):  # jumped to each chunk; one generator on
                    cut = torch.empty(n, dtype=dtype)
                    b = torch.Generator().manual_seed(n)
                    bounds = _chunks(n, parts, align)
                    if how == "chunks":
                        _fill_in_chunks(cut, fill, b, bounds, draws_per_element(dtype), False)
                    else:
                        _fill_in_steps(fill, cut, b, bounds, None)
                    same_values = torch.equal(serial.view(torch.uint8), cut.view(torch.uint8))
                    ok = ok and same_values and torch.equal(a.get_state(), b.get_state())
        _verified[key] = ok
    return ok


def _plainly(fill: Callable[[torch.Tensor, torch.Generator], Any]) -> Callable:
    """``fill`` run with every interception off (it is called from replay and from threads)."""

    def run(t: torch.Tensor, g: torch.Generator) -> Any:
        with plain():
            return fill(t, g)

    return run


def _fillable(func: Any, t: Any, generator: torch.Generator) -> bool:
    """A fill this module can cut: ``normal_``/``uniform_`` of a contiguous CPU tensor of a
    dtype with a known draw count, from a CPU generator."""
    return (
        func in ALIGN
        and isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and generator.device.type == "cpu"
        and draws_per_element(t.dtype) is not None
        and t.is_contiguous()
    )


def _covering(func: Any, n: int, lo: int, hi: int) -> tuple[int, int]:
    """The elements to generate for ``[lo, hi)`` of a fill of ``n``: widened to the kernel's
    blocks, to the fill's end when a partial last block is near (it is redrawn), and to at
    least 16 elements (shorter fills take another kernel path)."""
    align = ALIGN[func]
    start = max(0, lo) // align * align
    end = min(n, -(-hi // align) * align)
    if n - end < 16:
        end = n
    if end == n and n - start < 16:
        start = max(0, n - 16) // align * align
    if end - start < 16 and end != n:
        end = min(n, start + 16 * align)
    return start, end


def split_fill(
    func: Any,
    target: Any,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: torch.Generator,
    workers: int | None = None,
) -> bool:
    """Run ``fill(target, generator)`` (an in-place ``normal_``/``uniform_``) as chunks on
    ``workers`` threads, each in steps counted into the caller's progress (which may stop it),
    bit-identical to the serial call, leaving ``generator`` where the serial call would.
    Returns False (and does nothing) where that is not possible or not worth it: another op, a
    non-contiguous or small tensor, a CUDA generator. On one core a large fill is still made
    here, in steps on this thread."""
    if not _fillable(func, target, generator) or target.numel() <= STEP_ELEMENTS:
        return False  # checked first: most fills are small, and the core count is a syscall
    n = target.numel()
    workers = available_cores() if workers is None else workers
    fill_plainly = _plainly(fill)
    if not split_is_exact(func, target.dtype, fill_plainly):
        return False
    parts = worth_cutting(fill_seconds(func, target.dtype, n), max(1, min(workers, n // MIN_CHUNK)))
    bounds = _chunks(n, parts, ALIGN[func])
    _fill_in_chunks(
        target,
        fill_plainly,
        generator,
        bounds,
        draws_per_element(target.dtype),
        parts > 1,
        ALIGN[func],
        current_meter(),
    )
    return True


def fill_region(
    func: Any,
    target: Any,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: torch.Generator,
    region: tuple[int, int],
    workers: int | None = None,
) -> bool:
    """Fill only elements ``region = (lo, hi)`` of ``target`` with the values the whole fill
    would put there. The rest of ``target`` is left unwritten: its pages are never touched, so a
    rank that needs only its shard of a parameter holds (and spends time on) only that.
    ``generator`` is not moved: the caller knows the whole fill's draw count and moves it past
    (merged with its next jump). Returns False (doing nothing) where this is not exact, not
    possible or not worth it."""
    if not _fillable(func, target, generator):
        return False
    n = target.numel()
    align, per = ALIGN[func], draws_per_element(target.dtype)
    lo, hi = _covering(func, n, *region)
    if n - (hi - lo) < MIN_SKIP:
        return False
    fill_plainly = _plainly(fill)
    if not split_is_exact(func, target.dtype, fill_plainly):
        return False
    start = torch.Generator()
    start.set_state(jump_state(generator.get_state(), lo * per))
    workers = available_cores() if workers is None else workers
    parts = max(1, min(workers, (hi - lo) // MIN_CHUNK))
    part = target.view(-1)[lo:hi]
    bounds = _chunks(hi - lo, parts, align)
    _fill_in_chunks(part, fill_plainly, start, bounds, per, parts > 1, align, current_meter())
    return True


# A fused fill works through a scratch buffer of at most this many elements per thread.
SCRATCH_ELEMENTS = 1 << 20


def fill_region_into(
    func: Any,
    numel: int,
    dst: torch.Tensor,
    first: int,
    fill: Callable[[torch.Tensor, torch.Generator], Any],
    generator: torch.Generator,
    workers: int | None = None,
    at_end: Callable[[torch.Tensor], None] | None = None,
) -> bool:
    """Write into ``dst`` the elements ``first .. first + dst.numel()`` of a whole fill of
    ``numel`` elements (of ``dst``'s dtype), without ever holding the whole: the part is
    generated through a small scratch buffer per thread and copied over. This is how a rank
    gets its shard of a parameter (the fill, then ``copy_`` of a slice) at the memory of the
    shard. ``generator`` (at the whole fill's start) is not moved. When the part runs to the
    fill's end, ``at_end`` gets the generator state there (the state after the whole fill: the
    next fill of the stream starts from it without a jump). False if not possible."""
    if not _fillable(func, dst, generator):
        return False
    align, per = ALIGN[func], draws_per_element(dst.dtype)
    lo, hi = first, first + dst.numel()
    start, end = _covering(func, numel, lo, hi)
    fill_plainly = _plainly(fill)
    if not split_is_exact(func, dst.dtype, fill_plainly):
        return False
    workers = available_cores() if workers is None else workers
    parts = max(1, min(workers, (end - start) // MIN_CHUNK))
    spans = [(start + a, start + b) for a, b in _chunks(end - start, parts, align)]
    out = dst.view(-1)
    state = generator.get_state()
    jobs = [(a, b, torch.Generator()) for a, b in spans]
    meter = current_meter()

    def run_span(job: tuple[int, int, torch.Generator]) -> None:
        a, b, gen = job
        gen.set_state(jump_state(state, a * per) if a else state)  # on its thread (see above)
        step = max(align, SCRATCH_ELEMENTS // align * align)
        scratch = torch.empty(step + 32 * align, dtype=dst.dtype)
        pos = a
        while pos < b:  # the generator runs on, piece after piece
            meter.step()
            stop = _direct_stop(pos, b, lo, hi, align)
            if stop is not None:  # wholly inside dst: generated in place
                cuts = steps(numel, pos, stop, align, STEP_ELEMENTS)  # at the fill's blocks
                bounds = [(x - lo, y - lo) for x, y in cuts]
                _fill_in_steps(fill_plainly, out, gen, bounds, meter)
                pos = stop
                continue
            # around dst's edges: through the scratch buffer, up to the next aligned point
            stop = min(
                b, max(pos + 16 * align, -(-lo // align) * align) if pos < lo else pos + step
            )
            if b - stop < 16:  # a last piece under 16 elements takes another kernel path
                stop = b
            piece = scratch[: stop - pos]
            fill_plainly(piece, gen)
            x, y = max(pos, lo), min(stop, hi)
            if x < y:
                out[x - lo : y - lo].copy_(piece[x - pos : y - pos])
                meter.step((y - x) * out.element_size())
            pos = stop

    if len(jobs) > 1:
        meter.wait([core_pool(len(jobs)).submit(run_span, job) for job in jobs])
    else:
        run_span(jobs[0])
    if at_end is not None and end == numel:
        at_end(jobs[-1][2].get_state())
    return True


def _direct_stop(pos: int, b: int, lo: int, hi: int, align: int) -> int | None:
    """Where a piece starting at ``pos`` that lies wholly inside ``[lo, hi)`` can end (the
    span's end, or an aligned point leaving at least 16 elements after it), else None."""
    if pos < lo or pos % align:
        return None
    if b <= hi:
        return b if b - pos >= 16 else None
    stop = hi // align * align
    while stop > pos and b - stop < 16:
        stop -= align
    return stop if stop - pos >= 16 else None
