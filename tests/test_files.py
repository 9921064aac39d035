"""Reading tensors from files inside meta_init records "these bytes of this file"."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init
from jupyter_metainit.core import tensor_source
from jupyter_metainit.core.errors import MaterializationError


@pytest.fixture
def weights(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(64, 32),
        "b": torch.randn(32).to(torch.bfloat16),
        "i": torch.arange(10),
    }
    path = tmp_path / "weights.safetensors"
    save_file(tensors, str(path))
    return tensors, path


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def test_load_file_gives_deferred_tensors_equal_to_an_eager_load(weights):
    tensors, path = weights
    with meta_init():
        loaded = load_file(str(path))
    assert all(is_deferred(t) for t in loaded.values())
    assert {k: (t.dtype, t.shape) for k, t in loaded.items()} == {
        k: (t.dtype, t.shape) for k, t in tensors.items()
    }
    materialize(list(loaded.values()))
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t), k


def test_get_tensor_and_sliced_get_slice(weights):
    tensors, path = weights
    with meta_init(), safe_open(str(path), framework="pt") as f:
        whole = f.get_tensor("w")
        rows = f.get_slice("w")[8:24]
        cols = f.get_slice("w")[:, 3:7]
    materialize([whole, rows, cols])
    assert torch.equal(whole, tensors["w"])
    assert torch.equal(rows, tensors["w"][8:24]) and torch.equal(cols, tensors["w"][:, 3:7])


def test_conversions_after_reading_are_recorded(weights):
    tensors, path = weights
    with meta_init():
        loaded = load_file(str(path))
        fused = torch.cat([loaded["w"].t(), loaded["w"].t()]).to(torch.float16)
    materialize(fused, device="cpu", dtype=torch.float16)
    assert torch.equal(fused, torch.cat([tensors["w"].t()] * 2).to(torch.float16))


def test_materializing_reads_only_the_requested_bytes(tmp_path):
    big = {f"t{i}": torch.full((1024, 1024), float(i)) for i in range(8)}  # 8 x 4 MiB
    path = tmp_path / "big.safetensors"
    save_file(big, str(path))
    with meta_init():
        loaded = load_file(str(path))
    before = _read_bytes()
    materialize(loaded["t5"])
    read = _read_bytes() - before
    # Regions of 1 MiB and more are mapped, not read: no read() call brings in other bytes.
    assert read < (4 << 20) * 1.1 + (64 << 10)
    assert torch.equal(loaded["t5"], big["t5"]) and is_deferred(loaded["t4"])


def test_torch_load_with_mmap_gives_deferred_tensors_that_keep_their_aliasing(tmp_path):
    w = torch.randn(6, 4)
    path = tmp_path / "state.pt"
    torch.save({"w": w, "view": w[1:3].t()}, path)
    with meta_init():
        state = torch.load(path, mmap=True, weights_only=True)
    assert all(is_deferred(t) for t in state.values())
    assert state["view"].stride() == (1, 4)
    materialize(list(state.values()))
    assert torch.equal(state["w"], w) and torch.equal(state["view"], w[1:3].t())
    state["w"][1, 0] = 42.0  # the two were one storage in the file, and still are
    assert state["view"][0, 0] == 42.0


def test_load_state_dict_with_assign_inside_meta_init(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "linear.pt"
    torch.save(model.state_dict(), path)
    with meta_init():
        deferred = torch.nn.Linear(4, 3)
        deferred.load_state_dict(torch.load(path, mmap=True, weights_only=True), assign=True)
    assert is_deferred(deferred) and tensor_source(deferred.weight) == "checkpoint"
    materialize(deferred)
    assert torch.equal(deferred.weight, model.weight) and torch.equal(deferred.bias, model.bias)


def test_a_file_changed_after_opening_is_a_clear_error_and_nothing_is_loaded(weights):
    tensors, path = weights
    with meta_init():
        loaded = load_file(str(path))
    time.sleep(0.01)
    save_file({k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()}, str(path))
    with pytest.raises(MaterializationError, match=f"{path}.* changed since"):
        materialize(list(loaded.values()))
    assert all(is_deferred(t) for t in loaded.values())


def test_a_missing_file_is_a_clear_error(weights):
    _, path = weights
    with meta_init():
        loaded = load_file(str(path))
    os.remove(path)
    with pytest.raises(MaterializationError, match="no longer exists"):
        materialize(loaded["w"])
    assert is_deferred(loaded["w"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_a_clear_error(weights):
    _, path = weights
    with meta_init():
        loaded = load_file(str(path))
    os.chmod(path, 0)
    try:
        with pytest.raises(MaterializationError, match="permission denied"):
            materialize(loaded["w"])
    finally:
        os.chmod(path, 0o644)


def test_tensors_read_from_a_file_can_be_freed_without_keep_cache(weights):
    _, path = weights
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["w"])
    assert tensor_source(loaded["w"]) == "checkpoint"
    dematerialize(loaded["w"])
    assert is_deferred(loaded["w"])
    materialize(loaded["w"])
    loaded["w"].data[0, 0] += 1  # a write the version counter misses: compared with the file
    with pytest.raises(MaterializationError, match="written since"):
        dematerialize(loaded["w"])
    assert not is_deferred(loaded["w"])


@pytest.fixture
def big_weights(tmp_path):
    """A checkpoint well past the 64 KiB header the identity check digests."""
    tensors = {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(0))}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path))
    return tensors, path


def test_a_checkpoint_rewritten_in_place_with_its_mtime_restored_is_refused_before_use(
    big_weights,
):
    _, path = big_weights
    with meta_init():
        loaded = load_file(str(path))
    st = os.stat(path)
    with open(path, "r+b") as f:  # same size, same inode, bytes past the first 64 KiB
        f.seek(st.st_size - 1024)
        f.write(b"\x7f" * 512)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p and rsync -t do
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(MaterializationError, match=f"{path}.* changed since"):
        materialize(loaded["w"])
    assert is_deferred(loaded["w"])


def test_bytes_changed_without_new_timestamps_are_refused_before_use(big_weights):
    import mmap

    tensors, path = big_weights
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    shared[-8] = shared[-8]  # the first write through the mapping stamps the file's times
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["w"])
    assert torch.equal(loaded["w"], tensors["w"])
    dematerialize(loaded["w"])
    stamp = os.stat(path)
    shared[-8] ^= 0xFF  # a page already written: the kernel stamps no new time
    try:
        if os.stat(path).st_ctime_ns != stamp.st_ctime_ns:
            pytest.skip("this kernel stamps every write through a mapping")
        with pytest.raises(MaterializationError, match="differ from an earlier read"):
            materialize(loaded["w"])
        assert is_deferred(loaded["w"])
    finally:
        shared.close()


def test_a_freed_tensor_whose_file_was_deleted_says_force_true_frees_it(weights):
    _, path = weights
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["w"])
    os.remove(path)
    with pytest.raises(MaterializationError, match=r"no longer exists.*force=True"):
        dematerialize(loaded["w"])
    assert not is_deferred(loaded["w"])
    dematerialize(loaded["w"], force=True)
    assert is_deferred(loaded["w"])


# ---------------------------------------------------------------------------------------------
# whole tensors from a file are mapped (copy-on-write), as safetensors' own loading does


@pytest.fixture
def large(tmp_path):
    torch.manual_seed(0)
    tensors = {"big": torch.randn(512, 1024), "small": torch.randn(16)}  # 2 MiB, 64 bytes
    path = tmp_path / "large.safetensors"
    save_file(tensors, str(path))
    return tensors, path


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file mapped at ``t``'s memory, from /proc/self/maps (None: anonymous memory)."""
    address = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5].strip() if len(parts) == 6 else None
    return None


def test_a_large_tensor_materialized_from_a_file_maps_it_instead_of_copying(large):
    tensors, path = large
    with meta_init():
        loaded = load_file(str(path))
    materialize(list(loaded.values()))
    assert _mapped_file(loaded["big"]) == str(path)
    assert torch.equal(loaded["big"], tensors["big"])
    assert torch.equal(loaded["small"], tensors["small"])


def test_writing_a_mapped_tensor_leaves_the_file_unchanged(large):
    tensors, path = large
    before = path.read_bytes()
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["big"])
    loaded["big"].add_(1)
    assert path.read_bytes() == before
    assert torch.equal(loaded["big"], tensors["big"] + 1)


def test_a_mapped_tensor_frees_without_keep_cache_and_comes_back_equal(large):
    tensors, path = large
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["big"])
    dematerialize(loaded["big"])
    assert is_deferred(loaded["big"])
    materialize(loaded["big"])
    assert torch.equal(loaded["big"], tensors["big"])


def test_a_mapped_tensor_written_since_refuses_to_free(large):
    _, path = large
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["big"])
    loaded["big"].mul_(2)
    with pytest.raises(MaterializationError, match="force=True"):
        dematerialize(loaded["big"])


def test_a_written_mapped_tensor_read_inside_meta_init_keeps_its_current_values(large):
    tensors, path = large
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["big"])
    loaded["big"].add_(1)
    with meta_init():  # how safetensors hands over mapped bytes: asarray of the storage
        raw = torch.asarray(loaded["big"].untyped_storage(), dtype=torch.uint8)
        copy = raw.view(torch.float32).reshape(512, 1024)
    materialize(copy)
    assert torch.equal(copy, tensors["big"] + 1)


def test_mapped_bytes_changed_without_new_timestamps_after_a_free_are_refused(large):
    """A first mapping is not digested (its pages are the file's); freeing compares the tensor
    with the file and takes the digest that the next materialize must match."""
    import mmap

    tensors, path = large
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    middle = len(shared) // 2  # inside "big" (2 MiB of the file's 2 MiB and a bit)
    shared[middle] = shared[middle]  # the first write through the mapping stamps the times
    with meta_init():
        loaded = load_file(str(path))
    materialize(loaded["big"])
    assert _mapped_file(loaded["big"]) == str(path)
    assert torch.equal(loaded["big"], tensors["big"])
    dematerialize(loaded["big"])
    stamp = os.stat(path)
    shared[middle] ^= 0xFF  # a page already written: the kernel stamps no new time
    try:
        if os.stat(path).st_ctime_ns != stamp.st_ctime_ns:
            pytest.skip("this kernel stamps every write through a mapping")
        with pytest.raises(MaterializationError, match="differ from an earlier read"):
            materialize(loaded["big"])
        assert is_deferred(loaded["big"])
    finally:
        shared.close()
