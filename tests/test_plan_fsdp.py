"""place(strategy="fsdp"): the per-rank peak against a real FSDP2 run, 2 ranks over gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _gloo import WORLD, rank_result, run_ranks, skip_without_gloo
from _models import llama_config

transformers = pytest.importorskip("transformers")
skip_without_gloo()

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4)


def _fsdp_peak(mesh: Any) -> dict[str, Any]:
    """The plan's per-rank peak and FSDPMemTracker's, over the second of 2 training steps."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    from jupyter_metainit import meta_init, place

    with meta_init():
        deferred = transformers.LlamaForCausalLM(llama_config(**CONFIG))
    plan = place(deferred, {"cpu": "1GiB"}, batch=4, seq_len=64, training=True,
                 strategy="fsdp", world_size=WORLD)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(**CONFIG))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 1000, (4, 64))
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        for step in range(2):  # the second step: optimizer states exist
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")
    measured = max(int(stats["Total"]) for stats in peak.values())
    return {"predicted": plan.peak["cpu"], "measured": measured, "units": plan.units}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = run_ranks([("peak", _fsdp_peak)], tmp_path_factory.mktemp("fsdp_plan"))
    return [rank_result(results, "peak", r) for r in range(WORLD)]


def test_the_fsdp_plans_per_rank_peak_is_within_10_percent_of_fsdp2_on_gloo(ranks):
    for result in ranks:
        assert result["predicted"] == pytest.approx(result["measured"], rel=0.10)


def test_the_fsdp_plan_never_predicts_less_than_a_real_rank_holds(ranks):
    for result in ranks:
        assert result["predicted"] >= result["measured"]
