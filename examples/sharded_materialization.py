"""Shard a deferred model with FSDP2 (or tensor parallel) and let each rank make only its shards.

The model is built with ``meta_init`` (no memory), sharded with PyTorch's own ``fully_shard`` /
``parallelize_module``, then ``materialize_sharded`` replays, on each rank, the recorded
initialisation of that rank's shards: the values are the model's own init (here a custom
``init_weights``), with no ``to_empty`` and no ``reset_parameters``.

    # CPU, gloo, 2 processes
    torchrun --nproc_per_node 2 examples/sharded_materialization.py
    # tensor parallel instead of FSDP2; compare the shards with a one-process materialization
    torchrun --nproc_per_node 2 examples/sharded_materialization.py --tp --check
    # GPUs, NCCL (one process per GPU), a bigger model
    torchrun --nproc_per_node 8 examples/sharded_materialization.py --dim 4096 --layers 16

Each rank prints its peak memory during materialization next to its shard bytes and the
largest single unsharded tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.distributed import materialize_sharded


class Block(nn.Module):
    """A pre-norm MLP block with a GPT-2-style init (scaled normal), not ``reset_parameters``."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        nn.init.normal_(self.up.weight, std=0.02)
        nn.init.normal_(self.down.weight, std=0.02 / math.sqrt(2 * layers))
        nn.init.zeros_(self.up.bias)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, layers) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(args: argparse.Namespace, device: torch.device) -> Model:
    """A deferred model whose tensors report ``device`` (FSDP2 expects the mesh's device)."""
    torch.manual_seed(0)  # the same seed on every rank: every rank records the same model
    with meta_init(device=device):
        return Model(args.dim, args.layers)


def shard(model: Model, mesh: object, tp: bool) -> None:
    if tp:
        plan = {}
        for i in range(len(model.blocks)):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        # src_data_rank=None: each rank takes its own slice of the (recorded) full tensor,
        # instead of receiving it from rank 0, which a deferred tensor cannot record.
        parallelize_module(model, mesh, plan, src_data_rank=None)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)


def peak_since_reset(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) * 1024 for line in status.splitlines()
                if line.startswith("VmHWM:"))  # fmt: skip


def reset_peak(device: torch.device) -> int:
    """Reset the peak-memory mark; returns the memory in use now (the baseline)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with contextlib.suppress(OSError, AttributeError):
        # glibc keeps freed mid-sized blocks in its heap, so that resident memory overstates
        # what is in use; a fixed mmap threshold returns every freed tensor to the system.
        ctypes.CDLL(None).mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) * 1024 for line in status.splitlines()
                if line.startswith("VmRSS:"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", action="store_true", help="tensor parallel instead of FSDP2")
    parser.add_argument("--rng", choices=["exact", "fast"], default="exact")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare the gathered shards with a one-process materialization",
    )
    args = parser.parse_args()

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    model = build(args, device)  # no memory: every tensor is deferred
    shard(model, mesh, args.tp)
    assert is_deferred(model)

    baseline = reset_peak(device)
    start = time.perf_counter()
    materialize_sharded(model, rng=args.rng)
    seconds = time.perf_counter() - start
    peak = peak_since_reset(device)

    params = list(model.parameters())
    local = [getattr(p, "_local_tensor", p) for p in params]
    shard_bytes = sum(t.numel() * t.element_size() for t in local)
    largest = max(p.numel() * p.element_size() for p in params)
    mib = 1 << 20
    peak_text = "n/a" if peak is None else f"{(peak - baseline) / mib:.1f} MiB"
    print(f"rank {rank}: materialized {shard_bytes / mib:.1f} MiB of shards in {seconds:.2f} s; "
          f"peak {peak_text} (shards + largest tensor = {(shard_bytes + largest) / mib:.1f} MiB)",
          flush=True)  # fmt: skip

    if args.check:
        single = materialize(build(args, device), rng=args.rng)
        for (name, p), q in zip(model.named_parameters(), single.parameters(), strict=True):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            assert torch.equal(full, q), name
        if rank == 0:
            print("gathered shards equal a one-process materialization (torch.equal)", flush=True)

    # It trains: forward, backward and an optimizer step on the sharded model.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    for step in range(3):
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
