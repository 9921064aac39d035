"""``meta_init``'s defaults are the block's own, and replay does not depend on what is in force."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import ArgumentError, is_deferred, is_meta_init, materialize, meta_init


class Positional(nn.Module):
    """Factories that take the default dtype, and an integer division that produces it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("freq", torch.linspace(0, 1, 9))
        self.register_buffer("steps", torch.arange(0, 1, 0.125))
        self.register_buffer("ratio", torch.arange(0, 16, 2) / 16)
        self.register_buffer("scale", torch.tensor([0.1, 0.2]))
        self.register_buffer("full", torch.full((3,), 1 / 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.float16])
def test_meta_init_dtype_equals_eager_construction_under_that_default(dtype):
    def build() -> Positional:
        assert torch.get_default_dtype() == dtype  # eager's default, and the block's
        return Positional()

    eager, deferred = eager_and_deferred(build, dtype=dtype)
    assert torch.get_default_dtype() == torch.float32
    materialize(deferred)
    for k, v in eager.state_dict().items():
        got = deferred.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k


@pytest.mark.parametrize("ambient", [torch.bfloat16, torch.float64])
def test_materialize_does_not_depend_on_the_default_dtype_in_force(ambient):
    eager, deferred = eager_and_deferred(Positional)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(ambient)
    try:
        materialize(deferred)
    finally:
        torch.set_default_dtype(saved)
    for k, v in eager.state_dict().items():
        got = deferred.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k


def test_materialize_does_not_depend_on_the_default_device_or_grad_mode():
    eager, deferred = eager_and_deferred(Positional)
    torch.set_default_device("meta")
    try:
        with torch.inference_mode():
            materialize(deferred)
    finally:
        torch.set_default_device(None)
    assert deferred.proj.weight.device.type == "cpu" and deferred.proj.weight.requires_grad
    assert not deferred.proj.weight.is_inference()
    for k, v in eager.state_dict().items():
        assert torch.equal(deferred.state_dict()[k], v), k


def test_meta_init_dtype_leaves_other_threads_dtype_alone():
    stop = threading.Event()
    seen: set[torch.dtype] = set()

    def eager_worker():
        while not stop.is_set():
            seen.add(torch.zeros(2).dtype)
            seen.add(torch.get_default_dtype())
            seen.add((torch.arange(4) / 2).dtype)

    worker = threading.Thread(target=eager_worker)
    worker.start()
    try:
        for _ in range(20):
            with meta_init(dtype=torch.bfloat16):
                Positional()
                assert torch.zeros(1).dtype == torch.bfloat16
    finally:
        stop.set()
        worker.join()
    assert seen == {torch.float32}


def test_set_default_dtype_inside_a_dtype_block_stays_in_the_block():
    with meta_init(dtype=torch.bfloat16):
        torch.set_default_dtype(torch.float16)
        t = torch.zeros(1)
    assert t.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32


def test_meta_init_dtype_must_be_floating():
    with pytest.raises(ArgumentError, match="floating"), meta_init(dtype=torch.int8):
        pass


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_meta_init_device_meta_is_refused_with_what_to_use_and_allocates_nothing(device):
    # A deferred tensor has values to come; PyTorch's meta tensors never have any.
    with pytest.raises(ArgumentError, match=r"torch\.device\('meta'\)"), meta_init(device=device):
        nn.Linear(1024, 1024)
    assert not is_meta_init()  # no block was entered


def test_collections_are_rarer_inside_and_the_threshold_is_restored_after():
    import gc

    before = gc.get_threshold()
    with meta_init():
        with meta_init():
            assert gc.get_threshold()[0] >= 10_000
        assert gc.get_threshold()[0] >= 10_000
    assert gc.get_threshold() == before


def test_factories_report_the_default_device_torch_would_give():
    with meta_init():
        assert torch.empty(2).device == torch.get_default_device() == torch.device("cpu")
        with torch.device("meta"):
            assert torch.empty(2).device.type == "meta"  # PyTorch's own meta tensors, as eagerly
        torch.set_default_device("meta")
        try:
            assert torch.empty(2).device == torch.get_default_device()
            with torch.device("cpu"):
                w = torch.empty(2)
                assert w.device == torch.get_default_device() == torch.device("cpu")
        finally:
            torch.set_default_device(None)
        assert torch.zeros(2).device == torch.device("cpu")


def test_torch_compile_of_a_deferred_model_runs_deferred_then_real_after_materialize():

    from jupyter_metainit import is_deferred

    eager, m = eager_and_deferred(lambda: nn.Linear(3, 3))
    compiled = torch.compile(m, backend="eager")
    x = torch.randn(2, 3)
    assert is_deferred(compiled(x))
    materialize(m)
    assert torch.equal(compiled(x), eager(x))


def test_a_deep_copy_of_a_real_tensor_inside_the_block_is_a_deferred_copy_with_its_values():
    real = torch.arange(6.0).requires_grad_()
    real.note = "kept"
    with meta_init():
        copied = copy.deepcopy(real)
    assert is_deferred(copied) and copied.requires_grad and copied.note == "kept"
    assert torch.equal(materialize(copied), real.detach())


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.randn_like(x, device="cpu"),
        lambda x: torch.rand_like(input=x, device="cpu"),
        lambda x: torch.randint_like(x, 10, device="cpu"),
        lambda x: torch.zeros_like(x, device="cpu"),
        lambda x: torch.full_like(x, 2.5, device="cpu"),
        lambda x: x.new_ones(2, 3, device="cpu"),
    ],
    ids=["randn_like", "rand_like", "randint_like", "zeros_like", "full_like", "new_ones"],
)
def test_factory_from_a_meta_tensors_metadata_equals_eager(make):
    def build():
        x = torch.empty(3, 4, device="meta").t()  # strides the result keeps
        return make(x), torch.randn(2)  # and the generator goes on where eager's does

    eager, deferred = eager_and_deferred(build)
    assert all(is_deferred(t) for t in deferred)
    materialize(list(deferred))
    for a, b in zip(eager, deferred, strict=True):
        assert a.stride() == b.stride() and a.dtype == b.dtype and torch.equal(a, b)
