"""The core's ``values_to_write`` (``replay/current_values``): exact values of deferred tensors for
``save`` and ``stats``, computed into the memory a ``Recycler`` hands on, copied only where a
tensor is part of a larger storage."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from jupyter_metainit import meta_init
from jupyter_metainit.core import Recycler, values_to_write


def _in_a_mapping_of(t: torch.Tensor, path) -> bool:
    with open("/proc/self/maps") as f:
        spans = [line.split()[0].split("-") for line in f if line.rstrip().endswith(str(path))]
    return any(int(lo, 16) <= t.data_ptr() < int(hi, 16) for lo, hi in spans)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_backed_tensor_is_read_from_the_files_pages_without_a_copy(tmp_path, dtype):
    # Its storage is the file's bytes (uint8), the tensor a dtype view of all of them.
    eager = torch.randn(512, 1024).to(dtype)  # over 1 MiB: mapped, not read
    path = tmp_path / "w.safetensors"
    save_file({"w": eager}, str(path))
    with meta_init():
        loaded = load_file(str(path))
    values = values_to_write(loaded["w"])
    assert _in_a_mapping_of(values, path)
    assert torch.equal(values, eager)


def test_part_of_a_checkpoint_backed_tensor_is_a_compact_copy(tmp_path):
    eager = torch.randn(512, 1024)
    path = tmp_path / "w.safetensors"
    save_file({"w": eager}, str(path))
    with meta_init():
        part = load_file(str(path))["w"][:, 3:7]
    values = values_to_write(part)
    assert values.is_contiguous() and values.untyped_storage().nbytes() == values.nbytes
    assert torch.equal(values, eager[:, 3:7])


def test_a_whole_tensor_is_computed_into_the_recyclers_memory():
    torch.manual_seed(0)
    with meta_init():
        w = torch.empty(64, 64).normal_()
    recycler = Recycler()
    recycler.start_batch([w.nbytes])
    [values] = values_to_write([w], recycler)
    recycler.settle([values])
    recycler.give_back([values])
    reused = recycler(w.nbytes)
    assert reused.data_ptr() == values.data_ptr()
    torch.manual_seed(0)
    assert torch.equal(values, torch.empty(64, 64).normal_())
