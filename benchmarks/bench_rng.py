"""Jumping the CPU generator (MT19937) ahead, by distance; the native fills against torch's.

Exact replay skips dead random writes and splits large fills across cores by jumping the
generator's state ahead instead of drawing the skipped numbers. A jump applies a polynomial
modulo MT19937's characteristic polynomial, so its time grows with the logarithm of the
distance, not with the distance: drawing 10**11 numbers one by one takes hours. "first jump" is
the first of that distance in the process (it includes one-off set-up: the first jump of all
derives the characteristic polynomial); "again" repeats the same jump.

Target: a jump of 10**11 in under 5 s, cold (the figure tests/test_mt19937.py used to assert).

The second table times the native ``normal_``/``uniform_`` (``core/rng/native_fill``) against
torch's own kernels on one thread, per element, over the same 16 M elements from the same
generator state (the best of 3 alternating pairs), and checks the bits are the same.

    .venv/bin/python benchmarks/bench_rng.py            # full (a few seconds)
    .venv/bin/python benchmarks/bench_rng.py --quick    # smoke run, small distances
"""

from __future__ import annotations

import time
from typing import Any

from _common import base_parser, environment_line, fmt_s, print_table, verdict


def jump_times(distance: int) -> dict[str, Any]:
    """Cold (first) and warm (repeated) time of one jump of ``distance`` draws."""
    import torch

    # Not public: the jump lives wherever the rng stage keeps it.
    from jupyter_metainit.core.rng.mt19937 import jump_state

    state = torch.Generator().manual_seed(11).get_state()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        jump_state(state, distance)
        times.append(time.perf_counter() - start)
    return {"cold": times[0], "warm": times[1]}


def fill_times(op: str, dtype_name: str, n: int) -> dict[str, Any]:
    """ns an element of torch's ``op`` and of the native one, one thread, and whether equal."""
    import torch

    from jupyter_metainit.core.rng.native_fill import native_normal, native_uniform

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    native = {"normal_": native_normal, "uniform_": native_uniform}[op]
    bounds = (0.0, 0.02) if op == "normal_" else (-0.05, 0.05)
    theirs, ours = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
    best = {"torch": float("inf"), "native": float("inf")}
    equal = True
    for seed in range(3):
        g_theirs, g_ours = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        getattr(theirs, op)(*bounds, generator=g_theirs)
        best["torch"] = min(best["torch"], time.perf_counter() - start)
        start = time.perf_counter()
        used = native(ours, *bounds, g_ours)
        best["native"] = min(best["native"], time.perf_counter() - start)
        equal = equal and used and torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8))
    return {k: v / n * 1e9 for k, v in best.items()} | {"equal": equal}


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    distances = [10**3, 10**6] if args.quick else [10**3, 10**6, 10**9, 10**11]
    print("# bench_rng: MT19937 jump-ahead by distance, one process")
    print(f"# {environment_line()}")
    rows, results = [], {}
    for distance in distances:
        results[distance] = jump_times(distance)
        rows.append(
            [f"{distance:.0e}", fmt_s(results[distance]["cold"]), fmt_s(results[distance]["warm"])]
        )
    print_table("Jump ahead (jump_state)", ["draws skipped", "first jump", "again"], rows)
    if 10**11 in results:
        print(f"target jump of 1e11 < 5 s cold: {verdict(results[10**11]['cold'] < 5)}")

    from jupyter_metainit.core.rng.native_fill import native_status

    print(f"# native fills: {native_status()}")
    n = 1 << 16 if args.quick else 1 << 24
    rows = []
    for op in ("normal_", "uniform_"):
        for dtype in ("float32", "bfloat16", "float16"):
            t = fill_times(op, dtype, n)
            ratio = f"{t['torch'] / t['native']:.2f}x"
            same = "yes" if t["equal"] else "NO"
            rows.append([op, dtype, f"{t['torch']:.2f} ns", f"{t['native']:.2f} ns", ratio, same])
    print_table(
        f"Fills on one thread, {n:,} elements (per element; best of 3)",
        ["op", "dtype", "torch's kernel", "native", "speed-up", "same bits"],
        rows,
    )


if __name__ == "__main__":
    main()
