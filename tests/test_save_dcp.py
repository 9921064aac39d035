"""``save(..., format="dcp")``: a ``torch.distributed.checkpoint`` of the values materialize would
give, loadable into an eager model and, resharded, into a 2-rank FSDP2 model over gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import WORLD, fully_shard_linears, gathered, rank_result, run_ranks, skip_without_gloo
from torch import nn

skip_without_gloo()

import torch.distributed.checkpoint as dcp  # noqa: E402

from jupyter_metainit import is_deferred, meta_init  # noqa: E402
from jupyter_metainit.saving import save  # noqa: E402


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


def test_a_dcp_save_writes_one_file_per_rank_as_torchs_writer_does(tmp_path):
    save(_deferred_mlp(), tmp_path / "ours", format="dcp")
    dcp.save(_mlp().state_dict(), checkpoint_id=tmp_path / "torch", no_dist=True)
    assert sorted(os.listdir(tmp_path / "ours")) == [".metadata", "__0_0.distcp"]
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "torch"))


def test_max_shard_size_splits_a_dcp_save_into_files_that_load_exactly(tmp_path):
    save(_deferred_mlp(), tmp_path / "seed", format="dcp", max_shard_size=250)  # 432 B of tensors
    files = sorted(os.listdir(tmp_path / "seed"))
    assert files == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    target = _other_values()
    dcp.load(target.state_dict(), checkpoint_id=tmp_path / "seed", no_dist=True)
    assert _equal_to_eager(target.state_dict()) == []


_PEAK_SCRIPT = """
import resource
from torch import nn
from jupyter_metainit import meta_init
from jupyter_metainit.saving import save
with meta_init():
    model = nn.Sequential(*[nn.Linear(5120, 4096, bias=False) for _ in range(8)])  # 8 x 80 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
save(model, {path!r}, format="dcp")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(after - before)
"""


def test_a_dcp_save_into_one_file_holds_a_few_tensors_not_the_model(tmp_path):
    script = _PEAK_SCRIPT.format(path=str(tmp_path / "seed"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    growth = int(out.stdout.split()[-1])
    tensor = 5120 * 4096 * 4
    # One tensor being written, the next one computed (and the replay's scratch): not the
    # file's 640 MiB.
    assert growth <= 3 * tensor + (64 << 20), f"peak grew by {growth >> 20} MiB"
    assert sorted(os.listdir(tmp_path / "seed")) == [".metadata", "__0_0.distcp"]


def test_dtype_casts_deferred_tensors_in_a_dcp_save(tmp_path):
    save(_deferred_mlp(), tmp_path / "seed", format="dcp", dtype=torch.bfloat16)
    target = _other_values().to(torch.bfloat16)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "seed", no_dist=True)
    assert torch.equal(state["0.weight"], _mlp()[0].weight.detach().to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# two ranks over gloo


def _rank_load_seed(mesh: Any, seed: str, _out: str) -> dict[str, Any]:
    """torchtitan's recipe: an FSDP2 model loads the seed checkpoint resharded."""
    model = _other_values()
    fully_shard_linears(model, mesh)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=seed)
    return {"mismatches": _equal_to_eager(gathered(model))}


def _rank_save_sharded(mesh: Any, _seed: str, out: str) -> dict[str, Any]:
    """Each rank of a deferred FSDP2 model writes its own shards."""
    model = _deferred_mlp()
    fully_shard_linears(model, mesh)
    save(model, out, format="dcp")
    return {"deferred": is_deferred(model)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    base = tmp_path_factory.mktemp("dcp")
    save(_deferred_mlp(), base / "seed", format="dcp")
    results = run_ranks(
        [("load", _rank_load_seed), ("save", _rank_save_sharded)], base,
        str(base / "seed"), str(base / "sharded"),
    )  # fmt: skip
    return results, base


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_seed_checkpoint_loads_resharded_into_fsdp2_with_eager_values(ranks, rank):
    results, _ = ranks
    assert rank_result(results, "load", rank)["mismatches"] == []


def test_each_rank_of_a_deferred_fsdp2_model_writes_its_own_shards(ranks):
    results, base = ranks
    assert all(rank_result(results, "save", r)["deferred"] for r in range(WORLD))
    files = sorted(os.listdir(base / "sharded"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank


def test_the_shards_two_ranks_wrote_load_into_an_eager_model_with_eager_values(ranks):
    _, base = ranks
    target = _other_values()
    state = target.state_dict()
    dcp.load(state, checkpoint_id=base / "sharded", no_dist=True)
    assert _equal_to_eager(target.state_dict()) == []
