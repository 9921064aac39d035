"""Loading a subtree's real weights from safetensors files instead of replaying init."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from jupyter_metainit import dematerialize, is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import MaterializationError


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)


@pytest.fixture
def sharded(tmp_path):
    torch.manual_seed(1)
    real = Model()
    sd = {k: v.detach().clone() for k, v in real.state_dict().items()}
    keys = sorted(sd)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half],
              "model-00002-of-00002.safetensors": keys[half:]}  # fmt: skip
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / fname))
        weight_map.update({k: fname for k in ks})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return real, index


def test_subtree_from_a_sharded_set(sharded):
    real, index = sharded
    with meta_init():
        m = Model()
    with pytest.raises(MaterializationError, match="root="):
        materialize(m.layers[2], checkpoint=index)
    materialize(m.layers[2], checkpoint=index, root=m)
    assert torch.equal(m.layers[2].weight, real.layers[2].weight)
    assert torch.equal(m.layers[2].bias, real.layers[2].bias)
    assert is_deferred(m.layers[1]) and is_deferred(m.head)


def test_whole_model_from_one_file(tmp_path):
    torch.manual_seed(3)
    real = Model()
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone() for k, v in real.state_dict().items()}, str(path))
    with meta_init():
        m = Model()
    materialize(m, checkpoint=path)
    for a, b in zip(real.state_dict().values(), m.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_missing_keys_error_by_default_and_init_on_request(tmp_path):
    torch.manual_seed(0)
    eager = Model()
    path = tmp_path / "partial.safetensors"
    save_file({"head.weight": torch.zeros(2, 8)}, str(path))
    torch.manual_seed(0)
    with meta_init():
        m = Model()
    with pytest.raises(MaterializationError, match="missing='init'"):
        materialize(m.head, checkpoint=path)
    assert is_deferred(m.head)
    materialize(m.head, checkpoint=path, missing="init")
    assert torch.equal(m.head.weight, torch.zeros(2, 8))
    assert torch.equal(m.head.bias, eager.head.bias)


def test_shape_mismatch_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    save_file({"weight": torch.zeros(3, 3), "bias": torch.zeros(8)}, str(path))
    with meta_init():
        lin = nn.Linear(8, 8)
    with pytest.raises(MaterializationError, match=r"weight: checkpoint shape \(3, 3\)"):
        materialize(lin, checkpoint=path)
    assert is_deferred(lin)


def test_dtype_mismatch_is_a_clear_error(tmp_path):
    path = tmp_path / "half.safetensors"
    save_file({"weight": torch.zeros(8, 8, dtype=torch.float16),
               "bias": torch.zeros(8, dtype=torch.float16)}, str(path))  # fmt: skip
    with meta_init():
        lin = nn.Linear(8, 8)
    with pytest.raises(MaterializationError, match="dtype"):
        materialize(lin, checkpoint=path)
    materialize(lin, checkpoint=path, dtype=torch.float16)
    assert lin.weight.dtype == torch.float16


def test_parts_materialized_earlier_are_loaded_too_in_place(tmp_path):
    torch.manual_seed(1)
    real = Model()
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone() for k, v in real.state_dict().items()}, str(path))
    torch.manual_seed(0)
    with meta_init():
        m = Model()
    materialize(m.layers[1])  # from init
    weight = m.layers[1].weight
    materialize(m, checkpoint=path)
    assert m.layers[1].weight is weight  # the same object, now holding the file's values
    for k, v in real.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_a_real_part_with_the_wrong_shape_changes_nothing(tmp_path):
    torch.manual_seed(1)
    real = Model()
    sd = {k: v.detach().clone() for k, v in real.state_dict().items()}
    sd["layers.1.weight"] = torch.zeros(3, 3)
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    with meta_init():
        m = Model()
    materialize(m.layers[1])
    before = m.layers[1].weight.detach().clone()
    with pytest.raises(MaterializationError, match=r"layers\.1\.weight"):
        materialize(m, checkpoint=path)
    assert torch.equal(m.layers[1].weight, before)
    assert is_deferred(m.layers[0].weight) and is_deferred(m.head.weight)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda tmp: tmp, IsADirectoryError, "is a directory"),
        (lambda tmp: 123, TypeError, "checkpoint= takes"),
        (lambda tmp: [], ValueError, "empty"),
        (lambda tmp: tmp / "nope.safetensors", FileNotFoundError, "not found"),
        (lambda tmp: _write(tmp / "i.index.json", "{}"), MaterializationError, "weight_map"),
        (lambda tmp: _write(tmp / "x.safetensors", "garbage"), MaterializationError, "cannot"),
    ],
    ids=["directory", "number", "empty", "missing", "index_without_weight_map", "not_safetensors"],
)
def test_bad_checkpoint_arguments_are_clear_errors(tmp_path, make, error, match):
    with meta_init():
        m = Model()
    with pytest.raises(error, match=match):
        materialize(m, checkpoint=make(tmp_path))
    assert is_deferred(m.layers[0].weight)


def _write(path, text):
    path.write_text(text)
    return path


def test_bytes_paths_work(tmp_path):
    torch.manual_seed(1)
    real = Model()
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone() for k, v in real.state_dict().items()}, str(path))
    with meta_init():
        m = Model()
    materialize(m, checkpoint=bytes(path))
    assert torch.equal(m.head.weight, real.head.weight)


def test_root_that_does_not_contain_the_part_is_a_clear_error(sharded):
    _, index = sharded
    with meta_init():
        m, other = Model(), Model()
    with pytest.raises(MaterializationError, match="root= does not contain"):
        materialize(m.layers[0], checkpoint=index, root=other)


def _saved(tmp_path, seed=1):
    torch.manual_seed(seed)
    real = Model()
    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone() for k, v in real.state_dict().items()}, str(path))
    return real, path


def test_a_part_loaded_with_keep_cache_gets_the_checkpoint_again_after_freeing(tmp_path):
    real, path = _saved(tmp_path)
    with meta_init():
        m = Model()
    materialize(m.layers[2], checkpoint=path, root=m, keep_cache=True)
    dematerialize(m.layers[2])
    assert is_deferred(m.layers[2])
    materialize(m.layers[2])  # no checkpoint= now: the recording reads the file again
    assert torch.equal(m.layers[2].weight, real.layers[2].weight)
    assert torch.equal(m.layers[2].bias, real.layers[2].bias)


def test_a_part_loaded_from_a_checkpoint_can_be_freed_without_keep_cache(tmp_path):
    real, path = _saved(tmp_path)
    with meta_init():
        m = Model()
    materialize(m.head, checkpoint=path, root=m)
    dematerialize(m.head)  # compared with the file, as tensors opened from it are
    materialize(m.head)
    assert torch.equal(m.head.weight, real.head.weight)


def test_a_real_part_loaded_in_place_frees_to_the_checkpoint_values(tmp_path):
    real, path = _saved(tmp_path)
    with meta_init():
        m = Model()
    materialize(m.head, keep_cache=True)  # from init
    materialize(m, checkpoint=path)  # loads the real head in place
    dematerialize(m.head)
    materialize(m.head)
    assert torch.equal(m.head.weight, real.head.weight)


def test_a_loaded_part_whose_file_was_deleted_refuses_to_free_and_mentions_force(tmp_path):
    _, path = _saved(tmp_path)
    with meta_init():
        m = Model()
    materialize(m.head, checkpoint=path, root=m, keep_cache=True)
    path.unlink()
    with pytest.raises(MaterializationError, match=r"weight .*no longer exists.*force=True"):
        dematerialize(m.head)
    assert not is_deferred(m.head)
    dematerialize(m.head, force=True)
    assert is_deferred(m.head)


def test_a_loaded_part_trained_since_refuses_to_free(tmp_path):
    _, path = _saved(tmp_path)
    with meta_init():
        m = Model()
    materialize(m.head, checkpoint=path, root=m, keep_cache=True)
    m.head.weight.data[0, 0] += 1  # a write the version counter misses
    with pytest.raises(MaterializationError, match=r"weight .*force=True"):
        dematerialize(m.head)


def test_a_corrupt_shard_reached_through_the_index_is_named(sharded):
    _, index = sharded
    shard = index.parent / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with meta_init():
        m = Model()
    with pytest.raises(MaterializationError, match=r"model-00002-of-00002\.safetensors.*corrupt"):
        materialize(m, checkpoint=index)
    assert is_deferred(m.layers[0]) and is_deferred(m.head)


def test_a_truncated_shard_reached_through_the_index_is_named(sharded):
    _, index = sharded
    shard = index.parent / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-40])
    with meta_init():
        m = Model()
    with pytest.raises(MaterializationError, match=r"model-00001-of-00002\.safetensors"):
        materialize(m, checkpoint=index)
    assert is_deferred(m.layers[0])


def test_an_index_with_a_non_string_file_name_is_a_clear_error(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"head.weight": 5}}))
    with meta_init():
        m = Model()
    with pytest.raises(MaterializationError, match=r"5 as the file of 'head.weight'"):
        materialize(m, checkpoint=index)


def test_a_part_loaded_and_cast_frees_to_the_cast_checkpoint_values(tmp_path):
    real, path = _saved(tmp_path)
    with meta_init():
        m = Model()
    materialize(m.head, checkpoint=path, root=m, dtype=torch.bfloat16, keep_cache=True)
    dematerialize(m.head)
    materialize(m.head)
    assert torch.equal(m.head.weight, real.head.weight.to(torch.bfloat16))


class KeepsTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Module()
        self.inner.lin = nn.Linear(3, 3)
        self.inner.tables = {"k": torch.randn(2)}
        self.inner.freqs = torch.arange(4.0)


@pytest.mark.parametrize("part", ["whole", "part_with_root"])
def test_tensor_attributes_keep_their_init_when_loading_a_checkpoint(tmp_path, part):
    torch.manual_seed(0)
    eager = KeepsTables()
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in eager.state_dict().items()}, str(path))
    torch.manual_seed(0)
    with meta_init():
        m = KeepsTables()
    if part == "whole":
        materialize(m, checkpoint=path)
    else:
        materialize(m.inner, checkpoint=path, root=m)
    assert not is_deferred(m.inner)
    assert torch.equal(m.inner.tables["k"], eager.inner.tables["k"])
    assert torch.equal(m.inner.freqs, eager.inner.freqs)
    assert torch.equal(m.inner.lin.weight, eager.inner.lin.weight)
