"""``model.save_pretrained(dir)`` on a deferred or partly deferred transformers model: the files
eager ``save_pretrained`` writes (names, bytes, config files), or a refusal before anything is
written; a real model takes transformers' own path."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _twins import eager_and_deferred
from safetensors.torch import load_file

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import MetaInitError
from jupyter_metainit.saving.hook import install_save_pretrained

transformers = pytest.importorskip("transformers")

_NEOX = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    vocab_size=1000, max_position_embeddings=128,
)  # fmt: skip
_ROOT = str(Path(__file__).resolve().parents[1])


def _config(**overrides):
    return transformers.GPTNeoXConfig(**{**_NEOX, **overrides})


def _neox_twins(**overrides):
    """``(eager, deferred)`` twins of the small GPT-NeoX of ``_config(**overrides)``."""
    build = transformers.AutoModelForCausalLM.from_config
    return eager_and_deferred(build, _config(**overrides), seed=3)


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(directory).iterdir()}


def _both_saved(tmp_path, deferred, eager, **kwargs):
    deferred.save_pretrained(tmp_path / "deferred", **kwargs)
    eager.save_pretrained(tmp_path / "eager", **kwargs)
    return _files(tmp_path / "deferred"), _files(tmp_path / "eager")


def test_a_deferred_model_writes_the_files_and_bytes_eager_writes(tmp_path):
    eager, deferred = _neox_twins()
    ours, theirs = _both_saved(tmp_path, deferred, eager)
    assert sorted(ours) == ["config.json", "generation_config.json", "model.safetensors"]
    assert ours == theirs


def test_the_saved_tensors_are_torch_equal_to_eager_ones(tmp_path):
    eager, deferred = _neox_twins()
    _both_saved(tmp_path, deferred, eager)
    ours = load_file(tmp_path / "deferred" / "model.safetensors")
    theirs = load_file(tmp_path / "eager" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_config_json_is_the_one_eager_writes(tmp_path):
    eager, deferred = _neox_twins()
    _both_saved(tmp_path, deferred, eager)
    read = lambda d: json.loads((tmp_path / d / "config.json").read_text())  # noqa: E731
    assert read("deferred") == read("eager")


def test_saving_leaves_the_model_deferred(tmp_path):
    _, deferred = _neox_twins()
    deferred.save_pretrained(tmp_path / "deferred")
    assert all(is_deferred(t) for t in deferred.parameters())


def test_a_sharded_save_has_the_same_shards_and_index(tmp_path):
    eager, deferred = _neox_twins()
    ours, theirs = _both_saved(tmp_path, deferred, eager, max_shard_size="200KB")
    assert "model.safetensors.index.json" in ours and "model-00002-of-00004.safetensors" in ours
    assert ours == theirs


def test_a_variant_names_the_files_as_eager_does(tmp_path):
    eager, deferred = _neox_twins()
    ours, theirs = _both_saved(tmp_path, deferred, eager, variant="seed", max_shard_size="200KB")
    assert "model.safetensors.index.seed.json" in ours
    assert "model.seed-00001-of-00004.safetensors" in ours
    assert ours == theirs


def test_tied_embeddings_are_written_once_as_eager_does(tmp_path):
    eager, deferred = _neox_twins(tie_word_embeddings=True)
    ours, theirs = _both_saved(tmp_path, deferred, eager)
    assert ours == theirs


_MOE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=300, eos_token_id=2, num_experts=4, num_experts_per_tok=2,
)  # fmt: skip
_MOE_OPTIONS = {
    "original_layout": {},
    "sharded": {"max_shard_size": "50KB"},
    "fused_layout": {"save_original_format": False},
}


@pytest.mark.parametrize("case", sorted(_MOE_OPTIONS))
def test_fused_experts_are_written_in_the_layout_eager_writes(tmp_path, case):
    config = transformers.OlmoeConfig(**_MOE)
    eager, deferred = eager_and_deferred(
        transformers.AutoModelForCausalLM.from_config, config, seed=1
    )
    ours, theirs = _both_saved(tmp_path, deferred, eager, **_MOE_OPTIONS[case])
    assert ours == theirs


class _CustomNeoX(transformers.GPTNeoXForCausalLM):
    """A custom model: save_pretrained copies this file and writes ``auto_map``."""


_CustomNeoX.register_for_auto_class("AutoModelForCausalLM")


def test_a_custom_model_gets_its_code_and_auto_map_as_eager_does(tmp_path):
    eager, deferred = eager_and_deferred(lambda: _CustomNeoX(_config()), seed=3)
    ours, theirs = _both_saved(tmp_path, deferred, eager)
    assert "auto_map" in json.loads(ours["config.json"]) and len(ours) == 4
    assert ours == theirs


def test_a_partly_materialized_model_writes_what_eager_writes(tmp_path):
    eager, deferred = _neox_twins()
    materialize(deferred.gpt_neox.layers[0])
    assert is_deferred(deferred) and not is_deferred(deferred.gpt_neox.layers[0])
    ours, theirs = _both_saved(tmp_path, deferred, eager)
    assert ours == theirs


def test_a_state_dict_argument_is_written_as_eager_writes_it(tmp_path):
    eager, deferred = _neox_twins()
    deferred.save_pretrained(tmp_path / "deferred", state_dict=deferred.state_dict())
    eager.save_pretrained(tmp_path / "eager", state_dict=eager.state_dict())
    assert _files(tmp_path / "deferred") == _files(tmp_path / "eager")


def test_a_model_opened_from_pretrained_under_meta_init_resaves_the_same_files(tmp_path):
    eager, _ = _neox_twins()
    eager.save_pretrained(tmp_path / "original", max_shard_size="200KB")
    with meta_init():
        opened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "original")
    assert is_deferred(opened)
    opened.save_pretrained(tmp_path / "again", max_shard_size="200KB")
    assert _files(tmp_path / "again") == _files(tmp_path / "original")


def test_resaving_into_a_directory_removes_the_old_shards_as_eager_does(tmp_path):
    eager, deferred = _neox_twins()
    for model, name in ((deferred, "deferred"), (eager, "eager")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text("{}")
        model.save_pretrained(tmp_path / name, max_shard_size="100KB")
        model.save_pretrained(tmp_path / name, max_shard_size="200KB")
    assert _files(tmp_path / "deferred") == _files(tmp_path / "eager")


_UNSUPPORTED = {
    "push_to_hub": True,
    "distributed_checkpoint": True,
    "safe_serialization": False,
    "save_function": torch.save,
}


@pytest.mark.parametrize("option", sorted(_UNSUPPORTED))
def test_an_unsupported_option_is_refused_before_the_directory_is_made(tmp_path, option):
    _, deferred = _neox_twins()
    with pytest.raises(
        MetaInitError, match=rf"{option}.*nothing was written.*jupyter_metainit\.save"
    ):
        deferred.save_pretrained(tmp_path / "out", **{option: _UNSUPPORTED[option]})
    assert not (tmp_path / "out").exists()


# What transformers sets on a model once peft's ``load_adapter`` ran on it, or once a quantizer
# prepared it (neither peft nor a CPU quantization backend is installed here).
@pytest.mark.parametrize(
    ("feature", "value", "named"),
    [("_hf_peft_config_loaded", True, "PEFT adapters"), ("hf_quantizer", object(), "quantized")],
)
def test_adapters_and_quantization_are_refused_before_anything_is_written(
    tmp_path, feature, value, named
):
    _, deferred = _neox_twins()
    setattr(deferred, feature, value)
    with pytest.raises(MetaInitError, match=rf"{named}.*nothing was written"):
        deferred.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_refusal_leaves_an_existing_directory_unchanged(tmp_path):
    eager, deferred = _neox_twins()
    eager.save_pretrained(tmp_path / "out")
    before = _files(tmp_path / "out")
    with pytest.raises(MetaInitError, match="push_to_hub"):
        deferred.save_pretrained(tmp_path / "out", push_to_hub=True)
    assert _files(tmp_path / "out") == before


def test_a_value_that_cannot_be_read_leaves_no_directory(tmp_path):
    eager, _ = _neox_twins()
    eager.save_pretrained(tmp_path / "original")
    with meta_init():
        opened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "original")
    (tmp_path / "original" / "model.safetensors").unlink()  # its values are gone
    with pytest.raises(Exception, match=r"model\.safetensors"):
        opened.save_pretrained(tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["original"]


def test_an_interrupted_save_leaves_no_directory(tmp_path, monkeypatch):
    from jupyter_metainit.saving import writer

    _, deferred = _neox_twins()
    calls = []

    def interrupted(*args, **kwargs):  # Ctrl-C while the values are computed (headers written)
        calls.append(1)
        raise KeyboardInterrupt

    # internal fault injection: no public hook runs inside a batch
    monkeypatch.setattr(writer, "cpu_values_of_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        deferred.save_pretrained(tmp_path / "out", max_shard_size="200KB")
    assert calls
    assert os.listdir(tmp_path) == []


def test_a_file_path_writes_nothing_as_eager_does(tmp_path):
    _, deferred = _neox_twins()
    (tmp_path / "file").write_text("kept")
    assert deferred.save_pretrained(tmp_path / "file") is None
    assert (tmp_path / "file").read_text() == "kept" and len(os.listdir(tmp_path)) == 1


def test_another_rank_makes_the_directory_and_writes_no_file(tmp_path):
    eager, deferred = _neox_twins()
    deferred.save_pretrained(tmp_path / "deferred", is_main_process=False)
    eager.save_pretrained(tmp_path / "eager", is_main_process=False)
    assert _files(tmp_path / "deferred") == _files(tmp_path / "eager") == {}


def test_a_real_model_takes_transformers_own_path(tmp_path):
    eager, _ = _neox_twins()
    eager.save_pretrained(tmp_path / "out", safe_serialization=False)  # ignored by transformers 5
    assert "model.safetensors" in _files(tmp_path / "out")


def test_the_wrapper_keeps_the_signature_and_docstring_and_installs_once():
    _neox_twins()  # a meta_init block with transformers imported installs it
    wrapper = transformers.PreTrainedModel.save_pretrained
    install_save_pretrained()
    assert transformers.PreTrainedModel.save_pretrained is wrapper
    original = wrapper.__wrapped__
    assert not hasattr(original, "__wrapped__")
    assert inspect.signature(wrapper) == inspect.signature(original)
    assert wrapper.__doc__ == original.__doc__ and wrapper.__name__ == "save_pretrained"


def test_saving_adds_nothing_to_the_model_instance(tmp_path):
    _, deferred = _neox_twins()
    before = set(vars(deferred))
    deferred.save_pretrained(tmp_path / "out")
    assert set(vars(deferred)) == before


def test_installing_the_hook_leaves_jupyter_metainit_save_the_function():
    import jupyter_metainit

    assert inspect.isfunction(jupyter_metainit.save)
    assert "max_shard_size" in inspect.signature(jupyter_metainit.save).parameters


_UNTOUCHED = """
import sys, transformers
before_method = transformers.PreTrainedModel.save_pretrained
before_finders = list(sys.meta_path)
import jupyter_metainit, jupyter_metainit.saving
assert transformers.PreTrainedModel.save_pretrained is before_method, "save_pretrained patched"
assert sys.meta_path == before_finders, "an import hook was added"
with jupyter_metainit.meta_init():
    pass
assert transformers.PreTrainedModel.save_pretrained is not before_method
"""


def test_importing_the_package_changes_nothing_in_transformers_until_a_meta_init_block():
    env = {**os.environ, "PYTHONPATH": _ROOT}
    subprocess.run([sys.executable, "-c", _UNTOUCHED], check=True, env=env, cwd=_ROOT)


def test_importing_the_package_adds_no_import_hook():
    env = {**os.environ, "PYTHONPATH": _ROOT}
    code = "import sys\nn = len(sys.meta_path)\nimport jupyter_metainit\n"
    code += "assert len(sys.meta_path) == n"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=_ROOT)


_IMPORTS = {
    "after": "import jupyter_metainit\n"
    "assert 'transformers' not in sys.modules\n"
    "import transformers",
    "before": "import transformers\nimport jupyter_metainit",
}
_SCRIPT = """
import sys, torch
{imports}
config = transformers.GPTNeoXConfig(**{config})
torch.manual_seed(0)
with jupyter_metainit.meta_init():
    deferred = transformers.AutoModelForCausalLM.from_config(config)
torch.manual_seed(0)
eager = transformers.AutoModelForCausalLM.from_config(config)
deferred.save_pretrained(sys.argv[1] + "/deferred")
eager.save_pretrained(sys.argv[1] + "/eager")
"""


@pytest.mark.parametrize("order", sorted(_IMPORTS))
def test_transformers_imported_before_or_after_jupyter_metainit_gets_the_wrapper(tmp_path, order):
    env = {**os.environ, "PYTHONPATH": _ROOT}
    code = _SCRIPT.format(imports=_IMPORTS[order], config=repr(_NEOX))
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, cwd=_ROOT)
    assert _files(tmp_path / "deferred") == _files(tmp_path / "eager")
