"""Placement plans: planning time, balance and fit against accelerate; predicted vs real peaks.

Three tables, each measurement in a fresh process:

0. The first plan of a Llama-3-70B-shaped deferred model over 8 x 80 GiB, median of
   ``--repeats`` (3) fresh processes, with identical blocks measured once (the default) and
   with every op of every block tracked, alternated so that both see the same load.
1. Planning a Llama-3-70B-shaped deferred model over 2, 4 and 8 x 80 GiB: ``place`` (the first
   call, which runs the dry run of the workload, and a re-plan that reuses it) against
   ``accelerate.infer_auto_device_map``; balance (most loaded device / mean, by the plan's own
   predicted peaks) and whether the workload (batch 8, seq 4096 inference) fits by
   ``place``'s prediction (``attention="fused"``: the fused SDPA kernels that GPUs of compute
   capability 8.0 or newer run in bfloat16; ``place`` cannot check that without the GPUs).
2. Predicted against measured peak on the CPU: a ~0.3 B Llama (fp32), batch 4, seq 512,
   inference with the cache and one AdamW training step. The measured peak is PyTorch's own
   ``torch.distributed._tools.mem_tracker.MemTracker`` (live storage bytes of parameters,
   buffers, gradients, optimizer states, activations and temporaries, by a dispatch mode and
   weak references), on the real model materialized from the same deferred one; the second
   training step is measured (the optimizer states exist then, as in every later step).

    .venv/bin/python benchmarks/bench_placement.py            # full (~4 min on 2 cores)
    .venv/bin/python benchmarks/bench_placement.py --quick    # smoke run, small models
"""

from __future__ import annotations

import time
from typing import Any

from _common import (
    LLAMA_70B,
    base_parser,
    child_main,
    environment_line,
    fmt_mb,
    fmt_s,
    llama_config,
    print_errors,
    print_table,
    run_children,
    verdict,
)

GiB = 1 << 30
# The GPUs planned for are 80 GiB ones (A100, H100: compute capability 8.0 or newer), whose
# fused SDPA kernels take bfloat16; a plan for absent GPUs cannot check that by itself.
ATTENTION = "fused"
T5_3B = dict(d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128)
T5_LOAD = {"inputs": {"input_ids": (8, 512), "decoder_input_ids": (8, 128)}}
VIT_H = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
             num_attention_heads=16, image_size=224, patch_size=14)  # fmt: skip
VIT_LOAD = {"inputs": [(256, 3, 224, 224)]}
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                    num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
MIXTRAL_LOAD = {"batch": 8, "seq_len": 4096}
QUICK = {
    "t5": {"num_layers": 2, "d_ff": 1024},
    "vit": {"num_hidden_layers": 2},
    "mixtral": {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512},
}
SMALL_LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)


def _deferred(config: dict[str, Any], kind: str = "llama") -> Any:
    """A deferred transformers model: ``llama`` (causal LM), ``mixtral`` (mixture of experts),
    ``t5`` (encoder-decoder) or ``vit`` (vision encoder)."""
    import transformers

    from jupyter_metainit import meta_init

    with meta_init():
        if kind == "t5":
            return transformers.T5ForConditionalGeneration(transformers.T5Config(**config))
        if kind == "vit":
            return transformers.ViTModel(transformers.ViTConfig(**config))
        if kind == "mixtral":
            return transformers.MixtralForCausalLM(transformers.MixtralConfig(**config))
        return transformers.LlamaForCausalLM(llama_config(**config))


# Blocks accelerate must keep whole, per kind (place finds them itself).
NO_SPLIT = {"llama": ["LlamaDecoderLayer"], "t5": ["T5Block"], "vit": ["ViTLayer"],
            "mixtral": ["MixtralDecoderLayer"]}  # fmt: skip


def plan_time(config: dict[str, Any], gpus: int, workload: dict[str, Any], kind: str = "llama",
              capacity: int = 80 * GiB, every_op: bool = False) -> dict[str, Any]:  # fmt: skip
    """``place`` over ``gpus`` x ``capacity`` in bf16: first call (measures) and a re-plan.
    ``every_op``: the dry run tracks every op of every block, as before identical blocks
    were measured once (the reuse's hook switched off for this call)."""
    from jupyter_metainit.estimates.forward.reuse import BlockReuse

    measure_once = BlockReuse.pre
    if every_op:  # restored below: --quick runs every job in one process
        BlockReuse.pre = lambda self, *args: None  # type: ignore[method-assign]
    try:
        return _plan_time(config, gpus, workload, kind, capacity)
    finally:
        BlockReuse.pre = measure_once  # type: ignore[method-assign]


def _plan_time(config: dict[str, Any], gpus: int, workload: dict[str, Any], kind: str,
               capacity: int) -> dict[str, Any]:  # fmt: skip
    from jupyter_metainit import place

    model = _deferred(config, kind)
    devices = {f"cuda:{i}": capacity for i in range(gpus)}
    start = time.perf_counter()
    first = place(model, devices, precision="bf16", attention=ATTENTION, **workload)
    first_seconds = time.perf_counter() - start
    start = time.perf_counter()
    plan = place(model, devices, precision="bf16", attention=ATTENTION, **workload)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "first_seconds": first_seconds,
        "measure_seconds": first.measure_seconds,
        "balance": plan.balance,
        "fits": plan.fits,
        "peak": max(plan.peak.values()),
    }


def accelerate_time(config: dict[str, Any], gpus: int, workload: dict[str, Any],
                    kind: str = "llama", capacity: int = 80 * GiB) -> dict:  # fmt: skip
    """``infer_auto_device_map`` (bf16) with the same budgets; its map's peaks by ``place``'s
    per-part costs (weights, cache, activations) for the same workload."""
    import torch
    from accelerate import infer_auto_device_map

    from jupyter_metainit import place
    from jupyter_metainit.plan.partition import Load

    model = _deferred(config, kind)
    start = time.perf_counter()
    budgets = {i: capacity for i in range(gpus)}
    device_map = infer_auto_device_map(
        model, max_memory=budgets, no_split_module_classes=NO_SPLIT[kind], dtype=torch.bfloat16
    )
    seconds = time.perf_counter() - start
    costs = place(model, {"cpu": 1 << 50}, precision="bf16", attention=ATTENTION, **workload)
    loads: dict[str, Load] = {}
    for name, _, _, part in costs.parts:  # in execution order
        key = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")),
                  key=len)  # fmt: skip
        device = device_map[key]
        device = f"cuda:{device}" if isinstance(device, int) else device
        loads.setdefault(device, Load(False)).add(part)
    peaks = {d: load.peak for d, load in loads.items()}
    used = [peaks.get(f"cuda:{i}", 0) / capacity for i in range(gpus)]
    return {
        "seconds": seconds,
        "balance": max(used) / (sum(used) / len(used)),
        "fits": all(d.startswith("cuda") and p <= capacity for d, p in peaks.items()),
        "peak": max(peaks.values()),
    }


def measured_peak(config: dict[str, Any], batch: int, seq_len: int, training: bool) -> dict:
    """Predicted (place on one CPU device) and measured (MemTracker) peak of the workload."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from jupyter_metainit import materialize, place

    torch.manual_seed(0)
    model = _deferred(config)
    plan = place(model, {"cpu": 64 * GiB}, batch=batch, seq_len=seq_len, training=training)
    materialize(model)
    ids = torch.randint(0, config["vocab_size"], (batch, seq_len))
    tracker = MemTracker()
    if training:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.track_external(model, optimizer)
        measured = _two_steps_peak(model, optimizer, ids, tracker)
    else:
        model.eval()
        tracker.track_external(model)
        with tracker, torch.no_grad():
            model(ids, use_cache=True)
        measured = _tracked_peak(tracker)
    return {"predicted": plan.peak["cpu"], "measured": measured}


def _two_steps_peak(model: Any, optimizer: Any, ids: Any, tracker: Any) -> int:
    """Two AdamW steps under ``tracker``, its statistics reset after the first (so the
    optimizer's states exist): the peak of the second step."""
    with tracker:
        for step in range(2):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    return _tracked_peak(tracker)


def _tracked_peak(tracker: Any) -> int:
    """The largest per-module "Total" of a MemTracker's peak snapshot."""
    return max(int(stats["Total"]) for stats in tracker.get_tracker_snapshot("peak").values())


def _fsdp_rank(rank: int, world: int, config: dict, batch: int, seq_len: int, store: str) -> None:
    """One rank: FSDP2 over gloo (the blocks, then the root), two AdamW steps under
    ``FSDPMemTracker``; rank 0 writes its measured and predicted peak next to ``store``."""
    import json
    import os
    import pathlib

    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from jupyter_metainit import place

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)  # fmt: skip
    try:
        plan = place(_deferred(config), {"cpu": 64 * GiB}, batch=batch, seq_len=seq_len,
                     training=True, strategy="fsdp", world_size=world)  # fmt: skip
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(llama_config(**config))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, config["vocab_size"], (batch, seq_len))
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((ids,))
        measured = _two_steps_peak(model, optimizer, ids, tracker)
        if rank == 0:
            out = pathlib.Path(store + ".json")
            out.write_text(json.dumps({"predicted": plan.peak["cpu"], "measured": measured}))
    finally:
        dist.destroy_process_group()


def fsdp_peak(config: dict[str, Any], batch: int, seq_len: int) -> dict[str, Any]:
    """Predicted (``strategy="fsdp"``) against measured per-rank peak, 2 ranks on gloo."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        store = f"{directory}/store"
        mp.start_processes(_fsdp_rank, args=(2, config, batch, seq_len, store), nprocs=2,
                           start_method="spawn")  # fmt: skip
        with open(store + ".json") as f:
            return json.load(f)


MEASUREMENTS = {
    "fsdp_peak": fsdp_peak,
    "plan_time": plan_time,
    "accelerate_time": accelerate_time,
    "measured_peak": measured_peak,
}


def _planner_rows(labelled: list[tuple[str, int]], results: list[dict], named: dict
                  ) -> list[list[str]]:  # fmt: skip
    """One row for place and one for accelerate per (label, position of place's result)."""
    rows = []
    for label, at in labelled:
        for planner, r in (("place", results[at]), ("accelerate", results[at + 1])):
            named[f"{planner}, {label}"] = r
            if "error" in r:
                rows.append([f"{planner}, {label}", "n/a", "n/a", "n/a", "n/a"])
                continue
            first = f" (first call {fmt_s(r['first_seconds'])})" if "first_seconds" in r else ""
            balance = "n/a" if r.get("balance") is None else f"{r['balance']:.3f}"
            rows.append([f"{planner}, {label}", fmt_s(r["seconds"]) + first, balance,
                         fmt_mb(r.get("peak")), verdict(r["fits"])])  # fmt: skip
    return rows


def _median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def _first_plan_rows(timing: list[dict], named: dict) -> list[list[str]]:
    """Medians of the alternated first-plan runs: identical blocks measured once, then every
    op tracked."""
    rows = []
    for label, found in (("identical blocks measured once (default)", timing[0::2]),
                         ("every op of every block tracked", timing[1::2])):  # fmt: skip
        ok = [r for r in found if "error" not in r]
        named[f"first plan, {label}"] = ok[0] if ok else (found or [{"error": "no run"}])[0]
        if not ok:
            rows.append([label, "n/a", "n/a", "n/a"])
            continue
        first = _median([r["first_seconds"] for r in ok])
        replan = _median([r["seconds"] for r in ok])
        rows.append([label, fmt_s(first), fmt_s(replan), fmt_mb(ok[0]["peak"])])
    return rows


def main() -> None:
    child_main(MEASUREMENTS)
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--first-plan", action="store_true", help="only the first-plan table (70B, 8 devices)"
    )
    args = parser.parse_args()
    big, small = dict(LLAMA_70B), dict(SMALL_LLAMA)
    batch, seq_len, gpu_counts = 8, 4096, (2, 4, 8)
    if args.quick:
        big.update(num_hidden_layers=4, vocab_size=1024)
        small.update(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024)
        seq_len, gpu_counts = 512, (2, 8)
    print("# bench_placement: place() against accelerate.infer_auto_device_map; real peaks")
    print(f"{environment_line()}; 70B-shaped config {big}; inference batch {batch} x {seq_len}")
    jobs: list[tuple[str, dict[str, Any]]] = []
    llama_load = {"batch": batch, "seq_len": seq_len}
    for gpus in gpu_counts:
        params = {"config": big, "gpus": gpus, "workload": llama_load}
        jobs += [("plan_time", params), ("accelerate_time", params)]
    others = {  # (kind, config, workload, devices, capacity)
        "Mixtral-8x7B-shaped, batch 8 x 4096": ("mixtral", MIXTRAL_8X7B, MIXTRAL_LOAD, 2, 80 * GiB),
        "T5-3B-shaped, batch 8 x 512 -> 128": ("t5", T5_3B, T5_LOAD, 2, 6 * GiB),
        "ViT-H/14-shaped, batch 256 images": ("vit", VIT_H, VIT_LOAD, 2, 3 * GiB),
    }
    if args.quick:
        others = {k: (kind, {**c, **QUICK[kind]}, w, n, cap // 8)
                  for k, (kind, c, w, n, cap) in others.items()}  # fmt: skip
    for kind, config, workload, gpus, capacity in others.values():
        params = {"config": config, "gpus": gpus, "workload": workload, "kind": kind,
                  "capacity": capacity}  # fmt: skip
        jobs += [("plan_time", params), ("accelerate_time", params)]
    for training in (False, True):
        jobs.append(("measured_peak", {"config": small, "batch": 4, "seq_len": 512,
                                       "training": training}))  # fmt: skip
    jobs.append(("fsdp_peak", {"config": small, "batch": 4, "seq_len": 512}))
    if args.first_plan:
        jobs = []
    repeats = args.repeats or (1 if args.quick else 3)
    first = len(jobs)
    eight = {"config": big, "gpus": gpu_counts[-1], "workload": llama_load}
    for _ in range(repeats):  # alternated: the same load for both
        jobs += [("plan_time", eight), ("plan_time", {**eight, "every_op": True})]
    results = run_children(__file__, jobs, separate=not args.quick)
    timing = results[first:]
    del results[first:]
    rows, named = [], {}
    first_plan_table = (
        f"First plan of the 70B over {gpu_counts[-1]} x 80 GiB, median of {repeats} fresh "
        "processes (alternated)",
        ["dry run", "first plan", "re-plan", "largest device peak"],
    )
    if args.first_plan:
        print_table(*first_plan_table, _first_plan_rows(timing, named))
        print_errors(named)
        return
    labelled = [(f"{gpus} x 80 GiB", 2 * k) for k, gpus in enumerate(gpu_counts)]
    print_table(
        f"Planning a 70B over 80 GiB GPUs (bf16 inference, batch {batch} x seq {seq_len}; "
        "peaks predicted by place's per-part costs for both maps)",
        ["planner", "time", "balance (max/mean)", "largest device peak", "fits"],
        _planner_rows(labelled, results, named),
    )
    print_table(*first_plan_table, _first_plan_rows(timing, named))
    base = 2 * len(gpu_counts)
    labelled = [
        (f"{name}, {n} x {fmt_mb(cap)}", base + 2 * k)
        for k, (name, (_, _, _, n, cap)) in enumerate(others.items())
    ]
    print_table(
        "Other models (bf16 inference; peaks predicted by place's per-part costs for both maps)",
        ["planner", "time", "balance (max/mean)", "largest device peak", "fits"],
        _planner_rows(labelled, results, named),
    )
    base += 2 * len(others)
    rows = []
    labels = ("inference (cache)", "training step (AdamW)", "FSDP2 training, rank 0 of 2 (gloo)")
    for k, label in enumerate(labels):
        r = results[base + k]
        named[f"peak {label}"] = r
        if "error" in r:
            rows.append([label, "n/a", "n/a", "n/a"])
            continue
        error = r["predicted"] / r["measured"] - 1
        rows.append([label, fmt_mb(r["predicted"]), fmt_mb(r["measured"]), f"{error:+.1%}"])
    print_table(
        f"Predicted against measured peak, Llama {small['num_hidden_layers']} layers x "
        f"{small['hidden_size']} fp32 on the CPU, batch 4 x seq 512",
        ["workload", "predicted (place)", "measured (MemTracker / FSDPMemTracker)", "error"],
        rows,
    )
    print_errors(named)


if __name__ == "__main__":
    main()
