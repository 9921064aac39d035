"""``save`` where files may not be as large as a checkpoint's: a process file-size limit
(``ulimit -f``, RLIMIT_FSIZE) or a file system's largest file (FAT32's 4 GiB), said as
"file too large for this file system" with the ``max_shard_size`` that fits; and ``O_DIRECT``
writes a file system refuses midway, written through the page cache instead."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _twins import eager_and_deferred
from safetensors.torch import save_file
from torch import nn

from jupyter_metainit.saving import save

LIMIT = 3_000_000  # bytes; not a multiple of the block: an O_DIRECT write is cut unaligned

# Run in a child process (the limit is the process's): save a deferred model of six 1 MiB
# layers under LIMIT, set before the save ("before") or from its progress callback once its
# checks are done ("while", as a file system that stops a file mid-write), then save again
# with the max_shard_size the error names; print what happened as JSON.
_SAVE_UNDER_A_LIMIT = """
import importlib, json, os, re, resource, sys
import torch
from torch import nn
from jupyter_metainit import meta_init
from jupyter_metainit.saving import save

directory, fmt, when, way, limit = sys.argv[1:6]
if way == "pwrite":
    writer = importlib.import_module("jupyter_metainit.saving.writer")
    writer.can_write_direct = writer.can_map = lambda: False

def set_limit(*_):
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))

torch.manual_seed(0)
with meta_init():
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
if when == "before":
    set_limit()
try:
    save(model, directory, format=fmt, progress=set_limit if when == "while" else None)
    first = {"error": None}
except OSError as exc:
    first = {"errno": exc.errno, "error": exc.strerror, "left": os.listdir(directory)}
size = re.search(r"max_shard_size='([^']+)'", first["error"] or "")
second = None
if size:
    save(model, directory, format=fmt, max_shard_size=size.group(1))
    second = sorted(os.listdir(directory))
print(json.dumps({"first": first, "second": second}))
"""


def _save_under_a_limit(directory: Path, fmt: str, when: str, way: str = "direct",
                        limit: int = LIMIT) -> dict[str, Any]:  # fmt: skip
    directory.mkdir()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_UNDER_A_LIMIT, str(directory), fmt, when, way, str(limit)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]  # SIGXFSZ is ignored: the process lives
    return json.loads(done.stdout.splitlines()[-1])


def _eager_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).state_dict()


def _loads_as_eager(directory: Path, fmt: str) -> bool:
    eager = _eager_state()
    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        state = {k: torch.zeros_like(v) for k, v in eager.items()}
        dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    else:
        from safetensors.torch import load_file

        state = {}
        for shard in directory.glob("*.safetensors"):
            state.update(load_file(shard))
    return state.keys() == eager.keys() and all(torch.equal(state[k], eager[k]) for k in eager)


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_file_size_limit_is_refused_before_writing_with_the_shard_size_that_fits(tmp_path, fmt):
    result = _save_under_a_limit(tmp_path / "ckpt", fmt, "before")
    first = result["first"]
    assert first["errno"] == errno.EFBIG and first["left"] == []
    assert first["error"].startswith("file too large for this file system (this process may "
                                     "write files of at most 2.86 MiB (ulimit -f); ")  # fmt: skip
    assert "use max_shard_size='2.7MB'. Nothing was saved" in first["error"]
    assert result["second"] is not None and len(result["second"]) > 2  # shards, and it worked
    assert _loads_as_eager(tmp_path / "ckpt", fmt)


@pytest.mark.parametrize(("fmt", "way"), [("safetensors", "direct"), ("safetensors", "pwrite"),
                                          ("dcp", "direct")])  # fmt: skip
def test_a_file_stopped_mid_write_says_file_too_large_with_the_shard_size_that_fits(
    tmp_path, fmt, way
):
    # The limit comes once the save's checks are done: as a file system whose largest file is
    # smaller than the checkpoint's (the O_DIRECT write cut at it is refused with EINVAL, and
    # written through the page cache up to the limit instead).
    result = _save_under_a_limit(tmp_path / "ckpt", fmt, "while", way)
    first = result["first"]
    assert first["errno"] == errno.EFBIG and first["left"] == []
    assert first["error"].startswith("file too large for this file system (it stopped ")
    assert "at 2.86 MiB); use max_shard_size='2.7MB'. Nothing was saved" in first["error"]
    assert _loads_as_eager(tmp_path / "ckpt", fmt)


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_tensor_larger_than_the_limit_says_no_shard_size_helps(tmp_path, fmt):
    first = _save_under_a_limit(tmp_path / "ckpt", fmt, "before", limit=500_000)["first"]
    assert first["errno"] == errno.EFBIG and first["left"] == []
    assert "no max_shard_size helps: 0.weight alone is 1.00 MiB" in first["error"]


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_an_o_direct_write_refused_mid_file_goes_through_the_page_cache_with_the_same_bytes(
    tmp_path, monkeypatch
):
    # A file system that takes O_DIRECT at first, then refuses a write in the middle of the
    # file (EINVAL): that write and the file's later ones are buffered, the bytes the same.
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if not refused and offset >= 8192 and _is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    # outside the package (fault injection): the os refuses a write
    monkeypatch.setattr(os, "pwrite", pwrite)
    eager, deferred = eager_and_deferred(
        lambda: nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 7))
    )
    save(deferred, tmp_path / "ours")
    monkeypatch.undo()
    if not refused:
        pytest.skip("this file system refuses O_DIRECT: nothing to refuse midway")
    save_file(eager.state_dict(), tmp_path / "eager.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "eager.safetensors").read_bytes()


def test_a_model_saves_in_one_file_when_the_limit_is_larger(tmp_path):
    result = _save_under_a_limit(tmp_path / "ckpt", "safetensors", "before", limit=10_000_000)
    assert result["first"] == {"error": None}
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model.safetensors"]
    assert _loads_as_eager(tmp_path / "ckpt", "safetensors")
