"""Whole-model materialization on CPU vs eager construction of the same ~0.5 B-parameter model.

Compares, each in fresh processes:
- eager: ``torch.manual_seed(0); AutoModelForCausalLM.from_config(cfg)``;
- ours: ``torch.manual_seed(0); with meta_init(): model = ...; materialize(model)`` (rng="exact").
A further process builds both and checks ``torch.equal`` on every state-dict entry.

Targets: materialize time <= 1.03 x eager construction; peak extra resident memory
<= 1.05 x parameter bytes + 100 MB; state dicts equal.

    .venv/bin/python benchmarks/bench_materialize.py            # full (~2-3 min)
    .venv/bin/python benchmarks/bench_materialize.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

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
    median_result,
    print_errors,
    print_table,
    run_children,
    tensor_bytes,
    verdict,
)

# 0.47 B parameters, 1.88 GB in float32
CONFIG = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
)
QUICK_CONFIG = dict(
    CONFIG,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=1000,
)


def _imports() -> Any:
    import torch
    import transformers  # noqa: F401

    return torch


def eager(config: dict[str, Any]) -> dict[str, Any]:
    torch = _imports()
    build_causal_lm(llama_config(**TINY_LLAMA))  # warm-up
    cfg = llama_config(**config)
    torch.manual_seed(0)
    meter = Meter()
    with meter():
        model = build_causal_lm(cfg)
    return meter.as_dict() | {"bytes": tensor_bytes(model)}


def ours(config: dict[str, Any]) -> dict[str, Any]:
    torch = _imports()
    mi = load_core()
    with mi.meta_init():  # warm-up, including one materialization
        warm = build_causal_lm(llama_config(**TINY_LLAMA))
    mi.materialize(warm)
    del warm
    mi.clear_meta_init_cache()
    cfg = llama_config(**config)
    torch.manual_seed(0)
    meter = Meter()
    with meter():
        with mi.meta_init():
            model = build_causal_lm(cfg)
        meter.lap("construct")
        mi.materialize(model)
    laps = meter.laps
    out = meter.as_dict() | {"bytes": tensor_bytes(model)}
    out["construct_seconds"] = laps["construct"]
    out["materialize_seconds"] = meter.seconds - laps["construct"]
    out["deferred_after"] = bool(mi.is_deferred(model))
    return out


def equality(config: dict[str, Any]) -> dict[str, Any]:
    torch = _imports()
    mi = load_core()
    cfg = llama_config(**config)
    torch.manual_seed(0)
    ref = build_causal_lm(cfg).state_dict()
    torch.manual_seed(0)
    with mi.meta_init():
        model = build_causal_lm(cfg)
    mi.materialize(model)
    got = model.state_dict()
    differ = [k for k in ref if k not in got or not torch.equal(ref[k], got[k])]
    differ += [k for k in got if k not in ref]
    return {"entries": len(ref), "differ": differ[:5], "n_differ": len(differ)}


MEASUREMENTS = {"eager": eager, "ours": ours, "equality": equality}


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    config = QUICK_CONFIG if args.quick else CONFIG
    repeats = args.repeats or (1 if args.quick else 3)
    print("# bench_materialize: materialize(model) on CPU vs eager construction")
    print(f"{environment_line()}; config {config}; {repeats} fresh process(es) per method")

    jobs = [("eager", {"config": config})] * repeats + [("ours", {"config": config})] * repeats
    jobs.append(("equality", {"config": config}))
    results = run_children(__file__, jobs, separate=not args.quick)
    ev = median_result(results[:repeats])
    ou = results[repeats : 2 * repeats]
    if all("error" not in r for r in ou):  # median by the materialize time, the target's number
        ou = [dict(r, seconds=r["materialize_seconds"], total=r["seconds"]) for r in ou]
    ou = median_result(ou)
    eq = results[-1]

    nbytes = ev.get("bytes") or ou.get("bytes")
    rows = []
    if "error" not in ev:
        rows.append(
            [
                "eager construction",
                fmt_s(ev["seconds"]),
                "1.000x",
                "-",
                "-",
                fmt_mb(ev["peak_extra"]),
                fmt_ratio(ev["peak_extra"] / ev["bytes"]),
            ]
        )
    else:
        rows.append(["eager construction"] + ["n/a"] * 6)
    ratio = ok_time = ok_mem = None
    if "error" not in ou:
        if "error" not in ev:
            ratio = ou["seconds"] / ev["seconds"]
            ok_time = ratio <= 1.03
        ok_mem = ou["peak_extra"] <= 1.05 * ou["bytes"] + 100 * MiB
        total_ratio = ou["total"] / ev["seconds"] if "error" not in ev else None
        rows.append(
            [
                "meta_init + materialize",
                fmt_s(ou["seconds"]),
                fmt_ratio(ratio),
                fmt_s(ou["construct_seconds"]),
                fmt_ratio(total_ratio),
                fmt_mb(ou["peak_extra"]),
                fmt_ratio(ou["peak_extra"] / ou["bytes"]),
            ]
        )
    else:
        rows.append(["meta_init + materialize"] + ["n/a"] * 6)
    print_table(
        f"Whole model, {nbytes / MiB:,.0f} MiB of parameters and buffers"
        if nbytes
        else "Whole model",
        [
            "method",
            "time (materialize only)",
            "vs eager",
            "deferred construction",
            "construction+materialize vs eager",
            "peak extra RSS",
            "peak RSS / param bytes",
        ],
        rows,
    )
    if "error" not in ev and "error" not in ou:
        print(
            f"CPU time (all threads; steadier than wall time on a busy machine): eager "
            f"{fmt_s(ev['cpu_seconds'])}, deferred construction + materialize "
            f"{fmt_s(ou['cpu_seconds'])} ({fmt_ratio(ou['cpu_seconds'] / ev['cpu_seconds'])})"
        )
    ok_eq = None
    if "error" not in eq:
        ok_eq = eq["n_differ"] == 0
        print(
            f"torch.equal on all {eq['entries']} state-dict entries (seed 0): {ok_eq}"
            + ("" if ok_eq else f"; {eq['n_differ']} differ, e.g. {eq['differ']}")
        )
    if "error" not in ou:
        print(f"deferred after materialize: {ou['deferred_after']}")
    print(f"target time ratio <= 1.03: {verdict(ok_time)}")
    print(f"target peak extra RSS <= 1.05 x param bytes + 100 MB: {verdict(ok_mem)}")
    print(f"target state dicts equal: {verdict(ok_eq)}")
    print_errors({"eager": ev, "ours": ou, "equality": eq})


if __name__ == "__main__":
    main()
