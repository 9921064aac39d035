"""Deferred construction of a Llama-3-70B-sized model: time and extra resident memory.

Compares, in the same run and each in fresh processes:
- ``with torch.device("meta")``: the floor (no init recorded, nothing can be materialized later);
- ``accelerate.init_empty_weights()``: the usual alternative (parameters on meta, init lost);
- ``jupyter_metainit.meta_init()``: deferred tensors with every init op recorded.

Targets for meta_init: no slower than init_empty_weights, under 100 MB more resident memory.

    .venv/bin/python benchmarks/bench_construction.py            # full (~1-2 min)
    .venv/bin/python benchmarks/bench_construction.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

import contextlib
from typing import Any

from _common import (
    LLAMA_70B,
    TINY_LLAMA,
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
    print_errors,
    print_table,
    run_children,
    verdict,
)

METHODS = {
    "meta": 'with torch.device("meta")',
    "init_empty_weights": "accelerate.init_empty_weights()",
    "meta_init": "jupyter_metainit.meta_init()",
}


def _context(method: str) -> Any:
    import torch

    if method == "meta":
        return torch.device("meta")
    if method == "init_empty_weights":
        from accelerate import init_empty_weights

        return init_empty_weights()
    if method == "meta_init":
        return load_core().meta_init()
    raise ValueError(method)


def construct(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """Build ``config`` under ``method``'s context; keep the model alive while measuring."""
    import torch  # noqa: F401  (imported before the baseline is taken)
    import transformers  # noqa: F401

    with contextlib.suppress(ImportError):
        import accelerate  # noqa: F401
    with contextlib.suppress(ImportError):
        import jupyter_metainit  # noqa: F401

    with _context(method):  # warm-up: lazy imports of the modeling code, first-call caches
        build_causal_lm(llama_config(**TINY_LLAMA))
    cfg = llama_config(**config)
    meter = Meter()
    with meter(), _context(method):
        model = build_causal_lm(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    out = meter.as_dict() | {"params": n_params}
    if method == "meta_init":
        out["deferred"] = bool(load_core().is_deferred(model))
    del model
    return out


MEASUREMENTS = {"construct": construct}


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    config = dict(LLAMA_70B)
    if args.quick:
        config.update(num_hidden_layers=2, vocab_size=1024)
    repeats = args.repeats or (1 if args.quick else 3)

    print("# bench_construction: deferred construction of a Llama-3-70B-sized model")
    print(f"{environment_line()}; config {config}; {repeats} fresh process(es) per method")
    jobs = [("construct", {"method": m, "config": config}) for m in METHODS for _ in range(repeats)]
    results = run_children(__file__, jobs, separate=not args.quick)
    by_method = {
        m: median_result(results[i * repeats : (i + 1) * repeats]) for i, m in enumerate(METHODS)
    }

    ref = by_method["init_empty_weights"]
    rows = []
    for m, label in METHODS.items():
        r = by_method[m]
        if "error" in r:
            rows.append([label, "n/a", "n/a", "n/a", "n/a", "error (below)"])
            continue
        ratio = r["seconds"] / ref["seconds"] if "error" not in ref else None
        rows.append(
            [
                label,
                fmt_s(r["seconds"]),
                fmt_ratio(ratio),
                fmt_mb(r["peak_extra"]),
                fmt_mb(r["retained_extra"]),
                f"{r['params'] / 1e9:.2f} B",
            ]
        )
    print_table(
        "Construction (median of fresh processes)",
        [
            "method",
            "time",
            "time vs init_empty_weights",
            "peak extra RSS",
            "retained RSS",
            "params",
        ],
        rows,
    )
    ours = by_method["meta_init"]
    ok_time = ok_mem = None
    if "error" not in ours:
        if "error" not in ref:
            ok_time = ours["seconds"] <= ref["seconds"]
        ok_mem = ours["peak_extra"] < 100 * MiB
        print(f"meta_init model reports deferred: {ours.get('deferred')}")
    print(f"target time <= init_empty_weights: {verdict(ok_time)}")
    print(f"target peak extra RSS < 100 MB: {verdict(ok_mem)}")
    print_errors({METHODS[m]: r for m, r in by_method.items()})


if __name__ == "__main__":
    main()
