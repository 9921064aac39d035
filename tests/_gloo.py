"""Two ranks over gloo on the CPU, for the tests of sharded models.

Spawning processes is most of the cost, so a test file spawns its 2 ranks once (a module
fixture calling :func:`run_ranks`) and runs every scenario in them; its tests then check one
behaviour each on what the ranks returned (:func:`rank_result`). The ranks meet through a file
store (no listening port) and gloo connects them on the loopback interface only. Scenarios must
be module-level functions: ``spawn`` pickles them by name.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _loopback import loopback_interface
from torch import nn

WORLD = 2
SPAWN_TIMEOUT_S = 120

Scenario = Callable[..., dict[str, Any]]


def skip_without_gloo() -> None:
    """Skip the calling test module where torch.distributed has no gloo backend."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def _rank(rank: int, scenarios: Sequence[tuple[str, Scenario]], args: tuple, out_dir: str) -> None:
    loopback = loopback_interface()
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(out_dir) / "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    results: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        for name, scenario in scenarios:
            try:
                results[name] = scenario(mesh, *args)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(
    scenarios: Sequence[tuple[str, Scenario]], out_dir: Path, *args: Any
) -> list[dict[str, Any]]:
    """Run each ``(name, scenario)`` as ``scenario(mesh, *args)`` in each of 2 spawned ranks,
    in order, with a barrier after each; return each rank's ``{name: what it returned}``.

    A scenario that raises gives ``{"error": traceback}`` (:func:`rank_result` fails the test
    with it) and the others still run; ranks that outlive ``SPAWN_TIMEOUT_S`` are killed.
    """
    ctx = mp.start_processes(
        _rank, args=(list(scenarios), args, str(out_dir)), nprocs=WORLD, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the {WORLD} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def rank_result(results: list[dict[str, Any]], scenario: str, rank: int = 0) -> dict[str, Any]:
    """What ``scenario`` returned on ``rank``; fails the test with the rank's traceback."""
    r = results[rank][scenario]
    if "error" in r:
        pytest.fail(f"rank {rank} failed in {scenario}:\n{r['error']}")
    return r


def fully_shard_linears(model: nn.Module, mesh: Any) -> None:
    """FSDP2 over ``mesh``: each ``nn.Linear`` of a Sequential its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each DTensor gathered whole (a copy, safe to send back)."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out
