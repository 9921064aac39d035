"""Estimates on a Llama-3-70B-sized deferred model: memory_table and dry_run, time and memory.

Compares, in the same run and each in fresh processes:
- ``memory_table`` (one row per module: dedup of tied tensors, state, training estimates) against
  ``accelerate.utils.compute_module_sizes`` (flat sizes only) and a plain parameter count;
- ``dry_run(model, (1, 4096))`` (shapes, FLOPs, activations, peak) against a bare forward on
  ``meta`` tensors and a forward under torch's ``FlopCounterMode`` alone.
Targets: memory_table <= 0.2 s; dry_run without allocating activations (process RSS < 1 GB).

    .venv/bin/python benchmarks/bench_estimates.py            # full (~1-2 min)
    .venv/bin/python benchmarks/bench_estimates.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

import time
from typing import Any

from _common import (
    LLAMA_70B,
    Meter,
    MiB,
    base_parser,
    build_causal_lm,
    child_main,
    environment_line,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    llama_config,
    load_core,
    median_result,
    peak_rss_bytes,
    print_errors,
    print_table,
    run_children,
    verdict,
)

TABLE_METHODS = {
    "memory_table": "memory_table (meta_init model)",
    "memory_table_meta": 'memory_table (torch.device("meta") model)',
    "compute_module_sizes": "accelerate compute_module_sizes",
    "param_count": "sum(p.numel() for p in parameters())",
}
FORWARD_METHODS = {
    "dry_run": "dry_run (meta_init model)",
    "dry_run_meta": 'dry_run (torch.device("meta") model)',
    "bare_forward": "bare forward on meta tensors",
    "flop_counter": "FlopCounterMode forward on meta tensors",
}


def _build(config: dict[str, Any], deferred: bool) -> Any:
    import torch

    ctx = load_core().meta_init() if deferred else torch.device("meta")
    with ctx:
        return build_causal_lm(llama_config(**config))


def table_time(method: str, config: dict[str, Any], calls: int) -> dict[str, Any]:
    """Median wall time of ``calls`` calls on one model (the first call is a warm-up)."""
    from accelerate.utils import compute_module_sizes

    from jupyter_metainit.estimates import memory_table

    model = _build(config, deferred=method != "memory_table_meta")
    fn = {
        "memory_table": memory_table,
        "memory_table_meta": memory_table,
        "compute_module_sizes": compute_module_sizes,
        "param_count": lambda m: sum(p.numel() for p in m.parameters()),
    }[method]
    fn(model)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(model)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"seconds": times[(len(times) - 1) // 2], "modules": sum(1 for _ in model.modules())}


def forward(method: str, config: dict[str, Any], tokens: list[int]) -> dict[str, Any]:
    """One forward at ``tokens`` shape, measured with Meter (time, extra RSS)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from jupyter_metainit.estimates import dry_run

    model = _build(config, deferred=method == "dry_run")
    shape = tuple(tokens)
    meter = Meter()
    out: dict[str, Any] = {}
    with meter():
        if method in ("dry_run", "dry_run_meta"):
            table = dry_run(model, shape)
            root = table.loc[""]
            out = {
                "flops": int(root["flops"]),
                "peak_activation": table.attrs["dry_run"]["peak_activation_bytes"],
                "output_shape": list(root["output_shape"]),
            }
        else:
            ids = torch.empty(shape, dtype=torch.long, device="meta")
            with torch.no_grad():
                if method == "flop_counter":
                    with FlopCounterMode(display=False) as counter:
                        model(ids)
                    out = {"flops": int(counter.get_total_flops())}
                else:
                    model(ids)
    return meter.as_dict() | out | {"process_peak": peak_rss_bytes()}


MEASUREMENTS = {"table_time": table_time, "forward": forward}


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    config = dict(LLAMA_70B)
    tokens = [1, 4096]
    if args.quick:
        config.update(num_hidden_layers=2, vocab_size=1024)
        tokens = [1, 64]
    repeats = args.repeats or (1 if args.quick else 3)
    calls = 3 if args.quick else 11
    print("# bench_estimates: memory_table and dry_run on a Llama-3-70B-sized deferred model")
    print(
        f"{environment_line()}; config {config}; tokens {tokens}; "
        f"{repeats} fresh process(es) per method"
    )

    jobs = [
        ("table_time", {"method": m, "config": config, "calls": calls})
        for m in TABLE_METHODS
        for _ in range(repeats)
    ]
    jobs += [
        ("forward", {"method": m, "config": config, "tokens": tokens})
        for m in FORWARD_METHODS
        for _ in range(repeats)
    ]
    results = run_children(__file__, jobs, separate=not args.quick)
    names = list(TABLE_METHODS) + list(FORWARD_METHODS)
    by = {m: median_result(results[i * repeats : (i + 1) * repeats]) for i, m in enumerate(names)}

    ref = by["compute_module_sizes"]
    rows = []
    for m, label in TABLE_METHODS.items():
        r = by[m]
        if "error" in r:
            rows.append([label, "n/a", "n/a", "error (below)"])
            continue
        ratio = r["seconds"] / ref["seconds"] if "error" not in ref else None
        rows.append([label, fmt_s(r["seconds"]), fmt_ratio(ratio), f"{r['modules']:,}"])
    print_table(
        f"Per-module sizes (median of {calls} calls, median of fresh processes)",
        ["method", "time", "time vs compute_module_sizes", "modules"],
        rows,
    )

    bare = by["bare_forward"]
    rows = []
    for m, label in FORWARD_METHODS.items():
        r = by[m]
        if "error" in r:
            rows.append([label, "n/a", "n/a", "n/a", "n/a", "n/a"])
            continue
        ratio = r["seconds"] / bare["seconds"] if "error" not in bare else None
        rows.append(
            [
                label,
                fmt_s(r["seconds"]),
                fmt_ratio(ratio),
                fmt_mb(r["peak_extra"]),
                fmt_mb(r["process_peak"]),
                f"{r['flops']:,}" if "flops" in r else "",
            ]
        )
    print_table(
        f"Forward at {tokens[0]} x {tokens[1]} tokens (median of fresh processes)",
        ["method", "time", "time vs bare forward", "peak extra RSS", "process peak RSS", "FLOPs"],
        rows,
    )
    ours, ours_table = by["dry_run"], by["memory_table"]
    ok_table = None if "error" in ours_table else ours_table["seconds"] <= 0.2
    ok_rss = None if "error" in ours else ours["process_peak"] < 1024 * MiB
    if "error" not in ours:
        print(
            f"dry_run: logits {ours['output_shape']}, peak activations "
            f"{fmt_mb(ours['peak_activation'])} (what a real forward would hold)"
        )
    print(f"target memory_table <= 0.2 s: {verdict(ok_table)}")
    print(f"target dry_run process peak RSS < 1 GB: {verdict(ok_rss)}")
    print_errors({label: by[m] for m, label in {**TABLE_METHODS, **FORWARD_METHODS}.items()})


if __name__ == "__main__":
    main()
