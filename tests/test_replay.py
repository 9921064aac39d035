"""Replay: exact mode split across threads gives the values of the single stream."""

from __future__ import annotations

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.core.replay import parallel, run
from jupyter_metainit.core.replay.parallel import stream_parts
from jupyter_metainit.core.replay.planning import plan
from jupyter_metainit.core.runtime.pool import CORES_VARIABLE


class _Decoder(nn.Module):
    """Layers built with PyTorch's default init, then overwritten (as ``post_init`` does):
    every thread must jump past the dead draws and the other threads' live ones."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 64)) for _ in range(6)
        )
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)


def _ops_of(model: nn.Module) -> list:
    return plan([t._rec for t in model.state_dict().values()]).ops


def _count_parallel_runs(monkeypatch) -> list[int]:
    runs: list[int] = []
    real = run.run_parallel

    def counting(task, groups, workers):
        runs.append(len(groups))
        return real(task, groups, workers)

    # internal spy: nothing public says how a replay was split
    monkeypatch.setattr(run, "run_parallel", counting)
    return runs


def test_exact_replay_on_three_threads_equals_eager(monkeypatch):
    _any_size(monkeypatch)
    monkeypatch.setenv(CORES_VARIABLE, "3")
    runs = _count_parallel_runs(monkeypatch)
    torch.manual_seed(0)
    eager = _Decoder()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with meta_init():
        model = _Decoder()
    materialize(model)
    assert runs == [3]
    for key, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(torch.get_rng_state(), after_eager)


def test_a_subtree_replayed_on_two_threads_equals_eager(monkeypatch):
    _any_size(monkeypatch)
    monkeypatch.setenv(CORES_VARIABLE, "2")
    runs = _count_parallel_runs(monkeypatch)
    eager, model = eager_and_deferred(_Decoder)
    materialize(model.layers[3:])
    assert runs == [2]
    for key, value in eager.layers[3:].state_dict().items():
        assert torch.equal(model.layers[3:].state_dict()[key], value), key
    assert all(is_deferred(p) for p in model.layers[0].parameters())


def test_the_parts_are_runs_of_the_stream_in_recording_order(monkeypatch):
    _any_size(monkeypatch)
    with meta_init():
        model = _Decoder()
    ops = _ops_of(model)
    parts = stream_parts(ops, 2)
    assert len(parts) == 2
    assert sorted(i for part in parts for i, _ in part) == list(range(len(ops)))
    for part in parts:
        indices = [i for i, _ in part]
        assert indices == sorted(indices)
    last_of_first = max(op.rng.index for _, op in parts[0] if op.rng is not None)
    first_of_second = min(op.rng.index for _, op in parts[1] if op.rng is not None)
    assert last_of_first < first_of_second


def _any_size(monkeypatch) -> None:
    """Parts for any amount of random work, even or not (the tests' models are small)."""
    # internal thresholds, no setting: the tests' models are small
    monkeypatch.setattr(parallel, "SPLIT_STREAM_BYTES", 0)
    monkeypatch.setattr(parallel, "_BALANCE", 2.0)


def test_small_random_work_stays_on_one_thread():
    with meta_init():
        model = _Decoder()
    assert stream_parts(_ops_of(model), 2) is None  # below SPLIT_STREAM_BYTES: a jump costs more


def test_uneven_parts_stay_on_one_thread(monkeypatch):
    """One large fill and a few small ones: one thread splitting the large fill is faster."""
    # internal thresholds, no setting: the tests' models are small
    monkeypatch.setattr(parallel, "SPLIT_STREAM_BYTES", 0)
    with meta_init():
        tensors = [torch.empty(256, 256).normal_()]
        tensors += [torch.empty(8, 8).normal_() for _ in range(8)]
    assert stream_parts(plan([t._rec for t in tensors]).ops, 2) is None


def test_interleaved_streams_stay_on_one_thread(monkeypatch):
    """Made in one order, filled in another: every part would jump at nearly every op."""
    with meta_init():
        tensors = [torch.zeros(64, 64) for _ in range(8)]
        for i in (0, 4, 1, 5, 2, 6, 3, 7):
            tensors[i][:32].normal_()  # half: the zeros stay live, and order the groups
    _any_size(monkeypatch)
    assert stream_parts(plan([t._rec for t in tensors]).ops, 2) is None


def _fills(dead_log_normal: bool) -> list[torch.Tensor]:
    tensors = [torch.empty(64, 64) for _ in range(8)]
    for t in tensors[:4]:
        t.normal_()
    tensors[4].log_normal_()
    if dead_log_normal:
        tensors[4].normal_()
    for t in tensors[5:]:
        t.normal_()
    return tensors


def test_unknown_draw_counts_stay_on_one_thread(monkeypatch):
    """A later part would have to regenerate the op to start after it: no gain."""
    _any_size(monkeypatch)
    with meta_init():
        tensors = _fills(dead_log_normal=False)
    assert stream_parts(plan([t._rec for t in tensors]).ops, 2) is None


def test_a_dead_op_of_unknown_draw_count_is_regenerated_by_the_part_after_it(monkeypatch):
    _any_size(monkeypatch)
    monkeypatch.setenv(CORES_VARIABLE, "2")
    runs = _count_parallel_runs(monkeypatch)
    eager, tensors = eager_and_deferred(lambda: _fills(dead_log_normal=True))
    materialize(tensors)
    assert runs == [2]
    assert all(torch.equal(t, e) for t, e in zip(tensors, eager, strict=True))


def test_a_replay_on_every_thread_of_the_pool_runs_inline(monkeypatch):
    """Tasks that wait for tasks queued behind them in the same pool would wait forever."""
    import threading

    from jupyter_metainit.core.replay.run import execute
    from jupyter_metainit.core.runtime.pool import core_pool

    eager, model = eager_and_deferred(_Decoder)
    records = [t._rec for t in model.state_dict().values()]
    expected = list(eager.state_dict().values())
    _any_size(monkeypatch)
    runs = _count_parallel_runs(monkeypatch)
    pool = core_pool(2)
    everyone = threading.Barrier(pool._max_workers)

    def replay() -> list[torch.Tensor]:
        everyone.wait(timeout=30)  # every thread of the pool is busy from here on
        env = execute(plan(records), torch.device("cpu"), "exact", threads=2)
        return [run.real_view(env[id(r.storage)], r) for r in records]

    results = [pool.submit(replay) for _ in range(pool._max_workers)]
    for future in results:
        values = future.result(timeout=60)
        assert all(torch.equal(v, e) for v, e in zip(values, expected, strict=True))
    assert runs == [2] * pool._max_workers


def test_the_cores_switch_sets_the_threads_every_job_uses(monkeypatch):
    from jupyter_metainit.core.runtime.pool import available_cores

    monkeypatch.setenv(CORES_VARIABLE, "5")
    assert available_cores() == 5
    monkeypatch.setenv(CORES_VARIABLE, "all")
    with pytest.raises(ArgumentError, match=CORES_VARIABLE):
        available_cores()
