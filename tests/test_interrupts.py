"""Ctrl-C anywhere leaves everything whole: all tensors of a call or none, guards restored.

The fault injection raises SIGINT in this process at every line of our package that a
materialization (or a recording) executes, one line per run, and checks the state afterwards.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
import threading

import pytest
import torch
from _twins import deferred
from torch import nn

import jupyter_metainit
from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.runtime import interrupts
from jupyter_metainit.core.runtime.interrupts import PROGRESS_SECONDS_VARIABLE

PACKAGE = os.path.dirname(os.path.abspath(jupyter_metainit.__file__))

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need the main thread"
)


@pytest.fixture(autouse=True)
def _sigint_as_python_installs_it():
    """A shell's background job starts with SIGINT ignored, and then Python installs no
    ``default_int_handler``: these tests send SIGINT and need the handler an interactive
    process has."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _small_model():
    return deferred(lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)))


def _interrupt_at_line(k, work):
    """Run ``work()``, sending SIGINT on the k-th line our package executes; return (lines
    seen, whether KeyboardInterrupt came out)."""
    count = 0
    due = False
    last = None

    def tracer(frame, event, arg):
        nonlocal count, due, last
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "line":
            count += 1
            due = due or count == k
            # An exception raised by a trace function skips the enclosing block's __exit__ at
            # some line events, which a real Ctrl-C (handled at the interpreter's next check,
            # never inside the trace function) cannot do: at a `try:` line, or a `with` line as
            # the block exits (CPython 3.11), and at the events an inlined comprehension repeats
            # for its line on each item (3.12). Such an event's interrupt goes to the next one.
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            here = (frame, frame.f_lineno)
            repeated, last = sys.version_info >= (3, 12) and here == last, here
            if due and not repeated and not line.startswith(("try:", "with ")):
                due = False
                os.kill(os.getpid(), signal.SIGINT)
        return tracer

    interrupted = False
    sys.settrace(tracer)
    try:
        work()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(None)
    return count, interrupted


def _guards_are_clean(grad=True):
    """Our guards and state are as before. (``grad``: grad mode too; a Ctrl-C inside
    PyTorch's own ``torch.no_grad()`` in model code can leave it off, as in eager code.)"""
    python_key = torch._C.DispatchKey.Python
    return (
        torch._C._is_torch_function_enabled()
        and (torch.is_grad_enabled() or not grad)
        and not torch._C._dispatch_tls_is_dispatch_key_excluded(python_key)
        and torch._C._len_torch_function_stack() == 0
        and interrupts._depth.value == 0
        and not interrupts.interrupted()
        and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, interrupts._handler)
    )


def test_interrupt_at_every_line_of_materialize_is_all_or_nothing():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    model = _small_model()
    lines, _ = _interrupt_at_line(0, lambda: materialize(model))
    assert lines > 200
    for k in range(1, lines + 1):
        model = _small_model()
        _, interrupted = _interrupt_at_line(k, lambda model=model: materialize(model))
        states = {is_deferred(t) for t in [*model.parameters(), *model.buffers()]}
        assert len(states) == 1, f"half-materialized after an interrupt at line event {k}"
        assert _guards_are_clean(), f"guards left set after an interrupt at line event {k}"
        if states == {True}:
            assert interrupted
            materialize(model)  # still materializable, and exact
        for a, b in zip(eager.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_interrupt_at_every_line_of_recording_leaves_the_thread_clean():
    build = lambda: _small_model()  # noqa: E731
    lines, _ = _interrupt_at_line(0, build)
    for k in range(1, lines + 1, max(1, lines // 1000)):
        _interrupt_at_line(k, build)
        assert _guards_are_clean(grad=False), (
            f"guards left set after an interrupt at event {k}: "
            f"{torch._C._is_torch_function_enabled()} "
            f"{torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python)} "
            f"{torch._C._len_torch_function_stack()} {interrupts._depth.value} "
            f"{interrupts.interrupted()} {signal.getsignal(signal.SIGINT)}"
        )
        assert not jupyter_metainit.is_meta_init()
        torch.set_grad_enabled(True)


def test_interrupt_stops_fast_mode_before_the_remaining_work():
    # Progress is reported per tensor after each batch of finished work: the layers are large
    # enough (4 MB each) for the Ctrl-C sent at the third report to come long before the end.
    torch.manual_seed(0)
    with meta_init():
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(64)])
    done = []

    def progress(nbytes, total):
        done.append(nbytes)
        if len(done) == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        materialize(model, rng="fast", progress=progress)
    assert is_deferred(model[0].weight) and is_deferred(model[-1].weight)
    assert len(done) < len(model)  # of 2 reports per layer: stopped long before the end
    assert _guards_are_clean()


@pytest.mark.parametrize("rng", ["exact", "fast"])
def test_interrupt_inside_a_large_fill_stops_it_there_and_leaves_it_exact(rng, monkeypatch):
    # A 256 MiB fill is made in steps (split_fill): Ctrl-C, sent once part of it is told, stops
    # it at the next step; the tensor stays deferred and later comes out as eager's.
    monkeypatch.setenv(PROGRESS_SECONDS_VARIABLE, "0.01")
    n = 64 << 20
    torch.manual_seed(0)
    with meta_init():
        weight = torch.empty(n).normal_(std=0.02)
    told = []

    def progress(done, total):
        told.append(done)
        if 0 < done < total and len([d for d in told if 0 < d < total]) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        materialize(weight, rng=rng, progress=progress)
    assert is_deferred(weight) and max(told) < n * 4
    assert _guards_are_clean()
    materialize(weight, rng=rng)
    if rng == "exact":
        torch.manual_seed(0)
        assert torch.equal(weight, torch.empty(n).normal_(std=0.02))
