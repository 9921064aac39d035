"""Per-rank peak memory of sharded materialization (FSDP2, 2 ranks, gloo on the CPU).

A ~0.54 B-parameter Llama (float32, untied) is built deferred, sharded with ``fully_shard`` per
decoder layer and at the root, then made real on each rank, in fresh processes per row:
- ``materialize_sharded`` (exact / fast): each rank replays its shards one at a time;
- ``materialize(model)``: the core's one-shot replay of the same shards (same values);
- PyTorch's meta-device flow: ``torch.device("meta")``, ``fully_shard``, ``to_empty`` and
  ``reset_parameters()`` where a module has one (values are NOT the model's init).
Peak = the rise of the process's resident memory (VmHWM, reset before) during that step, with
glibc's mmap threshold fixed so that freed tensors are returned to the system.
Target: ``materialize_sharded`` peak <= this rank's shards + the largest unsharded tensor.

    .venv/bin/python benchmarks/bench_distributed.py            # ~2 min
    .venv/bin/python benchmarks/bench_distributed.py --quick    # tiny model, smoke run
    .venv/bin/python benchmarks/bench_distributed.py --only exact,core   # some rows only
"""

from __future__ import annotations

import contextlib
import ctypes
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
    fmt_s,
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
           "meta + to_empty + reset_parameters"]  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, method: str, cfg: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: no heap-retained tensors
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
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        meter = Meter()
        with meter():
            if method == "materialize_sharded exact":
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
        result["shards"] = sum(p._local_tensor.numel() * p.element_size() for p in params)
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
    for method in methods:
        for rank, r in enumerate(_measure(method, cfg)):
            if "error" in r:
                errors[f"{method} rank {rank}"] = r
                continue
            bound = r["shards"] + r["largest"]
            ok = r["peak_extra"] <= bound + 8 * MiB if method.startswith("materialize_") else None
            rows.append([method, rank, fmt_s(r["seconds"]), fmt_mb(r["peak_extra"]),
                         fmt_mb(r["shards"]), fmt_mb(r["largest"]), fmt_mb(bound),
                         fmt_mb(r["full"]), verdict(ok)])  # fmt: skip
    size = "tiny Llama" if args.quick else "Llama 0.54 B params, float32, untied"
    print_table(
        f"Per-rank materialization after fully_shard ({size}, {WORLD} ranks, gloo)",
        ["method", "rank", "time", "peak extra RSS", "shards", "largest tensor",
         "shards + largest", "whole model", "peak <= bound"],
        rows,
    )  # fmt: skip
    print_errors(errors)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
