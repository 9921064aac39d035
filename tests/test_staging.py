"""Where a save writes before its files are final, and what it leaves in the destination: its
own files, an earlier checkpoint's files replaced, everything else untouched; nothing at all
after a failure."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from _twins import deferred
from safetensors.torch import load_file
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import MetaInitError
from jupyter_metainit.saving import save

transformers = pytest.importorskip("transformers")

from tests._models import llama_config  # noqa: E402


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=False))


def _cancel_at_first_report(done: int, total: int) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_save_into_a_directory_keeps_the_files_that_are_not_its_own(tmp_path, fmt):
    (tmp_path / "train.py").write_text("print('mine')")
    (tmp_path / "data").mkdir()
    save(deferred(_mlp), tmp_path, format=fmt)
    assert (tmp_path / "train.py").read_text() == "print('mine')"
    assert (tmp_path / "data").is_dir()


def test_a_dcp_save_replaces_an_earlier_dcp_checkpoint_in_the_directory(tmp_path):
    import torch.distributed.checkpoint as dcp

    save(deferred(_mlp, seed=1), tmp_path, format="dcp")
    (tmp_path / "__9_9.distcp").write_bytes(b"an earlier save's shard")
    save(deferred(_mlp, seed=2), tmp_path, format="dcp")
    assert not (tmp_path / "__9_9.distcp").exists()
    torch.manual_seed(2)
    eager = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    state = {k: torch.zeros_like(v) for k, v in eager.state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(state[k], v) for k, v in eager.state_dict().items())


def test_the_staging_directory_is_inside_the_destination(tmp_path):
    seen: list[list[str]] = []
    destination = tmp_path / "ckpt"
    save(deferred(_mlp), destination, progress=lambda d, t: seen.append(os.listdir(destination)))
    assert seen and all(any(n.startswith(".saving-") for n in names) for names in seen)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert not any(n.startswith(".saving-") for n in os.listdir(destination))


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_failed_save_into_a_new_directory_leaves_no_directory(tmp_path, fmt):
    with pytest.raises(KeyboardInterrupt):
        save(deferred(_mlp), tmp_path / "new", format=fmt, progress=_cancel_at_first_report)
    assert os.listdir(tmp_path) == []


def test_a_failed_save_into_a_checkpoint_leaves_its_files_as_they_were(tmp_path):
    save(deferred(_mlp, seed=1), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        save(deferred(_mlp, seed=2), tmp_path, progress=_cancel_at_first_report)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_sharded_save_over_a_single_file_removes_the_single_file(tmp_path):
    # from_pretrained prefers model.safetensors: left there, it would load the earlier model
    save(deferred(_llama, seed=1), tmp_path)
    newer = deferred(_llama, seed=2)
    save(newer, tmp_path, max_shard_size="100KB")
    assert not (tmp_path / "model.safetensors").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    materialize(newer)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in newer.state_dict().items())


def test_save_pretrained_sharded_over_a_single_file_removes_the_single_file(tmp_path):
    deferred(_llama, seed=1).save_pretrained(tmp_path)
    deferred(_llama, seed=2).save_pretrained(tmp_path, max_shard_size="100KB")
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "model.safetensors.index.json").exists()


def test_save_pretrained_of_one_file_over_shards_removes_their_index(tmp_path):
    deferred(_llama, seed=1).save_pretrained(tmp_path, max_shard_size="100KB")
    deferred(_llama, seed=2).save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "config.json", "generation_config.json", "model.safetensors",
    ]  # fmt: skip


def test_a_directory_where_a_checkpoint_file_goes_stops_the_save_before_anything_moves(tmp_path):
    save(deferred(_mlp, seed=1), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(IsADirectoryError, match="Nothing was replaced"):
        save(deferred(_mlp, seed=2), tmp_path)
    assert sorted(os.listdir(tmp_path)) == before


_CUT_SHORT = [PermissionError(1, "Operation not permitted"), KeyboardInterrupt()]


@pytest.mark.parametrize("failure", _CUT_SHORT, ids=["cannot-move", "ctrl-c"])
def test_a_publish_cut_short_puts_the_earlier_checkpoint_back_whole(tmp_path, monkeypatch, failure):
    # a shard that cannot be replaced (immutable, another owner's) or Ctrl-C while files move
    save(deferred(_llama, seed=1), tmp_path, max_shard_size="100KB")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_replace, calls = os.replace, []

    def replace_failing_at_the_fourth(src: str, dst: str) -> None:
        calls.append(src)
        if len(calls) == 4:
            raise failure
        real_replace(src, dst)

    # outside the package (fault injection): the os fails a rename
    monkeypatch.setattr(os, "replace", replace_failing_at_the_fourth)
    with pytest.raises(type(failure)) as caught:
        save(deferred(_llama, seed=2), tmp_path, max_shard_size="100KB")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert ".saving" not in str(caught.value)


def test_a_failed_save_into_new_nested_directories_removes_every_one_it_made(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        save(deferred(_mlp), tmp_path / "a" / "b" / "c", progress=_cancel_at_first_report)
    assert os.listdir(tmp_path) == []


def test_a_link_to_a_missing_directory_is_refused_before_any_work(tmp_path):
    (tmp_path / "ckpt").symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        save(deferred(_mlp), tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_save_pretrained_leaves_another_variants_shards(tmp_path):
    model = deferred(_llama, seed=1)
    model.save_pretrained(tmp_path, max_shard_size="100KB", variant="fp16")
    variant = sorted(os.listdir(tmp_path))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert set(variant) <= set(os.listdir(tmp_path))


def test_a_non_floating_dtype_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="not one"):
        save(deferred(_mlp), tmp_path / "int8", dtype=torch.int8)
    assert os.listdir(tmp_path) == []


def test_a_dict_holding_something_else_than_tensors_names_the_key(tmp_path):
    with pytest.raises(TypeError, match="'step' holds NoneType"):
        save({"w": torch.zeros(2), "step": None}, tmp_path / "d")


def test_a_full_disk_is_said_with_the_directory_and_the_size(tmp_path):
    volume = tmp_path / "small"
    if not _mount_tmpfs(volume, size="64K"):
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN")
    try:
        with pytest.raises(OSError, match=f"no space left on the device of {volume}"):
            save(deferred(_llama), volume)
        assert os.listdir(volume) == []
    finally:
        subprocess.run(["umount", "--lazy", str(volume)], check=False)


def test_a_recording_that_reads_a_meta_tensor_is_refused_with_its_line_and_nothing_written(
    tmp_path,
):
    class CopiedFromMeta(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(3))
            self.b.copy_(torch.empty(3, device="meta"))

    with meta_init():
        model = CopiedFromMeta()
    with pytest.raises(MetaInitError, match=r"meta device \(aten\.copy_.*test_staging\.py"):
        save(model, tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []


def test_a_dcp_save_on_a_full_disk_says_so_with_the_sizes(tmp_path):
    volume = tmp_path / "small"
    if not _mount_tmpfs(volume, size="1M"):
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN")
    try:
        with meta_init():
            model = nn.Linear(1024, 1024)  # 4 MiB
        with pytest.raises(OSError, match=r"no space left .*4\.00 MiB of tensors"):
            save(model, volume / "ckpt", format="dcp")
        assert os.listdir(volume) == []
    finally:
        subprocess.run(["umount", "--lazy", str(volume)], check=False)


def test_a_new_checkpoint_directory_gets_the_permissions_of_the_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        save(deferred(_mlp), tmp_path / "shared")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "shared").st_mode) == 0o755


def test_an_empty_path_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="empty path"):
        save(deferred(_mlp), "")
    assert os.listdir(tmp_path) == []


def test_saving_a_model_back_over_the_files_it_is_read_from_is_refused(tmp_path):
    deferred(_llama, seed=1).save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with meta_init():
        opened = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(MetaInitError, match=r"model\.safetensors.*Materialize them first"):
        save(opened, tmp_path)
    with pytest.raises(MetaInitError, match="Materialize them first"):
        opened.save_pretrained(tmp_path, max_shard_size="100KB")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    materialize(opened)  # still readable: nothing was replaced
    assert not is_deferred(opened)


def test_a_model_materialized_from_its_files_can_be_saved_back_over_them(tmp_path):
    original = deferred(_llama, seed=1)
    original.save_pretrained(tmp_path)
    with meta_init():
        opened = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    materialize(opened)
    save(opened, tmp_path)
    materialize(original)
    saved = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in original.state_dict().items())


def _mount_tmpfs(path: os.PathLike, size: str = "64M") -> bool:
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return done.returncode == 0


def test_a_save_into_a_mounted_volume_replaces_its_checkpoint(tmp_path):
    # the volume's own file system: no rename across devices, no parent to write to
    volume = tmp_path / "volume"
    if not _mount_tmpfs(volume):
        pytest.skip("mounting a tmpfs needs root and CAP_SYS_ADMIN")
    try:
        save(deferred(_llama, seed=1), volume, max_shard_size="100KB")
        newer = deferred(_llama, seed=2)
        save(newer, volume)
        assert sorted(os.listdir(volume)) == [
            "config.json", "generation_config.json", "model.safetensors",
        ]  # fmt: skip
        materialize(newer)
        assert _equal_to_file(newer, volume / "model.safetensors")
    finally:
        subprocess.run(["umount", "--lazy", str(volume)], check=False)


def _equal_to_file(model: nn.Module, path: os.PathLike) -> bool:
    saved = load_file(path)  # mapped: gone (and the volume free to unmount) on return
    return all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


# A save in another process that stops in its progress callback (with its staging directory
# written) until it is killed.
_SAVE_THAT_HANGS = """
import sys, time
from torch import nn
from jupyter_metainit import meta_init, save

with meta_init():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))

def hang(done, total):
    print("writing", flush=True)
    time.sleep(600)

save(model, sys.argv[1], format=sys.argv[2], progress=hang)
"""


@contextmanager
def _save_in_another_process(destination: Path, fmt: str) -> Iterator[subprocess.Popen]:
    """A save writing into ``destination`` from a child process, until the block ends (or
    the test kills it)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", _SAVE_THAT_HANGS, str(destination), fmt],
        stdout=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"writing"
        yield child
    finally:
        child.kill()
        child.wait(timeout=60)
        child.stdout.close()


def _staging_names(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".saving-"))


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_save_removes_the_staging_directory_a_save_killed_with_sigkill_left(tmp_path, fmt):
    with _save_in_another_process(tmp_path, fmt) as child:
        left = _staging_names(tmp_path)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert left and _staging_names(tmp_path) == left  # a killed save cleans nothing up
    save(deferred(_mlp), tmp_path, format=fmt)
    assert _staging_names(tmp_path) == []


def test_a_save_leaves_the_staging_directory_of_a_running_save_alone(tmp_path):
    with _save_in_another_process(tmp_path, "safetensors"):
        running = _staging_names(tmp_path)
        save(deferred(_mlp), tmp_path)
        assert running and _staging_names(tmp_path) == running
        assert set(load_file(tmp_path / "model.safetensors")) == {"0.weight", "0.bias",
                                                                  "2.weight", "2.bias"}  # fmt: skip


def test_a_dcp_save_while_another_writes_the_directory_is_refused_and_harms_nothing(tmp_path):
    with _save_in_another_process(tmp_path, "dcp"):
        running = _staging_names(tmp_path)
        files = sorted(os.listdir(tmp_path / running[0]))
        with pytest.raises(FileExistsError, match=r"another save is writing into .* now"):
            save(deferred(_mlp), tmp_path, format="dcp")
        assert sorted(os.listdir(tmp_path / running[0])) == files


def test_a_staging_directory_without_an_owner_is_removed_only_once_old(tmp_path):
    # a save killed before it claimed its staging directory, or made by a version that did not
    for name in (".saving-abcd1234", ".saving-wxyz_789"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half written")
    long_ago = time.time() - 2 * 3600
    os.utime(tmp_path / ".saving-abcd1234", (long_ago, long_ago))
    save(deferred(_mlp), tmp_path)
    assert _staging_names(tmp_path) == [".saving-wxyz_789"]


def test_directories_named_like_staging_that_are_not_ours_stay(tmp_path):
    long_ago = time.time() - 2 * 3600
    names = [
        ".saving-Notes",
        ".saving-",
        ".saving-abcd1234.bak",
        ".saving-notes",
        ".saving-wxyz5678",
    ]
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / ".saving-wxyz5678" / "nested").mkdir()  # a save's holds files only
    for name in names:
        os.utime(tmp_path / name, (long_ago, long_ago))
    (tmp_path / ".saving-abcd1234").write_text("a file, not a directory")
    save(deferred(_mlp), tmp_path)
    assert _staging_names(tmp_path) == sorted([*names, ".saving-abcd1234"])
