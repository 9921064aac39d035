"""Progress inside one large tensor, and Cancel that stops it there: materialize and save.

A fill of hundreds of megabytes is made in steps (``rng.split_fill``, ``rng.stream_fill``): the
caller's progress callback hears how far it is while it fills, and a callback that raises (the
widget's Cancel) stops it within a step, leaving the tensor deferred and the checkpoint absent.
Real threads and real fills; progress is told more often than by default
(``JUPYTER_METAINIT_PROGRESS_SECONDS``), so that a 256 MiB tensor gives many events.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _twins import deferred
from safetensors.torch import save_file
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.core.rng import split_fill
from jupyter_metainit.core.runtime import interrupts, pool
from jupyter_metainit.core.runtime.interrupts import PROGRESS_SECONDS_VARIABLE
from jupyter_metainit.core.runtime.pool import CORES_VARIABLE
from jupyter_metainit.saving import save

N = 64 << 20  # float32 elements: 256 MiB, 16 steps of split_fill.STEP_ELEMENTS
STD = 0.02


@pytest.fixture(autouse=True)
def _tell_often(monkeypatch):
    monkeypatch.setenv(PROGRESS_SECONDS_VARIABLE, "0.01")


class Cancelled(Exception):
    pass


def _normal_weight(n: int) -> nn.Module:
    module = nn.Module()
    module.w = nn.Parameter(torch.empty(n).normal_(std=STD))
    return module


def _weight(n: int = N, seed: int = 0) -> nn.Module:
    """A module holding one large deferred parameter made by ``normal_``."""
    return deferred(_normal_weight, n, seed=seed)


def _linear() -> nn.Module:
    """A large weight and a small bias: in fast mode two groups replayed on pool threads."""
    return deferred(nn.Linear, 8192, 8192)


class Recorder:
    """A progress callable recording (done, total); raises Cancelled once ``cancel`` is set."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.cancel = threading.Event()
        self.inside = threading.Event()  # told part of the large tensor (not a small one)

    def __call__(self, done: int, total: int) -> None:
        if self.cancel.is_set():
            raise Cancelled
        self.events.append((done, total))
        if 1 << 20 <= done < total:
            self.inside.set()

    def inside_values(self) -> set[int]:
        return {d for d, t in self.events if 1 << 20 <= d < t}


@pytest.mark.parametrize("rng", ["exact", "fast"])
@pytest.mark.parametrize("build", [_weight, _linear], ids=["tensor", "linear"])
def test_materialize_reports_progress_inside_a_large_tensor(rng, build):
    module = build()
    progress = Recorder()
    materialize(module, rng=rng, progress=progress)
    done = [d for d, _ in progress.events]
    assert done == sorted(done)
    assert done[-1] == progress.events[-1][1] > 0
    assert len(progress.inside_values()) >= 4, progress.events


def test_exact_values_of_a_large_tensor_made_in_steps_equal_eager():
    torch.manual_seed(0)
    eager = torch.empty(N).normal_(std=STD)
    module = _weight()
    materialize(module, progress=Recorder())
    assert torch.equal(module.w, eager)


def test_fast_values_of_a_large_tensor_made_in_steps_are_those_of_one_serial_fill(monkeypatch):
    stepped = _weight()
    materialize(stepped, rng="fast")
    # as before fills were cut: one kernel call on one core
    # internal size, no setting: one step for the whole tensor
    monkeypatch.setattr(split_fill, "STEP_ELEMENTS", 1 << 62)
    monkeypatch.setenv(CORES_VARIABLE, "1")
    serial = _weight()
    materialize(serial, rng="fast")
    assert torch.equal(stepped.w, serial.w)


def _cancel_once_inside(work, progress: Recorder) -> tuple[BaseException | None, float]:
    """Run ``work`` on a thread; once progress is told inside the tensor, cancel from here.
    Returns what ``work`` raised and the seconds from the cancel to its end."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:
            raised.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    while not progress.inside.wait(0.01) and worker.is_alive():
        pass
    assert progress.inside.is_set(), f"nothing told inside the tensor: {progress.events}"
    progress.cancel.set()
    start = time.monotonic()
    worker.join(30)
    took = time.monotonic() - start
    assert not worker.is_alive()
    return (raised[0] if raised else None), took


@pytest.mark.parametrize("rng", ["exact", "fast"])
@pytest.mark.parametrize("build", [_weight, _linear], ids=["tensor", "linear"])
def test_cancel_stops_materialize_inside_a_large_tensor_within_a_second(rng, build):
    module = build()
    progress = Recorder()
    raised, took = _cancel_once_inside(
        lambda: materialize(module, rng=rng, progress=progress), progress
    )
    assert isinstance(raised, Cancelled)
    assert took < 1.0
    assert all(is_deferred(p) for p in module.parameters())
    assert max(d for d, _ in progress.events) < N * 4  # stopped inside the large tensor


def test_a_cancelled_materialize_leaves_the_tensor_deferred_and_exact_afterwards():
    module = _weight()
    progress = Recorder()
    raised, _ = _cancel_once_inside(lambda: materialize(module, progress=progress), progress)
    assert isinstance(raised, Cancelled) and is_deferred(module.w)
    materialize(module)
    torch.manual_seed(0)
    assert torch.equal(module.w, torch.empty(N).normal_(std=STD))
    # the generator is left where eager code leaves it, also after the cancelled attempt
    after = torch.get_rng_state()
    torch.manual_seed(0)
    torch.empty(N).normal_(std=STD)
    assert torch.equal(after, torch.get_rng_state())


def test_the_pool_threads_of_a_cancelled_fill_stop_with_it():
    module = _weight()
    progress = Recorder()
    _cancel_once_inside(lambda: materialize(module, progress=progress), progress)
    idle = pool.core_pool(1).submit(lambda: None)  # queued behind the fill's chunks if any ran on
    assert idle.result(timeout=1.0) is None


def test_save_reports_progress_inside_a_large_tensor(tmp_path):
    module = _weight()
    progress = Recorder()
    save(module, tmp_path / "ckpt", progress=progress)
    done = [d for d, _ in progress.events]
    assert done == sorted(done) and done[-1] == N * 4
    assert len(progress.inside_values()) >= 4, progress.events
    assert is_deferred(module.w)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cancel_stops_save_inside_a_large_tensor_leaving_nothing(tmp_path, dtype):
    module = _weight()
    progress = Recorder()
    destination = tmp_path / "ckpt"
    raised, took = _cancel_once_inside(
        lambda: save(module, destination, dtype=dtype, progress=progress), progress
    )
    assert isinstance(raised, Cancelled)
    assert took < 1.0
    assert not destination.exists() or not any(destination.iterdir())
    assert is_deferred(module.w)


def _checkpoint_of_a_large_tensor(tmp_path, monkeypatch) -> tuple[str, nn.Module]:
    # a read from the page cache can take only tens of milliseconds: told after every step
    monkeypatch.setenv(PROGRESS_SECONDS_VARIABLE, "0.0")
    path = str(tmp_path / "model.safetensors")
    save_file({"w": torch.full((N,), 0.5)}, path)
    with meta_init():
        module = nn.Module()
        module.w = nn.Parameter(torch.empty(N))
    return path, module


def test_materialize_from_a_checkpoint_reports_progress_inside_a_large_tensor(
    tmp_path, monkeypatch
):
    path, module = _checkpoint_of_a_large_tensor(tmp_path, monkeypatch)
    progress = Recorder()
    materialize(module, checkpoint=path, progress=progress)
    done = [d for d, _ in progress.events]
    assert done == sorted(done) and done[-1] == N * 4
    assert len(progress.inside_values()) >= 4, progress.events
    assert torch.equal(module.w, torch.full((N,), 0.5))


def test_cancel_stops_a_checkpoint_read_inside_a_large_tensor(tmp_path, monkeypatch):
    path, module = _checkpoint_of_a_large_tensor(tmp_path, monkeypatch)
    progress = Recorder()
    raised, took = _cancel_once_inside(
        lambda: materialize(module, checkpoint=path, progress=progress), progress
    )
    assert isinstance(raised, Cancelled)
    assert took < 1.0
    assert is_deferred(module.w) and max(d for d, _ in progress.events) < N * 4


def test_a_large_copy_or_cast_in_steps_is_told_and_stops_part_way(monkeypatch):
    # save's casts and aligned copies, checkpoint reads: ``copy_in_steps`` under ``telling``
    monkeypatch.setenv(PROGRESS_SECONDS_VARIABLE, "0.0")  # told after every step
    src = torch.full((N,), 1.5)
    dst = torch.zeros(N, dtype=torch.bfloat16)
    told: list[int] = []

    def tell(nbytes: int) -> None:
        told.append(nbytes)
        if len(told) == 3:
            raise Cancelled

    with pytest.raises(Cancelled), interrupts.telling(tell):
        interrupts.copy_in_steps(dst, src)
    assert told == sorted(told) and 0 < told[-1] < N * 2
    assert dst[0] == 1.5 and dst[-1] == 0  # stopped part-way


def test_a_dcp_save_reports_progress_inside_a_large_tensor_and_cancels_there(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    module = _weight()
    progress = Recorder()
    save(module, tmp_path / "whole", format="dcp", progress=progress)
    assert len(progress.inside_values()) >= 4, progress.events
    progress = Recorder()
    destination = tmp_path / "cancelled"
    raised, took = _cancel_once_inside(
        lambda: save(module, destination, format="dcp", progress=progress), progress
    )
    assert isinstance(raised, Cancelled) and took < 1.0
    assert not destination.exists() or not any(destination.iterdir())
    assert is_deferred(module.w)


@pytest.mark.parametrize("rng", ["exact", "fast"])
def test_the_widgets_bar_moves_inside_a_large_tensor_and_cancel_stops_it(rng):
    from jupyter_metainit.jupyter.widget import explore

    torch.manual_seed(0)
    with meta_init():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8192, 8192))  # a 256 MiB weight
    w = explore(model)
    w.rng = rng
    seen: set[int] = set()
    w.observe(lambda change: seen.add(change["new"][0]), names="progress")
    w.handle_action({"action": "materialize", "device": "cpu", "names": ["1"]})
    while w.busy and not any(1 << 20 <= d < N * 4 for d in seen):
        time.sleep(0.001)
    w.handle_action({"action": "cancel"})
    start = time.monotonic()
    assert w.wait(30)
    assert time.monotonic() - start < 1.0
    assert w.status.startswith("Cancelled"), (w.status, w.error, sorted(seen))
    assert is_deferred(model[1].weight)


def test_the_progress_switch_sets_how_often_progress_is_told(monkeypatch):
    monkeypatch.setenv(PROGRESS_SECONDS_VARIABLE, "0")
    told: list[int] = []
    steps = interrupts.Steps(told.append)
    for _ in range(3):
        steps.add(1)
        steps.step()
    assert told == [1, 2, 3]  # after every step
    monkeypatch.setenv(PROGRESS_SECONDS_VARIABLE, "soon")
    with pytest.raises(ArgumentError, match=PROGRESS_SECONDS_VARIABLE):
        interrupts.Steps(told.append)
