"""``save(..., format="dcp")``: a ``torch.distributed.checkpoint`` of the values materialize would
give, loadable into an eager model and, resharded, into a 2-rank FSDP2 model over gloo."""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402

from jupyter_metainit import is_deferred, meta_init  # noqa: E402
from jupyter_metainit.save import save  # noqa: E402

WORLD = 2
SPAWN_TIMEOUT_S = 120


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 4))


def _deferred_mlp() -> nn.Module:
    with meta_init():
        return _mlp()


def _other_values() -> nn.Module:
    model = _mlp()
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(1)
    return model


def _equal_to_eager(state: dict[str, torch.Tensor]) -> list[str]:
    eager = _mlp().state_dict()
    return [k for k, v in eager.items() if not torch.equal(state[k], v)]


def test_a_dcp_save_of_a_deferred_model_loads_into_an_eager_model_with_eager_values(tmp_path):
    save(_deferred_mlp(), tmp_path / "seed", format="dcp")
    target = _other_values()
    state = target.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "seed", no_dist=True)
    assert _equal_to_eager(target.state_dict()) == []


def test_a_dcp_save_leaves_the_model_deferred_and_nothing_beside_the_checkpoint(tmp_path):
    model = _deferred_mlp()
    save(model, tmp_path / "seed", format="dcp")
    assert all(is_deferred(t) for t in model.state_dict().values() if t.is_floating_point())
    assert os.listdir(tmp_path) == ["seed"]


def test_a_cancelled_dcp_save_leaves_nothing_and_raises_the_callbacks_exception(tmp_path):
    class Stop(Exception):
        pass

    def stop(done: int, total: int) -> None:
        raise Stop

    with pytest.raises(Stop):
        save(_deferred_mlp(), tmp_path / "seed", format="dcp", progress=stop)
    assert os.listdir(tmp_path) == []


def test_dtype_casts_deferred_tensors_in_a_dcp_save(tmp_path):
    save(_deferred_mlp(), tmp_path / "seed", format="dcp", dtype=torch.bfloat16)
    target = _other_values().to(torch.bfloat16)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "seed", no_dist=True)
    assert torch.equal(state["0.weight"], _mlp()[0].weight.detach().to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# two ranks over gloo


def _fully_shard(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out


def _rank_load_seed(mesh: Any, seed: str, _out: str) -> dict[str, Any]:
    """torchtitan's recipe: an FSDP2 model loads the seed checkpoint resharded."""
    model = _other_values()
    _fully_shard(model, mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=seed)
    return {"mismatches": _equal_to_eager(_full(model))}


def _rank_save_sharded(mesh: Any, _seed: str, out: str) -> dict[str, Any]:
    """Each rank of a deferred FSDP2 model writes its own shards."""
    model = _deferred_mlp()
    _fully_shard(model, mesh)
    save(model, out, format="dcp")
    return {"deferred": is_deferred(model)}


def _worker(rank: int, seed: str, out: str, store_dir: str) -> None:
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            os.environ["GLOO_SOCKET_IFNAME"] = name
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(store_dir) / "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    results: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        for name, scenario in (("load", _rank_load_seed), ("save", _rank_save_sharded)):
            try:
                results[name] = scenario(mesh, seed, out)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, Path(store_dir) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    base = tmp_path_factory.mktemp("dcp")
    save(_deferred_mlp(), base / "seed", format="dcp")
    args = (str(base / "seed"), str(base / "sharded"), str(base))
    ctx = mp.start_processes(_worker, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the {WORLD} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(base / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return results, base


def _result(results: list[dict[str, Any]], scenario: str, rank: int) -> dict[str, Any]:
    r = results[rank][scenario]
    if "error" in r:
        pytest.fail(f"rank {rank} failed in {scenario}:\n{r['error']}")
    return r


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_seed_checkpoint_loads_resharded_into_fsdp2_with_eager_values(ranks, rank):
    results, _ = ranks
    assert _result(results, "load", rank)["mismatches"] == []


def test_each_rank_of_a_deferred_fsdp2_model_writes_its_own_shards(ranks):
    results, base = ranks
    assert all(_result(results, "save", r)["deferred"] for r in range(WORLD))
    files = os.listdir(base / "sharded")
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)


def test_the_shards_two_ranks_wrote_load_into_an_eager_model_with_eager_values(ranks):
    _, base = ranks
    target = _other_values()
    state = target.state_dict()
    dcp.load(state, checkpoint_id=base / "sharded", no_dist=True)
    assert _equal_to_eager(target.state_dict()) == []
