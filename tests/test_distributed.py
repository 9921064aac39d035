"""Sharded materialization with FSDP2 and DTensor, in 2 processes over gloo on the CPU.

A module fixture spawns 2 ranks once (loopback only, bounded in time) and runs every scenario
in them; the tests then check one behaviour each on what the ranks returned.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import (
    SPAWN_TIMEOUT_S,
    WORLD,
    fully_shard_linears,
    gathered,
    rank_result,
    run_ranks,
    skip_without_gloo,
)
from _loopback import free_port, loopback_interface
from torch import nn

skip_without_gloo()

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init  # noqa: E402
from jupyter_metainit.core.errors import MaterializationError  # noqa: E402
from jupyter_metainit.distributed import WholeTensorWarning, materialize_sharded  # noqa: E402

MIB = 1 << 20


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario, in one pair of ranks (starting processes is most of the cost)."""
    names = [
        "memory",
        "fsdp_exact",
        "fsdp_fast",
        "fsdp_core",
        "fsdp_keep",
        "tp",
        "tp_default_src",
        "fsdp_over_tp",
        "whole_report",
    ]
    if _has_transformers():
        names += ["hf_fsdp", "hf_fsdp_plan"]
    return run_ranks([(n, SCENARIOS[n]) for n in names], tmp_path_factory.mktemp("ranks"))


@pytest.fixture(scope="module")
def nn_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return results


@pytest.fixture(scope="module")
def hf_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if "hf_fsdp" not in results[0]:
        pytest.skip("transformers is not installed")
    return results


# ---------------------------------------------------------------------------------------------
# scenarios (run in each rank)


def _mlp() -> nn.Module:
    # 3 output rows over 2 ranks: FSDP2 pads rank 1's shard. BatchNorm brings unsharded buffers.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _deferred_mlp() -> nn.Module:
    with meta_init():
        return _mlp()


def _mismatches(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _train_step(model: nn.Module, x: torch.Tensor) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _scenario_fsdp_exact(mesh: Any) -> dict[str, Any]:
    model = _deferred_mlp()
    fully_shard_linears(model, mesh)
    deferred_before = is_deferred(model)
    materialize_sharded(model)
    single = materialize(_deferred_mlp())
    result = {
        "deferred_before": deferred_before,
        "deferred_after": is_deferred(model),
        "vs_single": _mismatches(gathered(model), gathered(single)),
        "vs_eager": _mismatches(gathered(model), gathered(_mlp())),
        "local_rows": model[0].weight._local_tensor.shape[0],
    }
    result["loss"] = _train_step(model, _x())
    result["ref_loss"] = _train_step(single, _x())
    result["trained"], result["ref_trained"] = gathered(model), gathered(single)
    return result


def _scenario_fsdp_fast(mesh: Any) -> dict[str, Any]:
    model = _deferred_mlp()
    fully_shard_linears(model, mesh)
    calls: list[tuple[int, int]] = []
    materialize_sharded(model, rng="fast", progress=lambda done, total: calls.append((done, total)))
    single = materialize(_deferred_mlp(), rng="fast")
    return {"vs_single": _mismatches(gathered(model), gathered(single)), "progress": calls}


def _scenario_fsdp_core(mesh: Any) -> dict[str, Any]:
    model = _deferred_mlp()
    fully_shard_linears(model, mesh)
    materialize(model)  # the core's materialize sees through DTensor parameters too
    out = {"vs_eager": _mismatches(gathered(model), gathered(_mlp()))}
    out["loss"], out["ref_loss"] = _train_step(model, _x()), _train_step(_mlp(), _x())
    return out


def _scenario_fsdp_keep(mesh: Any) -> dict[str, Any]:
    model = _deferred_mlp()
    fully_shard_linears(model, mesh)
    materialize(model, keep_cache=True)
    dematerialize(model)
    out: dict[str, Any] = {"deferred_after_free": is_deferred(model[0].weight)}
    materialize(model)
    out["vs_eager"] = _mismatches(gathered(model), gathered(_mlp()))
    out["loss"], out["ref_loss"] = _train_step(model, _x()), _train_step(_mlp(), _x())
    return out


def _tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # Linear 0: weight and bias Shard(0); linear 2: weight Shard(1), bias Replicate().
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _scenario_tp(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    with meta_init():
        model = _tp_model()
    parallelize_module(model, mesh, _tp_plan(), src_data_rank=None)
    materialize_sharded(model)
    ref = _tp_model()
    result = {
        "placements": {n: str(p.placements) for n, p in model.named_parameters()},
        "vs_eager": _mismatches(gathered(model), gathered(ref)),
    }
    result["loss"], result["ref_loss"] = _train_step(model, _x()), _train_step(ref, _x())
    result["trained"], result["ref_trained"] = gathered(model), gathered(ref)
    return result


def _scenario_fsdp_over_tp(mesh: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh_2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    with meta_init():
        model = _tp_model()
    parallelize_module(model, mesh_2d["tp"], _tp_plan(), src_data_rank=None)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh_2d["dp"])
    materialize_sharded(model)
    return {"vs_eager": _mismatches(gathered(model), gathered(_tp_model()))}


def _scenario_tp_default_src(mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import parallelize_module

    with meta_init():
        model = _tp_model()
    parallelize_module(model, mesh, _tp_plan())  # src_data_rank=0: a scatter we cannot record
    try:
        materialize_sharded(model)
    except MaterializationError as e:
        return {"raised": str(e), "still_deferred": is_deferred(model)}
    return {"raised": None}


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _scenario_memory(mesh: Any) -> dict[str, Any]:
    with contextlib.suppress(OSError, AttributeError):
        # A fixed mmap threshold: glibc returns every freed tensor to the system, so resident
        # memory tracks the tensors alive (by default it may keep freed mid-sized blocks).
        ctypes.CDLL(None).mallopt(-3, 1 << 16)
    torch.manual_seed(0)
    with meta_init():
        model = nn.Sequential(*[nn.Linear(2048, 4096, bias=False) for _ in range(6)])
    fully_shard_linears(model, mesh)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak RSS (VmHWM)
    before = _rss_kib("VmRSS")
    materialize_sharded(model)
    peak = (_rss_kib("VmHWM") - before) * 1024
    shards = sum(p._local_tensor.untyped_storage().nbytes() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": peak, "shards": shards, "largest": largest, "full": full}


def _clamped_model() -> nn.Module:
    # 4 Mi elements each (large enough to be cut); the second ends in a clamp_, which cannot.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))
    with torch.no_grad():
        model[0].weight.normal_(0, 0.02)
        model[1].weight.normal_(0, 0.02).clamp_(-0.04, 0.04)
    return model


def _scenario_whole_report(mesh: Any) -> dict[str, Any]:
    with meta_init():
        model = _clamped_model()
    fully_shard_linears(model, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        materialize_sharded(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, WholeTensorWarning)]
    return {
        "messages": messages,
        "vs_eager": _mismatches(gathered(model), gathered(_clamped_model())),
    }


def _hf_model() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _hf_step(model: nn.Module) -> float:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.item()


def _scenario_hf_fsdp(mesh: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    with meta_init():
        model = _hf_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize_sharded(model)
    eager = _hf_model()
    result = {
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "vs_eager": _mismatches(gathered(model), gathered(eager)),
    }
    result["loss"], result["ref_loss"] = _hf_step(model), _hf_step(eager)
    result["trained"], result["ref_trained"] = gathered(model), gathered(eager)
    return result


def _scenario_hf_fsdp_plan(mesh: Any) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    from jupyter_metainit import place

    with meta_init():
        model = _hf_model()
    plan = place(model, {"cpu": "8GiB"}, batch=2, seq_len=16, training=True, strategy="fsdp",
                 world_size=WORLD)  # fmt: skip
    materialize_sharded(model, mesh, placement=plan)
    eager = _hf_model()
    return {
        "units": plan.units,
        "sharded": [name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
        "deferred_after": is_deferred(model),
        "local_rows": model.model.layers[0].mlp.up_proj.weight._local_tensor.shape[0],
        "vs_eager": _mismatches(gathered(model), gathered(eager)),
    }


SCENARIOS = {
    "hf_fsdp_plan": _scenario_hf_fsdp_plan,
    "memory": _scenario_memory,
    "fsdp_exact": _scenario_fsdp_exact,
    "fsdp_fast": _scenario_fsdp_fast,
    "fsdp_core": _scenario_fsdp_core,
    "fsdp_keep": _scenario_fsdp_keep,
    "whole_report": _scenario_whole_report,
    "tp": _scenario_tp,
    "tp_default_src": _scenario_tp_default_src,
    "fsdp_over_tp": _scenario_fsdp_over_tp,
    "hf_fsdp": _scenario_hf_fsdp,
}


# ---------------------------------------------------------------------------------------------
# tests

pytestmark = pytest.mark.timeout(SPAWN_TIMEOUT_S + 60)


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_sharded_model_reports_deferred_until_materialized(nn_results, rank):
    r = rank_result(nn_results, "fsdp_exact", rank)
    assert (r["deferred_before"], r["deferred_after"]) == (True, False)


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_rank_holds_only_its_shard(nn_results, rank):
    assert rank_result(nn_results, "fsdp_exact", rank)["local_rows"] == [3, 3][rank]


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_gathered_shards_equal_single_process_materialization(nn_results, rank):
    assert rank_result(nn_results, "fsdp_exact", rank)["vs_single"] == []


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_gathered_shards_equal_eager_construction(nn_results, rank):
    assert rank_result(nn_results, "fsdp_exact", rank)["vs_eager"] == []


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_training_step_matches_single_process(nn_results, rank):
    r = rank_result(nn_results, "fsdp_exact", rank)
    torch.testing.assert_close(r["loss"], r["ref_loss"])
    torch.testing.assert_close(r["trained"], r["ref_trained"])


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_fast_mode_shards_agree_with_single_process_fast_mode(nn_results, rank):
    assert rank_result(nn_results, "fsdp_fast", rank)["vs_single"] == []


def test_progress_reaches_this_ranks_total(nn_results):
    calls = rank_result(nn_results, "fsdp_fast")["progress"]
    assert len(calls) > 1 and calls[-1][0] == calls[-1][1] > 0


@pytest.mark.parametrize("rank", range(WORLD))
def test_core_materialize_handles_fsdp_parameters(nn_results, rank):
    r = rank_result(nn_results, "fsdp_core", rank)
    assert r["vs_eager"] == []
    torch.testing.assert_close(r["loss"], r["ref_loss"])


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_model_materialized_with_keep_cache_frees_and_materializes_again(nn_results, rank):
    r = rank_result(nn_results, "fsdp_keep", rank)
    assert r["deferred_after_free"] and r["vs_eager"] == []
    torch.testing.assert_close(r["loss"], r["ref_loss"])


def test_tp_plan_uses_shard0_shard1_and_replicate(nn_results):
    placements = rank_result(nn_results, "tp")["placements"]
    assert placements == {
        "0.weight": "(Shard(dim=0),)", "0.bias": "(Shard(dim=0),)",
        "2.weight": "(Shard(dim=1),)", "2.bias": "(Replicate(),)",
    }  # fmt: skip


@pytest.mark.parametrize("rank", range(WORLD))
def test_tp_gathered_shards_equal_eager_construction(nn_results, rank):
    assert rank_result(nn_results, "tp", rank)["vs_eager"] == []


@pytest.mark.parametrize("rank", range(WORLD))
def test_tp_training_step_matches_single_process(nn_results, rank):
    r = rank_result(nn_results, "tp", rank)
    torch.testing.assert_close(r["loss"], r["ref_loss"])
    torch.testing.assert_close(r["trained"], r["ref_trained"])


@pytest.mark.parametrize("rank", range(WORLD))
def test_tp_sharded_from_rank0_is_refused_with_a_fix(nn_results, rank):
    r = rank_result(nn_results, "tp_default_src", rank)
    assert r["raised"] is not None and "src_data_rank=None" in r["raised"]
    assert r["still_deferred"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_over_tp_2d_gathered_shards_equal_eager_construction(nn_results, rank):
    assert rank_result(nn_results, "fsdp_over_tp", rank)["vs_eager"] == []


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("rank", range(WORLD))
def test_peak_memory_is_at_most_shards_plus_largest_tensor(nn_results, rank):
    r = rank_result(nn_results, "memory", rank)
    assert r["peak"] <= r["shards"] + r["largest"] + 8 * MIB, {k: v / MIB for k, v in r.items()}


@pytest.mark.parametrize("rank", range(WORLD))
def test_parameters_computed_whole_for_their_shard_are_reported(nn_results, rank):
    r = rank_result(nn_results, "whole_report", rank)
    assert r["vs_eager"] == []
    assert len(r["messages"]) == 1
    assert "'1.weight'" in r["messages"][0] and "clamp_" in r["messages"][0]
    assert "'0.weight'" not in r["messages"][0]


@pytest.mark.parametrize("rank", range(WORLD))
def test_hf_tied_weights_stay_tied(hf_results, rank):
    assert rank_result(hf_results, "hf_fsdp", rank)["tied"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_hf_gathered_shards_equal_eager_construction(hf_results, rank):
    assert rank_result(hf_results, "hf_fsdp", rank)["vs_eager"] == []


@pytest.mark.parametrize("rank", range(WORLD))
def test_hf_training_step_matches_single_process(hf_results, rank):
    r = rank_result(hf_results, "hf_fsdp", rank)
    torch.testing.assert_close(r["loss"], r["ref_loss"])
    torch.testing.assert_close(r["trained"], r["ref_trained"])


@pytest.mark.timeout(200)
def test_example_runs_under_torchrun():
    example = Path(__file__).resolve().parent.parent / "examples" / "sharded_materialization.py"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if loopback_interface() is not None:
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
         "--master_addr", "127.0.0.1", "--master_port", str(port), str(example), "--check",
         "--dim", "64", "--layers", "2"],
        capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gathered shards equal a one-process materialization" in proc.stdout, proc.stdout
    assert "step 2: loss" in proc.stdout, proc.stdout


# ---------------------------------------------------------------------------------------------
# in this process (no process group)


def test_unsharded_deferred_model_materializes_with_eager_values():
    model = materialize_sharded(_deferred_mlp())
    assert not is_deferred(model)
    assert _mismatches(gathered(model), gathered(_mlp())) == []


def test_unknown_rng_mode_is_refused():
    with pytest.raises(ValueError, match="rng"):
        materialize_sharded(_deferred_mlp(), rng="quick")


def test_materialize_sharded_of_a_number_says_what_it_takes():
    with pytest.raises(TypeError, match=r"materialize_sharded\(\) takes the sharded model"):
        materialize_sharded(5)


@pytest.mark.parametrize("rank", range(WORLD))
def test_materialize_sharded_with_an_fsdp_plan_shards_its_units_in_order(hf_results, rank):
    r = rank_result(hf_results, "hf_fsdp_plan", rank)
    assert r["units"] == ["model.layers.0", "model.layers.1", ""]
    assert sorted(r["sharded"]) == sorted(r["units"])
    assert r["local_rows"] == 128 // WORLD and not r["deferred_after"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_materialize_sharded_with_an_fsdp_plan_gathers_to_eager_values(hf_results, rank):
    assert rank_result(hf_results, "hf_fsdp_plan", rank)["vs_eager"] == []


def test_materialize_sharded_refuses_a_pipeline_plan_and_says_what_takes_it():
    pytest.importorskip("transformers")
    from jupyter_metainit import place

    with meta_init():
        model = _hf_model()
    plan = place(model, {"cpu": "8GiB"}, batch=2, seq_len=16)
    with pytest.raises(ValueError, match=r"'pipeline' plan.*materialize\(model, placement=plan\)"):
        materialize_sharded(model, None, placement=plan)
    assert is_deferred(model)


def test_materialize_sharded_with_an_fsdp_plan_and_no_mesh_says_to_pass_the_mesh():
    pytest.importorskip("transformers")
    from jupyter_metainit import place

    with meta_init():
        model = _hf_model()
    plan = place(model, {"cpu": "8GiB"}, batch=2, seq_len=16, strategy="fsdp", world_size=2)
    with pytest.raises(ValueError, match="needs the device mesh"):
        materialize_sharded(model, placement=plan)
    assert is_deferred(model)
