"""Selective materialization: one layer of an 80-layer model, exact vs fast RNG, repeated cycles.

(a) fast mode (``rng="fast"``): one decoder layer vs the whole model — time (target <= whole/80
    + 50 ms) and peak extra resident memory vs that layer's bytes (target <= 1.05x);
(b) exact mode: first layer vs last layer (the cost of reaching the right generator state),
    next to eager construction of the whole model, and torch.equal of the last layer vs eager;
(c) fast mode vs eager CPU init when the init is random-number bound (uniform_ of a stack of
    Linear layers): throughput (target >= 1.8x on 2 cores);
(d) 100 materialize/dematerialize cycles of one layer: resident memory drift.
Every measurement runs in a fresh process.

    .venv/bin/python benchmarks/bench_selective.py            # full (~3-4 min)
    .venv/bin/python benchmarks/bench_selective.py --quick    # smoke run, tiny sizes
"""

from __future__ import annotations

import gc
import time
from typing import Any

from _common import (
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
    malloc_trim,
    median_result,
    print_errors,
    print_table,
    rss_bytes,
    run_children,
    tensor_bytes,
    verdict,
)

# 80 layers of a Llama-3-70B-shaped stack, narrowed so the whole model fits: 1.34 B params, 5 GB
DEEP = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=80,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
)
QUICK_DEEP = dict(
    DEEP,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)
RNG_BOUND = dict(width=2048, depth=24)  # 100 M uniform_ draws (kaiming_uniform_ of nn.Linear)
QUICK_RNG_BOUND = dict(width=256, depth=4)


def _setup() -> tuple[Any, Any]:
    import torch
    import transformers  # noqa: F401

    mi = load_core()
    with mi.meta_init():  # warm-up: modeling imports, first materialization
        warm = build_causal_lm(llama_config(**TINY_LLAMA))
    mi.materialize(warm.model.layers[0])
    mi.materialize(warm, rng="fast")
    del warm
    mi.clear_meta_init_cache()
    return torch, mi


def _deferred_model(mi: Any, torch: Any, config: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    with mi.meta_init():
        return build_causal_lm(llama_config(**config))


# (a) and (b) ------------------------------------------------------------------------------


def one_layer(config: dict[str, Any], index: int, rng: str, check: bool = False) -> dict[str, Any]:
    """Materialize layer ``index`` alone; with ``check``, compare it to an eager build's."""
    torch, mi = _setup()
    model = _deferred_model(mi, torch, config)
    layer = model.model.layers[index]
    meter = Meter()
    with meter():
        mi.materialize(layer, rng=rng)
    out = meter.as_dict() | {"bytes": tensor_bytes(layer)}
    out["others_deferred"] = all(
        mi.is_deferred(other) for i, other in enumerate(model.model.layers) if i != index
    )
    if check:
        got = layer.state_dict()
        del model, layer
        torch.manual_seed(0)
        ref = build_causal_lm(llama_config(**config)).model.layers[index].state_dict()
        out["equal"] = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    return out


def whole(config: dict[str, Any], rng: str) -> dict[str, Any]:
    torch, mi = _setup()
    model = _deferred_model(mi, torch, config)
    meter = Meter()
    with meter():
        mi.materialize(model, rng=rng)
    return meter.as_dict() | {"bytes": tensor_bytes(model)}


def eager_whole(config: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers  # noqa: F401

    build_causal_lm(llama_config(**TINY_LLAMA))
    torch.manual_seed(0)
    meter = Meter()
    with meter():
        model = build_causal_lm(llama_config(**config))
    return meter.as_dict() | {"bytes": tensor_bytes(model)}


# (c) ---------------------------------------------------------------------------------------


def _stack(torch: Any, width: int, depth: int) -> Any:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])


def rng_bound(width: int, depth: int, mode: str) -> dict[str, Any]:
    import torch

    _stack(torch, 64, 2)  # warm-up
    torch.manual_seed(0)
    meter = Meter()
    if mode == "eager":
        with meter():
            m = _stack(torch, width, depth)
        return meter.as_dict() | {"bytes": tensor_bytes(m)}
    mi = load_core()
    with mi.meta_init():
        warm = _stack(torch, 64, 2)
    mi.materialize(warm, rng=mode)
    with mi.meta_init():
        m = _stack(torch, width, depth)
    with meter():
        mi.materialize(m, rng=mode)
    return meter.as_dict() | {"bytes": tensor_bytes(m)}


# (d) ---------------------------------------------------------------------------------------


def cycles(config: dict[str, Any], n: int, rng: str) -> dict[str, Any]:
    """``materialize(layer, keep_cache=True)`` then ``dematerialize(layer)``, ``n`` times."""
    torch, mi = _setup()
    model = _deferred_model(mi, torch, config)
    layer = model.model.layers[0]
    gc.collect()
    base = rss_bytes()
    t0 = time.perf_counter()
    mi.materialize(layer, rng=rng, keep_cache=True)
    first_seconds = time.perf_counter() - t0
    first = {k: v.clone() for k, v in layer.state_dict().items()}
    mi.dematerialize(layer)
    kept = rss_bytes() - base  # the clone of the first values, plus whatever is cached
    marks: dict[int, int] = {}
    all_deferred = True
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        mi.materialize(layer, rng=rng, keep_cache=True)
        if i == n:
            last = layer.state_dict()
            same = all(torch.equal(first[k], last[k]) for k in first)
            del last
        mi.dematerialize(layer)
        all_deferred = all_deferred and all(
            mi.is_deferred(t) for t in (*layer.parameters(), *layer.buffers())
        )
        marks[i] = rss_bytes() - base - kept
    seconds = time.perf_counter() - t0
    trimmed = None
    if malloc_trim():  # glibc keeps freed heap pages; how much of the drift is that?
        trimmed = rss_bytes() - base - kept
    early = min(10, n)
    return {
        "after_trim": trimmed,
        "seconds": seconds / n,
        "first_seconds": first_seconds,
        "bytes": tensor_bytes(layer),
        "drift_from_start": marks[n],
        "drift_after_warmup": marks[n] - marks[early],
        "early": early,
        "marks": {str(k): marks[k] for k in sorted({1, early, n // 2 or 1, n})},
        "same_values": same,
        "all_deferred": all_deferred,
    }


MEASUREMENTS = {
    "one_layer": one_layer,
    "whole": whole,
    "eager_whole": eager_whole,
    "rng_bound": rng_bound,
    "cycles": cycles,
}


def _ok(*results: dict[str, Any]) -> bool:
    return all("error" not in r for r in results)


def main() -> None:
    child_main(MEASUREMENTS)
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default="abcd", help="which of (a)-(d) to run, e.g. --parts ac")
    args = parser.parse_args()
    parts = set(args.parts)
    deep = QUICK_DEEP if args.quick else DEEP
    rb = QUICK_RNG_BOUND if args.quick else RNG_BOUND
    n_cycles = 10 if args.quick else 100
    repeats = args.repeats or (1 if args.quick else 3)
    layers = deep["num_hidden_layers"]
    mid = layers // 2
    print("# bench_selective: selective materialization")
    print(f"{environment_line()}; deep model {deep}; {repeats} fresh process(es) per measurement")

    plan: dict[str, list[tuple[str, dict[str, Any]]]] = {
        "layer_fast": [("one_layer", {"config": deep, "index": mid, "rng": "fast"})] * repeats,
        "whole_fast": [("whole", {"config": deep, "rng": "fast"})],
        # exact mode's first materialization is long (it replays the random stream): one each
        "exact_first": [("one_layer", {"config": deep, "index": 0, "rng": "exact"})],
        "exact_last": [
            ("one_layer", {"config": deep, "index": layers - 1, "rng": "exact", "check": True})
        ],
        "eager_whole": [("eager_whole", {"config": deep})],
        "rb_eager": [("rng_bound", dict(rb, mode="eager"))] * repeats,
        "rb_fast": [("rng_bound", dict(rb, mode="fast"))] * repeats,
        "rb_exact": [("rng_bound", dict(rb, mode="exact"))] * repeats,
        "cycles_fast": [("cycles", {"config": deep, "n": n_cycles, "rng": "fast"})],
        "cycles_exact": [("cycles", {"config": deep, "n": n_cycles, "rng": "exact"})],
    }
    part_of = {"layer": "a", "whole": "a", "exact": "b", "eager": "b", "rb": "c", "cycles": "d"}
    plan = {k: v for k, v in plan.items() if part_of[k.split("_")[0]] in parts}
    jobs = [job for group in plan.values() for job in group]
    flat = run_children(__file__, jobs, separate=not args.quick)
    res: dict[str, dict[str, Any]] = {}
    i = 0
    for name, group in plan.items():
        res[name] = median_result(flat[i : i + len(group)])
        i += len(group)

    # (a)
    if "a" in parts:
        lf, wf = res["layer_fast"], res["whole_fast"]
        ok_a_time = ok_a_mem = None
        rows = []
        if _ok(wf):
            rows.append(
                [
                    f"whole model ({layers} layers)",
                    fmt_s(wf["seconds"]),
                    "-",
                    fmt_mb(wf["bytes"]),
                    fmt_mb(wf["peak_extra"]),
                    fmt_ratio(wf["peak_extra"] / wf["bytes"]),
                    fmt_s(wf["cpu_seconds"]),
                ]
            )
        if _ok(lf):
            budget = wf["seconds"] / layers + 0.05 if _ok(wf) else None
            ok_a_time = lf["seconds"] <= budget if budget is not None else None
            ok_a_mem = lf["peak_extra"] <= 1.05 * lf["bytes"]
            rows.append(
                [
                    f"layer {mid} alone",
                    fmt_s(lf["seconds"]),
                    fmt_s(budget),
                    fmt_mb(lf["bytes"]),
                    fmt_mb(lf["peak_extra"]),
                    fmt_ratio(lf["peak_extra"] / lf["bytes"]),
                    fmt_s(lf["cpu_seconds"]),
                ]
            )
        print_table(
            "(a) fast mode: one decoder layer vs the whole model",
            [
                "materialize",
                "time",
                f"budget whole/{layers}+50ms",
                "bytes",
                "peak extra RSS",
                "peak RSS / bytes",
                "CPU time",
            ],
            rows or [["n/a"] * 7],
        )
        if _ok(lf):
            print(f"other layers still deferred: {lf['others_deferred']}")
        print(f"target time <= whole/{layers} + 50 ms: {verdict(ok_a_time)}")
        print(f"target peak extra RSS <= 1.05 x layer bytes: {verdict(ok_a_mem)}")

    # (b)
    if "b" in parts:
        ef, el, ew = res["exact_first"], res["exact_last"], res["eager_whole"]
        rows = []
        if _ok(ew):
            rows.append(
                [
                    "eager construction, whole model",
                    fmt_s(ew["seconds"]),
                    "-",
                    "1.000x",
                    fmt_s(ew["cpu_seconds"]),
                    fmt_mb(ew["peak_extra"]),
                ]
            )
        for label, r in (("exact, layer 0", ef), (f"exact, layer {layers - 1}", el)):
            if _ok(r):
                rows.append(
                    [
                        label,
                        fmt_s(r["seconds"]),
                        fmt_ratio(r["seconds"] / ef["seconds"]) if _ok(ef) else "n/a",
                        fmt_ratio(r["seconds"] / ew["seconds"]) if _ok(ew) else "n/a",
                        fmt_s(r["cpu_seconds"]),
                        fmt_mb(r["peak_extra"]),
                    ]
                )
            else:
                rows.append([label] + ["n/a"] * 5)
        print_table(
            "(b) exact mode: reaching the generator state of the first vs the last layer",
            [
                "materialize (fresh process)",
                "time",
                "vs layer 0",
                "vs eager whole model",
                "CPU time",
                "peak extra RSS",
            ],
            rows,
        )
        if _ok(el):
            print(f"layer {layers - 1} alone (exact) torch.equal to eager: {el['equal']}")

    # (c)
    if "c" in parts:
        rbe, rbf, rbx = res["rb_eager"], res["rb_fast"], res["rb_exact"]
        ok_c = None
        rows = []
        for label, r in (
            ("eager construction", rbe),
            ('materialize rng="exact"', rbx),
            ('materialize rng="fast"', rbf),
        ):
            if _ok(r):
                speed = (rbe["seconds"] / r["seconds"]) if _ok(rbe) else None
                rows.append(
                    [
                        label,
                        fmt_s(r["seconds"]),
                        f"{r['bytes'] / MiB / r['seconds']:,.0f} MiB/s",
                        fmt_ratio(speed),
                        fmt_s(r.get("cpu_seconds")),
                        f"{r.get('cpu_seconds', 0.0) / r['seconds']:.2f}",
                    ]
                )
            else:
                rows.append([label] + ["n/a"] * 5)
        if _ok(rbe, rbf):
            ok_c = rbe["seconds"] / rbf["seconds"] >= 1.8
        print_table(
            f"(c) random-number-bound init: {rb['depth']} x Linear({rb['width']}, "
            f"{rb['width']}), kaiming_uniform_",
            ["method", "time", "throughput", "speed-up vs eager", "CPU time", "cores busy"],
            rows,
        )
        print(f"target fast-mode speed-up >= 1.8x: {verdict(ok_c)}")

    # (d)
    if "d" in parts:
        rows = []
        for mode in ("fast", "exact"):
            cy = res[f"cycles_{mode}"]
            if _ok(cy):
                rows.append(
                    [
                        mode,
                        str(n_cycles),
                        fmt_s(cy["first_seconds"]),
                        fmt_s(cy["seconds"]),
                        fmt_mb(cy["bytes"]),
                        fmt_mb(cy["drift_from_start"]),
                        fmt_mb(cy["drift_after_warmup"]),
                        fmt_mb(cy["after_trim"]),
                        str(cy["same_values"]),
                        str(cy["all_deferred"]),
                    ]
                )
            else:
                rows.append([mode] + ["n/a"] * 9)
        print_table(
            "(d) materialize(layer 0, keep_cache=True) / dematerialize cycles",
            [
                "rng",
                "cycles",
                "first materialize",
                "time per cycle",
                "layer bytes",
                "RSS drift from cycle 0",
                f"RSS drift after cycle {min(10, n_cycles)}",
                "drift after malloc_trim",
                "same values",
                "deferred after each",
            ],
            rows,
        )
        for mode in ("fast", "exact"):
            cy = res[f"cycles_{mode}"]
            if _ok(cy):
                print(
                    f"{mode}: RSS after cycle k, relative to after cycle 0: "
                    + ", ".join(f"{k}: {fmt_mb(v)}" for k, v in cy["marks"].items())
                )
    print_errors(res)


if __name__ == "__main__":
    main()
