"""Resident memory over build -> materialize -> del cycles, as a notebook re-runs a cell.

Each method runs in a fresh process that builds a ~96 MiB model (24 ``nn.Linear(1024, 1024)``),
makes it real and deletes it, ``--cycles`` times (45 by default), and reads its resident memory
(RSS) after every ``del`` and garbage collection:
- eager: ``torch.manual_seed(0); model = build()``;
- exact / fast: ``with meta_init(): model = build()``, then ``materialize(model, rng=...)``;
- exact, trimming off: the same as exact with the package's heap trimming disabled
  (``core/runtime/heap``): what glibc alone keeps.
The exact process also checks its last model against an eager one with ``torch.equal``.

Target: RSS after every cycle within 1.2 x eager's, for exact and fast.

    .venv/bin/python benchmarks/bench_memory_cycles.py            # ~1 min
    .venv/bin/python benchmarks/bench_memory_cycles.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from _common import (
    MiB,
    base_parser,
    child_main,
    environment_line,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    load_core,
    print_errors,
    print_table,
    rss_bytes,
    run_children,
    verdict,
)

MODES = ["eager", "exact", "fast", "exact, trimming off"]
SHOWN_CYCLES = [1, 2, 3, 5, 10, 20, 30, 45]


def cycles(mode: str, cycles: int, layers: int, width: int) -> dict[str, Any]:
    import torch
    from torch import nn

    mi = load_core()
    if mode == "exact, trimming off":
        from jupyter_metainit.core.runtime import heap

        heap._trim, heap._trim_looked_up = None, True
    rng = mode.split(",")[0]

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    rss, seconds = [], []
    same = None
    for i in range(cycles):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        if mode == "eager":
            model = build()
        else:
            with mi.meta_init():
                model = build()
            mi.materialize(model, rng=rng)
        seconds.append(time.perf_counter() - t0)
        if i == cycles - 1 and rng == "exact":
            got = model.state_dict()
            torch.manual_seed(0)
            ref = build().state_dict()
            same = all(torch.equal(ref[k], got[k]) for k in ref)
            del got, ref
        del model
        gc.collect()
        rss.append(rss_bytes())
    return {"rss": rss, "seconds": seconds, "equal": same}


MEASUREMENTS = {"cycles": cycles}


def main() -> None:
    child_main(MEASUREMENTS)
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=45)
    args = parser.parse_args()
    n = 3 if args.quick else args.cycles
    layers, width = (2, 64) if args.quick else (24, 1024)
    model_bytes = layers * (width * width + width) * 4
    print("# bench_memory_cycles: RSS after each build -> materialize -> del cycle")
    print(f"{environment_line()}; {layers} x nn.Linear({width}, {width}) "
          f"({model_bytes / MiB:,.1f} MiB); {n} cycles; one fresh process per method")  # fmt: skip
    jobs = [("cycles", {"mode": m, "cycles": n, "layers": layers, "width": width}) for m in MODES]
    results = dict(zip(MODES, run_children(__file__, jobs, separate=not args.quick), strict=True))
    eager = results["eager"]
    shown = [c for c in SHOWN_CYCLES if c <= n] + ([n] if n not in SHOWN_CYCLES else [])
    rows = []
    for c in shown:
        row: list[Any] = [str(c)]
        for m in MODES:
            r = results[m]
            row.append("n/a" if "error" in r else fmt_mb(r["rss"][c - 1]))
        rows.append(row)
    print_table("RSS after each cycle's del", ["cycle", *MODES], rows)
    summary = []
    ok: dict[str, bool | None] = {}
    for m in MODES:
        r = results[m]
        if "error" in r or "error" in eager:
            summary.append([m, "n/a", "n/a", "n/a"])
            ok[m] = None
            continue
        worst = max(a / b for a, b in zip(r["rss"], eager["rss"], strict=True))
        ok[m] = worst <= 1.2
        growth = (r["rss"][-1] - r["rss"][0]) / max(1, n - 1)
        summary.append([m, fmt_ratio(worst), fmt_mb(growth),
                        fmt_s(statistics.median(r["seconds"][1:] or r["seconds"]))])  # fmt: skip
    print_table(
        "Against eager",
        ["method", "worst RSS / eager's (same cycle)", "growth per cycle",
         "median cycle time (build + materialize)"],
        summary,
    )  # fmt: skip
    exact = results["exact"]
    if "error" not in exact:
        print(f"torch.equal of the last exact model with eager's: {exact['equal']}")
    print(f"target exact RSS within 1.2 x eager's: {verdict(ok['exact'])}")
    print(f"target fast RSS within 1.2 x eager's: {verdict(ok['fast'])}")
    print_errors(results)


if __name__ == "__main__":
    main()
