"""Failures leave every tensor deferred and still materializable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import MaterializationError, MetaInitError


def test_exception_in_replay_leaves_the_model_deferred():
    outside = torch.ones(512, 1024)  # large: referenced by the recording, not copied
    with meta_init():
        good = nn.Linear(4, 4)
        bad = nn.Parameter(outside * 3)
    model = nn.ParameterList([good.weight, bad])
    outside.mul_(2)  # makes `bad` impossible to replay
    with pytest.raises(MaterializationError):
        materialize(model)
    assert is_deferred(good.weight) and is_deferred(bad)
    materialize(good)
    assert not is_deferred(good)


def test_errors_share_a_base_class():
    assert issubclass(MaterializationError, MetaInitError)
    assert issubclass(MetaInitError, RuntimeError)


def test_uninitialized_lazy_module_says_to_run_a_forward_pass():
    with meta_init():
        m = nn.LazyLinear(3)
    with pytest.raises(MaterializationError, match="forward pass"):
        materialize(m)


def test_plain_meta_device_tensors_say_how_to_record_them():
    with torch.device("meta"):
        m = nn.Linear(2, 2)
    with pytest.raises(MaterializationError, match="meta_init"):
        materialize(m)


def test_a_deferred_model_moved_to_the_meta_device_says_to_pick_a_real_device():
    with meta_init():
        m = nn.Linear(2, 2)
    m.to("meta")
    with pytest.raises(
        MaterializationError, match=r"PyTorch's meta device .*never values.*device='cpu'"
    ):
        materialize(m)
    assert is_deferred(m)


_OUT_OF_MEMORY = """
import gc, resource, torch
from torch import nn
from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import NotEnoughMemoryError

with meta_init():
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(24)])  # 1.5 GiB
with open("/proc/self/statm") as f:
    size, resident = (int(x) * 4096 for x in f.read().split()[:2])
# room for about 1 GiB more: the whole model cannot fit, half of it can
resource.setrlimit(resource.RLIMIT_AS, (size + 1100 * 2**20, resource.RLIM_INFINITY))
try:
    materialize(model)
except NotEnoughMemoryError as error:
    kept = error  # held, as IPython holds the last error: it must not hold the replay
    print("error:", error)
assert all(is_deferred(p) for p in model.parameters())
gc.collect()
materialize(model[:12])  # needs the memory the failed call allocated
print("half:", not is_deferred(model[:12]) and is_deferred(model[12:]))
"""


def test_out_of_memory_releases_everything_and_says_what_was_needed():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_MEMORY], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    error = next(line for line in done.stdout.splitlines() if line.startswith("error:"))
    assert "needs 1.50 GiB" in error and "is free" in error and "Nothing was materialized" in error
    assert "half: True" in done.stdout
