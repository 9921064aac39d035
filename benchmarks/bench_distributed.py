"""Per-rank peak memory of sharded materialization (FSDP2, 2 ranks, gloo on the CPU).

A ~0.54 B-parameter Llama (float32, untied) is built deferred, sharded with ``fully_shard`` per
decoder layer and at the root, then made real on each rank, in fresh processes per row:
- ``materialize_sharded`` (exact / fast): each rank replays its shards one at a time;
- ``materialize(model)``: the core's one-shot replay of the same shards (same values);
- PyTorch's meta-device flow: ``torch.device("meta")``, ``fully_shard``, ``to_empty`` and
  ``reset_parameters()`` where a module has one (values are NOT the model's init).
Peak = the rise of the process's resident memory (VmHWM, reset before) during that step, with
glibc's mmap threshold fixed so that freed tensors are returned to the system.
Targets for ``materialize_sharded`` (exact): per-rank peak <= its shards x 1.03 + 16 MiB, and
per-rank time <= 0.6x the time one process takes to materialize the same (unsharded) model.

    .venv/bin/python benchmarks/bench_distributed.py            # ~2 min
    .venv/bin/python benchmarks/bench_distributed.py --quick    # tiny model, smoke run
    .venv/bin/python benchmarks/bench_distributed.py --only exact,core   # some rows only
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _common import (
    TINY_LLAMA,
    Meter,
    MiB,
    base_parser,
    build_causal_lm,
    environment_line,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    fresh_pages_for_tensors,
    llama_config,
    print_errors,
    print_table,
    verdict,
)

WORLD = 2
MODEL = dict(
    hidden_size=2048, intermediate_size=5504, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=32000,
)  # fmt: skip
METHODS = ["materialize_sharded exact", "materialize_sharded fast", "core materialize(model)",
           "meta + to_empty + reset_parameters", "one process, unsharded, exact"]  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, method: str, cfg: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fresh_pages_for_tensors()  # no heap-retained tensors: a peak is what the step holds
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from jupyter_metainit import materialize, meta_init
    from jupyter_metainit.distributed import materialize_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        torch.manual_seed(0)
        config = llama_config(**cfg)
        if method.startswith("meta"):
            with torch.device("meta"):
                model = build_causal_lm(config)
        else:
            with meta_init():
                model = build_causal_lm(config)
        single = method.startswith("one process")
        if not single:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        meter = Meter()
        with meter():
            if single:  # the reference: rank 0 alone makes the whole model, rank 1 waits
                if rank == 0:
                    materialize(model)
            elif method == "materialize_sharded exact":
                materialize_sharded(model)
            elif method == "materialize_sharded fast":
                materialize_sharded(model, rng="fast")
            elif method == "core materialize(model)":
                materialize(model)
            else:
                model.to_empty(device="cpu")
                with torch.no_grad():
                    for m in model.modules():
                        if hasattr(m, "reset_parameters"):
                            m.reset_parameters()
        result = meter.as_dict()
        local = [getattr(p, "_local_tensor", p) for p in params]
        result["shards"] = sum(t.numel() * t.element_size() for t in local)
        result["largest"] = max(p.numel() * p.element_size() for p in params)
        result["full"] = sum(p.numel() * p.element_size() for p in params)
    except Exception:
        result = {"error": traceback.format_exc(limit=4)}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _measure(method: str, cfg: dict[str, Any], timeout: float = 300) -> list[dict[str, Any]]:
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank, args=(_free_port(), method, cfg, out), nprocs=WORLD,
                                 join=False, start_method="spawn")  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    return [{"error": f"timed out after {timeout} s"}] * WORLD
        except Exception as e:
            return [{"error": repr(e)}] * WORLD
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated words: run matching methods")
    args = parser.parse_args()
    cfg = dict(TINY_LLAMA) if args.quick else dict(MODEL)
    words = [w for w in args.only.split(",") if w]
    methods = [m for m in METHODS if not words or any(w in m for w in words)]
    print(environment_line())
    rows, errors = [], {}
    measured = {method: _measure(method, cfg) for method in methods}
    single = measured.get("one process, unsharded, exact", [{"error": "not run"}])[0]
    for method in methods:
        for rank, r in enumerate(measured[method]):
            if "error" in r:
                errors[f"{method} rank {rank}"] = r
                continue
            if method.startswith("one process") and rank > 0:
                continue
            sharded = method.startswith("materialize_")
            bound = r["shards"] * 1.03 + 16 * MiB
            ok_mem = r["peak_extra"] <= bound if sharded else None
            vs = r["seconds"] / single["seconds"] if "error" not in single else None
            ok_time = vs is not None and vs <= 0.6 if sharded else None
            rows.append([method, rank, fmt_s(r["seconds"]), fmt_ratio(vs), verdict(ok_time),
                         fmt_mb(r["peak_extra"]), fmt_mb(r["shards"]), fmt_mb(bound),
                         verdict(ok_mem)])  # fmt: skip
    size = "tiny Llama" if args.quick else "Llama 0.54 B params, float32, untied"
    print_table(
        f"Per-rank materialization after fully_shard ({size}, {WORLD} ranks, gloo)",
        ["method", "rank", "time", "vs one process", "<= 0.6x", "peak extra RSS",
         "shards", "shards x 1.03 + 16 MiB", "peak <= that"],
        rows,
    )  # fmt: skip
    print_errors(errors)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
