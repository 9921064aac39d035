"""One lock for materialize, dematerialize and value reads, from any thread."""

from __future__ import annotations

import threading

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import dematerialize, is_deferred, materialize
from jupyter_metainit.core.errors import BusyError
from jupyter_metainit.core.runtime import lock


def _layers(n=8):
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


def _run_threads(targets):
    errors = []

    def guarded(fn):
        try:
            fn()
        except BaseException as e:  # collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_threads_materializing_one_model_both_succeed():
    eager, model = eager_and_deferred(_layers)
    errors = _run_threads([lambda: materialize(model), lambda: materialize(model[3])])
    assert errors == []
    assert not is_deferred(model)
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_threads_materializing_freeing_and_reading_at_once_never_corrupt():
    eager, model = eager_and_deferred(_layers)
    rounds = 15

    def cycle(layer):
        for _ in range(rounds):
            materialize(model[layer], keep_cache=True)
            dematerialize(model[layer])

    def read():
        for _ in range(rounds):
            value = model[0].weight.tolist() if is_deferred(model[0].weight) else None
            assert value is None or torch.equal(torch.tensor(value), eager[0].weight)

    errors = _run_threads([lambda: cycle(0), lambda: cycle(0), lambda: cycle(1), read])
    assert errors == []
    materialize(model)
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_not_waiting_while_another_thread_works_is_a_clear_busy_error():
    started, release = threading.Event(), threading.Event()

    def hold():
        with lock.exclusive("materializing the test model"):
            started.set()
            release.wait(10)

    worker = threading.Thread(target=hold)
    worker.start()
    started.wait(10)
    try:
        assert "materializing the test model" in lock.busy_with()
        with (
            pytest.raises(BusyError, match="busy with materializing the test model"),
            lock.exclusive("another", wait=False),
        ):
            pass
    finally:
        release.set()
        worker.join()
    assert lock.busy_with() is None
