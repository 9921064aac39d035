"""Memory goes back: build -> materialize -> del, repeated as a notebook re-runs a cell, keeps
resident memory where eager construction keeps it (``core/runtime/heap``)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from jupyter_metainit.core.runtime import heap

glibc = pytest.mark.skipif(heap._malloc_trim() is None, reason="needs glibc's malloc_trim")

# A ~96 MiB model (24 x 4 MiB weights): over the 64 MiB at which exact replay splits across the
# pool's threads, each tensor in glibc's heaps (under its 32 MiB mmap ceiling).
_CYCLES = """
import gc, json, os, sys, torch
from torch import nn
import jupyter_metainit as mi

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

out = []
for _ in range({cycles}):
    torch.manual_seed(0)
    with mi.meta_init():
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])
    mi.materialize(model, rng="{rng}")
    del model
    gc.collect()
    out.append(rss())
print(json.dumps(out))
"""


def _rss_after_each_cycle(rng: str, cycles: int) -> list[int]:
    code = textwrap.dedent(_CYCLES.format(rng=rng, cycles=cycles))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(proc.stdout.splitlines()[-1])


@glibc
@pytest.mark.parametrize(("rng", "cycles"), [("exact", 30), ("fast", 10)])
def test_rebuilding_materializing_and_deleting_a_model_keeps_resident_memory_flat(rng, cycles):
    rss = _rss_after_each_cycle(rng, cycles)
    # Eager construction moves by up to ~40 MiB between cycles here; before, exact mode grew
    # by ~90 MiB (a whole model) every cycle, and either mode kept about one model resident.
    grown = [(i + 1, (r - rss[0]) >> 20) for i, r in enumerate(rss) if r - rss[0] > 48 << 20]
    assert not grown, f"(cycle, MiB over the first cycle's RSS): {grown}"


def test_watching_a_tensor_keeps_neither_it_nor_its_memory_alive():
    t = torch.empty(1 << 18)
    heap.return_when_freed([t])
    storage = weakref.ref(t.untyped_storage())
    del t
    gc.collect()
    assert storage() is None


@glibc
def test_freed_memory_of_watched_tensors_is_counted_until_it_is_returned():
    heap.return_freed_memory()
    t = torch.empty(1 << 18)  # 1 MiB: under RETURN_EVERY, so counted and not yet returned
    view = t[10:]
    heap.return_when_freed([t, view])  # one storage, counted once
    del t
    assert heap.unreturned_bytes() == 0  # the view still holds the memory
    del view
    assert heap.unreturned_bytes() == 1 << 20
    assert heap.return_freed_memory()
    assert heap.unreturned_bytes() == 0


def test_meta_sparse_and_memory_glibc_maps_alone_are_not_watched():
    big = torch.empty(heap._MAPPED_ALONE // 4)
    heap.return_when_freed(
        [torch.empty(4, device="meta"), torch.eye(3).to_sparse(), big, torch.empty(0)]
    )
    assert id(big.untyped_storage()) not in heap._watched
    assert len([k for k in heap._watched if heap._watched[k][0]() is None]) == 0
