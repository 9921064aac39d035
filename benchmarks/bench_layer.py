"""One decoder layer of a Llama-3-70B-shaped model (bfloat16) materialized exactly, against the
physical floor, on 1 core and on all cores.

The floor is what the layer's final values need: one ``normal_`` pass over its elements on one
thread, divided by the cores in use (the kernel is serial; the CPU generator is one stream).
Each figure runs in a fresh process pinned with ``os.sched_setaffinity`` (what ``taskset``
does): ``1 core`` and ``all N cores``.

- ``exact``: ``materialize(layer, rng="exact")``: bit-identical to eager construction; dead
  writes (``kaiming_uniform_`` overwritten by ``post_init``'s ``normal_``) are skipped by
  jump-ahead and large fills are split across cores at their exact stream offsets.
- ``fast``: ``rng="fast"``: one independent stream per op, ops in parallel.

Target: each at most 1.25x the floor.

    .venv/bin/python benchmarks/bench_layer.py            # full (~2 min)
    .venv/bin/python benchmarks/bench_layer.py --quick    # smoke run, small shapes
"""

from __future__ import annotations

import os
import time
from typing import Any

from _common import (
    LLAMA_70B,
    base_parser,
    child_main,
    environment_line,
    fmt_ratio,
    fmt_s,
    llama_config,
    load_core,
    print_errors,
    print_table,
    run_children,
    verdict,
)

LAYER = 40
CONFIG = dict(LLAMA_70B)
QUICK_CONFIG = dict(CONFIG, hidden_size=1024, intermediate_size=3584, num_attention_heads=8)


_ALLOWED = sorted(os.sched_getaffinity(0))  # before any pinning (quick runs share a process)


def _pin(cores: int) -> int:
    os.sched_setaffinity(0, _ALLOWED[:cores])
    import torch

    torch.set_num_threads(cores)
    return len(os.sched_getaffinity(0))


def _floor(config: dict, cores: int) -> dict[str, Any]:
    """One single-threaded normal_ pass over as many bf16 elements as the layer holds."""
    used = _pin(1)
    import torch

    meta, core = _deferred(config)
    elements = sum(p.numel() for p in meta.model.layers[LAYER].parameters())
    del meta, core
    buf = torch.empty(elements, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    buf.normal_(0.0, 0.02)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "elements": elements, "cores": used}


def _deferred(config: dict) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    core = load_core()
    torch.manual_seed(0)
    with core.meta_init():
        model = AutoModelForCausalLM.from_config(llama_config(**config), dtype=torch.bfloat16)
    return model, core


def _materialize(config: dict, cores: int, rng: str) -> dict[str, Any]:
    used = _pin(cores)
    model, core = _deferred(config)
    layer = model.model.layers[LAYER]
    t0 = time.perf_counter()
    core.materialize(layer, rng=rng)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "cores": used}


def _equality(config: dict) -> dict[str, Any]:
    """The exact layer equals the same layer of an eagerly built model (a small config)."""
    import torch

    small = dict(config, num_hidden_layers=LAYER + 1)
    small.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, vocab_size=1000)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(llama_config(**small), dtype=torch.bfloat16)
    model, core = _deferred(small)
    core.materialize(model.model.layers[LAYER], rng="exact")
    a = dict(eager.model.layers[LAYER].named_parameters())
    b = dict(model.model.layers[LAYER].named_parameters())
    return {"equal": all(torch.equal(a[k], b[k]) for k in a)}


MEASUREMENTS = {"floor": _floor, "materialize": _materialize, "equality": _equality}


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    config = QUICK_CONFIG if args.quick else CONFIG
    all_cores = len(os.sched_getaffinity(0))
    print("# bench_layer: one 70B-shaped decoder layer, exact and fast, against the floor")
    print(f"{environment_line()}; layer {LAYER} of {config['num_hidden_layers']}")
    core_counts = sorted({1, all_cores})
    jobs: list[tuple[str, dict]] = [("floor", {"config": config, "cores": 1})]
    for cores in core_counts:
        for rng in ("exact", "fast"):
            jobs.append(("materialize", {"config": config, "cores": cores, "rng": rng}))
    jobs.append(("equality", {"config": config}))
    results = run_children(__file__, jobs, separate=not args.quick)
    floor, runs, eq = results[0], results[1:-1], results[-1]
    print_errors({"floor": floor, "equality": eq, **{f"run {i}": r for i, r in enumerate(runs)}})
    rows = []
    ok_all = "error" not in floor and "error" not in eq and eq.get("equal", False)
    if "error" not in floor:
        print(
            f"floor: one single-thread normal_ pass over {floor['elements'] / 1e9:.2f} B bf16 "
            f"elements takes {fmt_s(floor['seconds'])}"
        )
    i = 0
    for cores in core_counts:
        for rng in ("exact", "fast"):
            r = runs[i]
            i += 1
            if "error" in r or "error" in floor:
                rows.append([f"{cores}", rng, "n/a", "n/a", "n/a", "n/a"])
                ok_all = False
                continue
            floor_s = floor["seconds"] / cores
            ratio = r["seconds"] / floor_s
            ok = ratio <= 1.25
            ok_all = ok_all and ok
            rows.append([f"{cores}", rng, fmt_s(r["seconds"]), fmt_s(floor_s), fmt_ratio(ratio),
                         verdict(ok)])  # fmt: skip
    print_table(
        "Decoder layer, materialize vs floor (one normal_ pass / cores)",
        ["cores", "rng", "materialize", "floor", "vs floor", "<= 1.25x"],
        rows,
    )
    if "error" not in eq:
        print(f"exact layer equals eager construction (torch.equal, small config): {eq['equal']}")
    print(f"all targets met: {verdict(ok_all)}")


if __name__ == "__main__":
    main()
