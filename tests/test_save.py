"""``jupyter_metainit.save``: the values materialize would give, written in bounded memory, in
the layout transformers' ``save_pretrained`` writes (byte for byte), without changing the model."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _twins import eager_and_deferred
from safetensors.torch import load_file, save_file
from torch import nn

import jupyter_metainit
from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.saving import save
from jupyter_metainit.saving.safetensors_file import FileEntry
from jupyter_metainit.saving.writer import WRITE_VARIABLE

transformers = pytest.importorskip("transformers")

from tests._models import llama_config  # noqa: E402


def _files(directory: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(directory).iterdir()}


def test_a_deferred_llama_saves_the_same_bytes_as_eager_save_pretrained(tmp_path):
    eager, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    save(deferred, tmp_path / "ours")
    eager.save_pretrained(tmp_path / "eager")
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "eager"))


def test_a_sharded_save_has_the_same_files_and_bytes_as_eager_save_pretrained(tmp_path):
    eager, deferred = eager_and_deferred(
        transformers.LlamaForCausalLM, llama_config(tie_word_embeddings=False)
    )
    save(deferred, tmp_path / "ours", max_shard_size="100KB")
    eager.save_pretrained(tmp_path / "eager", max_shard_size="100KB")
    ours, theirs = _files(str(tmp_path / "ours")), _files(str(tmp_path / "eager"))
    assert "model.safetensors.index.json" in ours and len(ours) > 4
    assert ours == theirs


def test_saving_leaves_every_tensor_deferred(tmp_path):
    _, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    save(deferred, tmp_path / "ours")
    assert all(is_deferred(t) for t in deferred.state_dict().values())


def test_from_pretrained_loads_the_saved_model_with_eager_values(tmp_path):
    eager, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    save(deferred, tmp_path / "ours")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    for name, value in eager.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_from_pretrained_under_meta_init_then_materialize_gives_eager_values(tmp_path):
    eager, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    save(deferred, tmp_path / "ours", max_shard_size="100KB")
    with meta_init():
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    materialize(loaded)
    for name, value in eager.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_real_parts_of_a_partly_materialized_model_are_saved_as_they_are_now(tmp_path):
    eager, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    materialize(deferred.model.layers[0])
    with torch.no_grad():
        deferred.model.layers[0].mlp.up_proj.weight.mul_(3)
        eager.model.layers[0].mlp.up_proj.weight.mul_(3)
    save(deferred, tmp_path / "ours")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    for name, value in eager.state_dict().items():
        if name != "lm_head.weight":  # tied: saved once, under model.embed_tokens.weight
            assert torch.equal(saved[name], value), name
    assert is_deferred(deferred.model.layers[1].mlp.up_proj.weight)


def test_a_cancelling_progress_callback_leaves_nothing_at_the_path_and_the_model_deferred(
    tmp_path,
):
    _, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    calls = []

    def cancel_midway(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save(deferred, tmp_path / "ours", progress=cancel_midway)
    assert os.listdir(tmp_path) == []
    assert all(is_deferred(t) for t in deferred.state_dict().values())


def test_progress_ends_at_the_total_bytes_of_the_weights(tmp_path):
    _, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    seen: list[tuple[int, int]] = []
    save(deferred, tmp_path / "ours", progress=lambda done, total: seen.append((done, total)))
    weights = os.path.getsize(tmp_path / "ours" / "model.safetensors")
    header = 8 + int.from_bytes(
        (tmp_path / "ours" / "model.safetensors").read_bytes()[:8], "little"
    )
    assert seen[-1] == (weights - header, weights - header)
    assert all(done <= total for done, total in seen)


def test_saving_into_an_earlier_sharded_save_removes_its_stale_shards(tmp_path):
    _, deferred = eager_and_deferred(
        transformers.LlamaForCausalLM, llama_config(tie_word_embeddings=False)
    )
    save(deferred, tmp_path / "ours", max_shard_size="100KB")
    (tmp_path / "ours" / "notes.txt").write_text("mine")
    save(deferred, tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == [
        "config.json", "generation_config.json", "model.safetensors", "notes.txt",
    ]  # fmt: skip


def test_the_file_is_byte_identical_to_save_file_for_every_dtype(tmp_path):
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn,
              torch.int16, torch.float16, torch.bfloat16, torch.int32, torch.float32,
              torch.complex64, torch.float64, torch.int64]  # fmt: skip
    tensors = {f"t{len(dtypes) - k:02d}": torch.arange(5).to(d) for k, d in enumerate(dtypes)}
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 3)
    save(tensors, tmp_path / "ours")
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_dtype_casts_the_floating_point_tensors_only(tmp_path):
    model = nn.Linear(3, 4)
    model.register_buffer("steps", torch.arange(3))
    save(model, tmp_path / "ours", dtype=torch.bfloat16)
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved["weight"], model.weight.detach().to(torch.bfloat16))
    assert torch.equal(saved["steps"], torch.arange(3))


def test_a_plain_module_with_a_shared_parameter_saves_it_once_under_its_first_name(tmp_path):
    with meta_init():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
    save(model, tmp_path / "ours")
    assert sorted(load_file(tmp_path / "ours" / "model.safetensors")) == ["0.weight"]


def test_a_dropped_duplicate_name_is_kept_in_the_metadata_as_save_model_keeps_it(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_model

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    eager[1].weight = eager[0].weight
    save_model(eager, str(tmp_path / "theirs.safetensors"))
    with meta_init():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
    save(model, tmp_path / "ours")
    with safe_open(tmp_path / "theirs.safetensors", "pt") as theirs:
        expected = theirs.metadata()
    with safe_open(tmp_path / "ours" / "model.safetensors", "pt") as ours:
        assert (
            ours.metadata()
            == {"format": "pt", **expected}
            == {"format": "pt", "1.weight": "0.weight"}
        )


def test_importing_the_saving_package_leaves_jupyter_metainit_save_the_function(tmp_path):
    code = (
        "import inspect, torch, jupyter_metainit.saving, jupyter_metainit; "
        "assert inspect.isfunction(jupyter_metainit.save); "
        f"jupyter_metainit.save({{'a': torch.ones(2)}}, {str(tmp_path / 'ours')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert torch.equal(load_file(tmp_path / "ours" / "model.safetensors")["a"], torch.ones(2))
    assert jupyter_metainit.save is not None


def test_an_unknown_format_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="format must be 'safetensors' or 'dcp'"):
        save(nn.Linear(2, 2), tmp_path / "ours", format="pickle")


_PEAK_SCRIPT = """
import resource, torch
from torch import nn
from jupyter_metainit import meta_init
from jupyter_metainit.saving import save
from jupyter_metainit.saving.safetensors_file import FileEntry
with meta_init():
    model = nn.Sequential(*[nn.Linear(5120, 4096, bias=False) for _ in range(8)])  # 8 x 80 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
save(model, {path!r}, max_shard_size="200MB")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(after - before)
"""


def test_peak_memory_follows_the_largest_tensor_not_the_model(tmp_path):
    script = _PEAK_SCRIPT.format(path=str(tmp_path / "ours"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    growth = int(out.stdout.split()[-1])
    tensor = 5120 * 4096 * 4
    # One tensor being written, one being computed (no copy of it, nothing kept in a cache).
    assert growth <= 2 * tensor + (64 << 20), f"peak grew by {growth >> 20} MiB"  # model: 640 MiB


def test_a_model_on_the_meta_device_is_refused_before_anything_is_written(tmp_path):
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="weight has no values to save: it is on PyTorch"):
        save(model, tmp_path / "ours")
    assert os.listdir(tmp_path) == []


def test_a_tensor_recorded_for_a_gpu_is_saved_as_materialize_on_the_cpu_gives_it(tmp_path):
    with meta_init(device="cuda"):
        model = nn.Linear(4, 3)
    save(model, tmp_path / "ours")
    materialize(model, device="cpu")
    saved = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(saved["weight"], model.weight.detach())


def _mixtral_config() -> transformers.MixtralConfig:
    return transformers.MixtralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip


def test_fused_experts_are_saved_in_the_original_layout_as_save_pretrained_does(tmp_path):
    eager, deferred = eager_and_deferred(transformers.MixtralForCausalLM, _mixtral_config())
    save(deferred, tmp_path / "ours")
    eager.save_pretrained(tmp_path / "eager")
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "eager"))


# ---------------------------------------------------------------------------------------------
# writing deferred tensors with other tools: a clear error that names jupyter_metainit.save


def _deferred_linear() -> nn.Module:
    with meta_init():
        return nn.Linear(4, 3)


def test_safetensors_save_file_of_deferred_tensors_names_jupyter_metainit_save(tmp_path):
    with pytest.raises(RuntimeError, match=r"jupyter_metainit\.save"):
        save_file(_deferred_linear().state_dict(), tmp_path / "x.safetensors")


def test_torch_save_of_a_deferred_tensor_names_jupyter_metainit_save(tmp_path):
    with pytest.raises(TypeError, match=r"jupyter_metainit\.save"):
        torch.save(_deferred_linear().state_dict(), tmp_path / "x.pt")


def test_the_typed_storage_address_of_a_deferred_tensor_names_jupyter_metainit_save():
    with pytest.raises(RuntimeError, match=r"jupyter_metainit\.save"):
        _deferred_linear().weight.storage().data_ptr()


def test_save_pretrained_of_a_deferred_model_writes_what_save_writes(tmp_path):
    _, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    deferred.save_pretrained(tmp_path / "ours", max_shard_size="5GB")
    save(deferred, tmp_path / "save")
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "save"))


def test_save_pretrained_refusing_an_option_names_jupyter_metainit_save(tmp_path):
    _, deferred = eager_and_deferred(transformers.LlamaForCausalLM, llama_config())
    with pytest.raises(RuntimeError, match=r"jupyter_metainit\.save"):
        deferred.save_pretrained(tmp_path / "ours", push_to_hub=True)
    assert not (tmp_path / "ours").exists()


def test_sharded_fused_experts_land_in_the_shards_save_pretrained_puts_them_in(tmp_path):
    eager, deferred = eager_and_deferred(transformers.MixtralForCausalLM, _mixtral_config())
    save(deferred, tmp_path / "ours", max_shard_size="20KB")
    eager.save_pretrained(tmp_path / "eager", max_shard_size="20KB")
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "eager"))


@pytest.mark.parametrize("path", ["direct", "mapped", "pwrite"])
def test_every_write_path_gives_the_bytes_of_save_pretrained(tmp_path, monkeypatch, path):
    monkeypatch.setenv(WRITE_VARIABLE, path)  # the way save tries first
    eager, deferred = eager_and_deferred(
        transformers.LlamaForCausalLM, llama_config(tie_word_embeddings=False)
    )
    save(deferred, tmp_path / "ours", max_shard_size="100KB")
    eager.save_pretrained(tmp_path / "eager", max_shard_size="100KB")
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "eager"))


def test_an_unknown_write_way_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv(WRITE_VARIABLE, "o_direct")
    with pytest.raises(jupyter_metainit.ArgumentError, match=r"'direct'.*'mapped'.*'pwrite'"):
        save({"a": torch.ones(3)}, tmp_path / "ours")
    assert os.listdir(tmp_path) == []


def _large_layers() -> nn.Module:
    # Over MIN_STREAM_ELEMENTS in one batch, odd sizes: the fills run cut across the cores and
    # their parts are written while the rest is generated, at offsets in the middle of blocks.
    return nn.Sequential(nn.Linear(2047, 2049), nn.Linear(2049, 2047), nn.Linear(2047, 1031))


@pytest.mark.parametrize("path", ["direct", "mapped", "pwrite"])
def test_parts_written_while_generating_give_the_bytes_of_save_file(tmp_path, monkeypatch, path):
    monkeypatch.setenv(WRITE_VARIABLE, path)  # the way save tries first
    eager, deferred = eager_and_deferred(_large_layers)
    save(deferred, tmp_path / "ours")
    save_file(eager.state_dict(), tmp_path / "eager.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "eager.safetensors").read_bytes()


def test_a_file_system_refusing_o_direct_falls_back_to_the_same_bytes(tmp_path, monkeypatch):
    direct = __import__("jupyter_metainit.saving.direct", fromlist=["direct"])
    # internal fault injection: the O_DIRECT open refused (os.open would refuse every open)
    monkeypatch.setattr(direct.DirectFile, "open", classmethod(lambda cls, path, size: None))
    tensors = {"a": torch.randn(3000), "b": torch.arange(7, dtype=torch.int16)}
    save(tensors, tmp_path / "ours")
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_device_refusing_o_direct_writes_of_one_block_falls_back_to_the_same_bytes(
    tmp_path, monkeypatch
):
    # O_DIRECT opens, but the first write of 4 KiB is refused (a device with larger logical
    # blocks says EINVAL): that file system is written the next way, with the same bytes.
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if not refused:  # the save's first write: the O_DIRECT probe of the first file
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    # outside the package (fault injection): the os refuses a write
    monkeypatch.setattr(os, "pwrite", pwrite)
    eager, deferred = eager_and_deferred(
        transformers.LlamaForCausalLM, llama_config(tie_word_embeddings=False)
    )
    save(deferred, tmp_path / "ours", max_shard_size="100KB")
    monkeypatch.undo()
    assert refused
    eager.save_pretrained(tmp_path / "eager", max_shard_size="100KB")
    assert _files(str(tmp_path / "ours")) == _files(str(tmp_path / "eager"))


def test_direct_writes_assemble_unaligned_pieces_in_any_order(tmp_path):
    direct = __import__("jupyter_metainit.saving.direct", fromlist=["direct"])
    size = 5 * direct.ALIGN + 123
    expected = torch.randint(0, 256, (size,), dtype=torch.uint8)
    cuts = [0, 8, 100, direct.ALIGN + 8, direct.ALIGN + 16, 3 * direct.ALIGN + 40, size]
    pieces = list(itertools.pairwise(cuts))
    one = direct.DirectFile.open(str(tmp_path / "f"), size)
    if one is None:
        pytest.skip("this file system refuses O_DIRECT")
    jobs: list = []
    for a, b in reversed(pieces):  # unaligned sources: written through aligned copies
        one.add(a, memoryview(expected[a:b].clone().numpy()).cast("B"), jobs)
    for target, offset, data in jobs:
        assert offset % direct.ALIGN == 0 and len(data) % direct.ALIGN == 0
        target.write(offset, data)
    one.finish()
    one.close()
    assert (tmp_path / "f").read_bytes() == expected.numpy().tobytes()


def test_direct_memory_starts_at_the_file_offset_modulo_the_block(tmp_path):
    direct = __import__("jupyter_metainit.saving.direct", fromlist=["direct"])
    entries = [FileEntry("a", torch.float32, (10, 10)), FileEntry("b", torch.float32, (10, 10))]
    regions = direct.Regions()
    regions.start_batch([(8, entries[0]), (4096 + 408, entries[1])])
    first, second, extra = regions(400), regions(400), regions(400)
    assert first.data_ptr() % direct.ALIGN == 8
    assert second.data_ptr() % direct.ALIGN == 408
    assert extra.nbytes() == 400
    assert second.data_ptr() >= first.data_ptr() + 400  # places do not overlap
    regions.start_batch([(8, entries[0])])  # the other arena: batch 1 may still be written
    assert not (first.data_ptr() - 8 <= regions(400).data_ptr() < second.data_ptr() + 400)


_ZERO_ELEMENT_MODELS = {
    "first tensor empty": lambda: nn.Linear(0, 4),
    "only tensor empty": lambda: nn.Embedding(0, 3),
    "empty ones in between": lambda: nn.Sequential(
        nn.Linear(3, 4), nn.Linear(0, 4), nn.Embedding(0, 2), nn.Linear(4, 2)
    ),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("build", list(_ZERO_ELEMENT_MODELS), ids=list(_ZERO_ELEMENT_MODELS))
@pytest.mark.parametrize("path", ["direct", "mapped", "pwrite"])
def test_tensors_without_elements_anywhere_save_as_save_file_saves_them(
    tmp_path, monkeypatch, path, build
):
    monkeypatch.setenv(WRITE_VARIABLE, path)  # the way save tries first
    eager, deferred = eager_and_deferred(_ZERO_ELEMENT_MODELS[build])
    save(deferred, tmp_path / "ours")
    save_file(eager.state_dict(), tmp_path / "eager.safetensors", metadata={"format": "pt"})
    ours = (tmp_path / "ours" / "model.safetensors").read_bytes()
    assert ours == (tmp_path / "eager.safetensors").read_bytes()


def test_a_path_starting_with_a_tilde_is_saved_in_the_home_directory(tmp_path, monkeypatch):
    # as the widget's Save… and %save do (and fits(path)): never a directory named "~"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with meta_init():
        model = nn.Linear(4, 3)
    written = save(model, "~/ckpt")
    assert written == str(tmp_path / "home" / "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["home"]
    assert (tmp_path / "home" / "ckpt" / "model.safetensors").exists()
