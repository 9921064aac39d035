"""Deferred construction: a Llama-3-70B-sized model, and constructors that read values.

1. The 70B model, each method in fresh processes, built twice per process: *cold* (the first
   build in the process: imports of the modeling code, first-call caches) and *warm* (the best
   of three more builds in the same process):
   - ``with torch.device("meta")``: the floor (no init recorded, nothing can be materialized);
   - ``accelerate.init_empty_weights()``: the usual alternative (parameters on meta, init lost);
   - ``jupyter_metainit.meta_init()``: deferred tensors with every init op recorded.
   Targets for meta_init: no slower than init_empty_weights, under 100 MB more resident memory.
2. Constructors that read values while they build (``nn.init.trunc_normal_`` checks its
   samples with ``.any()``): eager construction vs ``meta_init``, warm. Target: at most 1.3x.

    .venv/bin/python benchmarks/bench_construction.py            # full (~1-2 min)
    .venv/bin/python benchmarks/bench_construction.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

import contextlib
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


WARM_RUNS = 3


def construct(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """Build ``config`` under ``method``'s context: cold (first in this process), then warm (the
    best of ``WARM_RUNS`` more builds).

    The model is kept alive while measuring; memory is that of the cold build.
    """
    import torch  # noqa: F401  (imported before the baseline is taken)
    import transformers  # noqa: F401

    with contextlib.suppress(ImportError):
        import accelerate  # noqa: F401
    with contextlib.suppress(ImportError):
        import jupyter_metainit  # noqa: F401

    cfg = llama_config(**config)
    meter = Meter()
    with meter(), _context(method):
        model = build_causal_lm(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    out = meter.as_dict() | {"params": n_params}
    if method == "meta_init":
        out["deferred"] = bool(load_core().is_deferred(model))
    del model
    warm_runs = []
    for _ in range(WARM_RUNS):  # the best of a few: the steady state, not another job's noise
        warm = Meter()
        with warm(), _context(method):
            model = build_causal_lm(cfg)
        warm_runs.append(warm.seconds)
        del model
    out["warm_seconds"] = min(warm_runs)
    return out


class TruncNormalBlocks:
    """24 transformer blocks initialised the ViT/Swin way: ``trunc_normal_(std=0.02)``."""

    @staticmethod
    def build(dim: int = 384, depth: int = 24) -> Any:
        import torch
        from torch import nn

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
                self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
                self.pos = nn.Parameter(torch.zeros(1, 49, dim))
                for m in self.modules():
                    if isinstance(m, nn.Linear):
                        nn.init.trunc_normal_(m.weight, std=0.02)
                        nn.init.zeros_(m.bias)
                nn.init.trunc_normal_(self.pos, std=0.02)

        return nn.Sequential(*[Block() for _ in range(depth)])


def _reading_model(name: str, quick: bool) -> Any:
    if name == "trunc_normal_ blocks":
        return lambda: TruncNormalBlocks.build(depth=2 if quick else 24)
    from _common import torchvision_models

    return getattr(torchvision_models(), name)


def reads(model: str, method: str, quick: bool = False) -> dict[str, Any]:
    """Warm construction time (the second build in this process) of a value-reading model."""
    import torch

    ctor = _reading_model(model, quick)
    torch.manual_seed(0)
    with _context(method) if method != "eager" else contextlib.nullcontext():
        ctor()
    torch.manual_seed(0)
    meter = Meter()
    with meter(), _context(method) if method != "eager" else contextlib.nullcontext():
        ctor()
    return meter.as_dict()


MEASUREMENTS = {"construct": construct, "reads": reads}
READING_MODELS = ["trunc_normal_ blocks", "swin_s", "vit_b_16"]


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
            rows.append([label, "n/a", "n/a", "n/a", "n/a", "n/a", "error (below)"])
            continue
        ok_ref = "error" not in ref
        rows.append(
            [
                label,
                fmt_s(r["seconds"]),
                fmt_ratio(r["seconds"] / ref["seconds"] if ok_ref else None),
                fmt_s(r["warm_seconds"]),
                fmt_ratio(r["warm_seconds"] / ref["warm_seconds"] if ok_ref else None),
                fmt_mb(r["peak_extra"]),
                f"{r['params'] / 1e9:.2f} B",
            ]
        )
    print_table(
        "Construction (median of fresh processes; cold = first build in the process)",
        [
            "method",
            "cold",
            "vs init_empty_weights",
            "warm",
            "vs init_empty_weights",
            "peak extra RSS (cold)",
            "params",
        ],
        rows,
    )
    ours = by_method["meta_init"]
    ok_time = ok_mem = None
    if "error" not in ours:
        if "error" not in ref:
            ok_time = (
                ours["seconds"] <= ref["seconds"] and ours["warm_seconds"] <= (ref["warm_seconds"])
            )
        ok_mem = ours["peak_extra"] < 100 * MiB
        print(f"meta_init model reports deferred: {ours.get('deferred')}")
    print(f"target time <= init_empty_weights, cold and warm: {verdict(ok_time)}")
    print(f"target peak extra RSS < 100 MB: {verdict(ok_mem)}")
    print_errors({METHODS[m]: r for m, r in by_method.items()})

    models = READING_MODELS[:1] if args.quick else READING_MODELS
    jobs = [
        ("reads", {"model": name, "method": method, "quick": args.quick})
        for name in models
        for method in ("eager", "meta_init")
        for _ in range(repeats)
    ]
    results = run_children(__file__, jobs, separate=not args.quick)
    rows, errors, ok_reads = [], {}, True
    for i, name in enumerate(models):
        eager = median_result(results[2 * i * repeats : (2 * i + 1) * repeats])
        ours = median_result(results[(2 * i + 1) * repeats : (2 * i + 2) * repeats])
        errors |= {f"{name} eager": eager, f"{name} meta_init": ours}
        if "error" in eager or "error" in ours:
            rows.append([name, "n/a", "n/a", "n/a"])
            ok_reads = False
            continue
        ratio = ours["seconds"] / eager["seconds"]
        ok_reads = ok_reads and ratio <= 1.3
        rows.append([name, fmt_s(eager["seconds"]), fmt_s(ours["seconds"]), fmt_ratio(ratio)])
    print_table(
        "Constructors that read values (trunc_normal_), warm, median of fresh processes",
        ["model", "eager", "meta_init", "ratio"],
        rows,
    )
    print(f"target meta_init <= 1.3x eager: {verdict(ok_reads)}")
    print_errors(errors)


if __name__ == "__main__":
    main()
