"""Progress and Cancel inside one large tensor: event spacing, cancel latency, cost of the steps.

A 1.6 GB float32 tensor (400 M elements, made by ``normal_``) is materialized (``rng="exact"``
and ``"fast"``) and saved (safetensors, as recorded and cast to bfloat16), each in a fresh
process, with a progress callable that notes when it is called:

- events inside: calls told while the tensor was being made (strictly between 0 and the
  total), and the largest and median time between two calls, from the start to the last call
  (100 %); "after 100 %" is the time from that call to the return (freeing, putting the files
  in place: nothing left to cancel);
- cancel latency: a second run whose callable raises once a flag is set from another thread
  (at about 40 % of the first run's time); the time from the flag to the exception coming out,
  and whether the tensor is still deferred (materialize) or nothing is left (save).

The cost of the steps: the same fill, on already-touched memory in one process, made as before
(each chunk one kernel call: ``split_fill.STEP_ELEMENTS`` set past the tensor) and in steps,
alternating, best of several, in wall and CPU time (all threads: the steadier on a busy
machine); exact (the eager stream cut across the cores) and fast (the op's own generator) alike,
as ``split_fill`` makes both.

Targets: an event at least every 0.5 s of work; a Cancel in effect within 1 s; the steps cost
under 2 % of the fill.

    .venv/bin/python benchmarks/bench_progress.py            # full (~1-2 min, 1.6 GB)
    .venv/bin/python benchmarks/bench_progress.py --quick    # smoke run, 64 MiB
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from _common import (
    base_parser,
    child_main,
    environment_line,
    fmt_s,
    load_core,
    print_errors,
    print_table,
    run_children,
    verdict,
)

ELEMENTS = 400_000_000  # 1.6 GB in float32
QUICK_ELEMENTS = 16 << 20


class _Cancelled(Exception):
    pass


def _deferred_weight(n: int) -> Any:
    import torch
    from torch import nn

    mi = load_core()
    torch.manual_seed(0)
    with mi.meta_init():
        module = nn.Module()
        module.w = nn.Parameter(torch.empty(n).normal_(std=0.02))
    return module


def _action(kind: str, rng: str, dtype: str | None, directory: str) -> Any:
    """``action(module, progress)``: the materialize or save measured."""
    import torch

    mi = load_core()
    if kind == "materialize":
        return lambda module, progress: mi.materialize(module, rng=rng, progress=progress)
    from jupyter_metainit.saving import save

    cast = getattr(torch, dtype) if dtype else None
    return lambda module, progress: save(module, directory, dtype=cast, progress=progress)


def _timed_run(action: Any, n: int) -> dict[str, Any]:
    module = _deferred_weight(n)
    calls: list[tuple[float, int, int]] = []
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        calls.append((time.perf_counter() - start, done, total))

    action(module, progress)
    seconds = time.perf_counter() - start
    times = [0.0] + [t for t, *_ in calls]  # to the last call: 100 %, the work done
    gaps = [b - a for a, b in itertools.pairwise(times)]
    inside = [t for t, done, total in calls if 0 < done < total]
    return {"seconds": seconds, "calls": len(calls), "inside": len(inside), "max_gap": max(gaps),
            "median_gap": statistics.median(gaps), "tail": seconds - times[-1]}  # fmt: skip


def _cancel_run(action: Any, n: int, after: float, kind: str, directory: str) -> dict[str, Any]:
    mi = load_core()
    module = _deferred_weight(n)
    flag = threading.Event()
    flagged: list[float] = []

    def progress(done: int, total: int) -> None:
        if flag.is_set():
            raise _Cancelled

    def cancel() -> None:
        flagged.append(time.perf_counter())
        flag.set()

    timer = threading.Timer(after, cancel)
    timer.start()
    try:
        action(module, progress)
        latency = None  # finished before the flag was seen
    except _Cancelled:
        latency = time.perf_counter() - flagged[0]
    timer.cancel()
    clean = (mi.is_deferred(module.w) if kind == "materialize"
             else not os.path.exists(directory) or not os.listdir(directory))  # fmt: skip
    return {"cancel_at": after, "latency": latency, "clean": clean}


def progress_and_cancel(kind: str, rng: str, dtype: str | None, n: int) -> dict[str, Any]:
    """One fresh process: a run noting the progress calls, then a run cancelled part-way."""
    import gc

    directory = os.path.join(tempfile.mkdtemp(prefix="bench_progress_"), "ckpt")
    try:
        action = _action(kind, rng, dtype, directory)
        # once per process, PyTorch imports torch.distributed.tensor (2-7 s) at the first
        # detach of a deferred tensor: not what is measured here
        _action(kind, rng, dtype, directory + "-warm")(_deferred_weight(1024), None)
        out = _timed_run(action, n)
        shutil.rmtree(directory, ignore_errors=True)
        gc.collect()
        out.update(_cancel_run(action, n, 0.4 * out["seconds"], kind, directory))
        return out
    finally:
        shutil.rmtree(os.path.dirname(directory), ignore_errors=True)


def step_cost(n: int, rounds: int) -> dict[str, Any]:
    """Best time of the same ``split_fill`` made as before (one kernel call per chunk) and in
    steps, alternating, on memory touched beforehand; exact and fast generators alike."""
    import torch

    from jupyter_metainit.core.rng import split_fill

    aten = torch.ops.aten
    target = torch.zeros(n)

    def fill(t: Any, g: Any) -> Any:
        return t.normal_(0.0, 0.02, generator=g)

    in_steps = split_fill.steps
    best = {(how, clock): float("inf") for how in ("whole", "steps") for clock in ("wall", "cpu")}
    for _ in range(rounds):
        for how in ("whole", "steps"):
            # as before the steps: each chunk [a, b) one kernel call
            split_fill.steps = in_steps if how == "steps" else lambda n, a, b, *_: [(a, b)]
            gen = torch.Generator().manual_seed(0)
            wall, cpu = time.perf_counter(), time.process_time()
            split_fill.split_fill(aten.normal_.default, target, fill, gen)
            best[how, "wall"] = min(best[how, "wall"], time.perf_counter() - wall)
            best[how, "cpu"] = min(best[how, "cpu"], time.process_time() - cpu)
    split_fill.steps = in_steps
    return {f"{how}_{clock}": t for (how, clock), t in best.items()}


MEASUREMENTS = {"progress_and_cancel": progress_and_cancel, "step_cost": step_cost}

CASES = [
    ("materialize", "exact", None),
    ("materialize", "fast", None),
    ("save", "exact", None),
    ("save", "exact", "bfloat16"),
]


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    n = QUICK_ELEMENTS if args.quick else ELEMENTS
    print("# bench_progress: progress events and Cancel inside one large tensor")
    print(f"# {environment_line()}; {n * 4 / 1e9:.2f} GB float32 tensor (normal_)")
    jobs = [("progress_and_cancel", {"kind": k, "rng": r, "dtype": d, "n": n}) for k, r, d in CASES]
    jobs.append(("step_cost", {"n": n, "rounds": 2 if args.quick else 5}))
    results = run_children(__file__, jobs, separate=not args.quick)
    rows, ok_gap, ok_cancel = [], True, True
    for (kind, rng, dtype), r in zip(CASES, results, strict=False):
        what = f"{kind} rng={rng}" + (f" dtype={dtype}" if dtype else "")
        if "error" in r:
            rows.append([what] + ["n/a"] * 7)
            continue
        ok_gap = ok_gap and r["max_gap"] <= 0.5
        ok_cancel = ok_cancel and r["latency"] is not None and r["latency"] <= 1.0 and r["clean"]
        latency = fmt_s(r["latency"]) if r["latency"] is not None else "finished first"
        clean = "-" if r["latency"] is None else "yes" if r["clean"] else "NO"
        rows.append([what, fmt_s(r["seconds"]), r["inside"], fmt_s(r["median_gap"]),
                     fmt_s(r["max_gap"]), fmt_s(r["tail"]), latency, clean])  # fmt: skip
    print_table("Progress events and cancel latency",
                ["run", "time", "events inside", "median gap", "largest gap", "after 100 %",
                 "cancel latency", "left clean"], rows)  # fmt: skip
    cost = results[-1]
    if "error" not in cost:
        rows = []
        for clock in ("wall", "cpu"):
            whole, steps = cost[f"whole_{clock}"], cost[f"steps_{clock}"]
            rows.append([f"normal_ float32, {clock} time", fmt_s(whole), fmt_s(steps),
                         f"{steps / whole - 1:+.1%}"])  # fmt: skip
        print_table("Cost of the steps (split_fill, best of several, touched memory)",
                    ["fill", "one call per chunk", "in steps", "difference"], rows)  # fmt: skip
        extra = cost["steps_cpu"] / cost["whole_cpu"] - 1  # steadier on a busy machine
        print(f"target steps cost < 2 % (CPU time): {verdict(extra < 0.02)}")
    print(f"target an event every <= 0.5 s: {verdict(ok_gap)}")
    print(f"target cancel within 1 s, nothing left: {verdict(ok_cancel)}")
    named = {f"{k} {r} {d}": res for (k, r, d), res in zip(CASES, results, strict=False)}
    print_errors({**named, "step_cost": cost})


if __name__ == "__main__":
    main()
