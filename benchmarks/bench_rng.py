"""Jumping the CPU generator (MT19937) ahead: the time of one jump, by distance.

Exact replay skips dead random writes and splits large fills across cores by jumping the
generator's state ahead instead of drawing the skipped numbers. A jump applies a polynomial
modulo MT19937's characteristic polynomial, so its time grows with the logarithm of the
distance, not with the distance: drawing 10**11 numbers one by one takes hours. "first jump" is
the first of that distance in the process (it includes one-off set-up: the first jump of all
derives the characteristic polynomial); "again" repeats the same jump.

Target: a jump of 10**11 in under 5 s, cold (the figure tests/test_mt19937.py used to assert).

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


if __name__ == "__main__":
    main()
