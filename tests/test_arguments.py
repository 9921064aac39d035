"""One argument policy (Note [One argument policy] in core/runtime/arguments.py): the same
spelling means the same thing in every public function, and its errors are one family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jupyter_metainit as jm
from jupyter_metainit.core.runtime.arguments import (
    indexed_device,
    parse_device,
    parse_dtype,
    parse_path,
    parse_size,
)

DTYPE_SPELLINGS = [torch.bfloat16, "bfloat16", "bf16", "torch.bfloat16", " BF16 "]


@pytest.mark.parametrize("spelling", DTYPE_SPELLINGS, ids=repr)
def test_every_dtype_spelling_is_one_dtype(spelling):
    assert parse_dtype(spelling) is torch.bfloat16


@pytest.mark.parametrize("spelling", DTYPE_SPELLINGS, ids=repr)
def test_meta_init_takes_every_dtype_spelling(spelling):
    with jm.meta_init(dtype=spelling):
        m = nn.Linear(2, 2)
    assert m.weight.dtype is torch.bfloat16


@pytest.mark.parametrize("spelling", DTYPE_SPELLINGS, ids=repr)
def test_materialize_takes_every_dtype_spelling(spelling):
    with jm.meta_init():
        m = nn.Linear(2, 2)
    jm.materialize(m, dtype=spelling)
    assert m.weight.dtype is torch.bfloat16 and not jm.is_deferred(m)


@pytest.mark.parametrize("spelling", DTYPE_SPELLINGS, ids=repr)
def test_memory_table_takes_every_dtype_spelling(spelling):
    with jm.meta_init():
        m = nn.Linear(4, 4)
    table = jm.memory_table(m, dtype=spelling)
    assert table.loc["", "param_bytes"] == (16 + 4) * 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("5GB", 5 * 10**9),
        ("1.5 TiB", int(1.5 * 2**40)),
        ("500MB", 500 * 10**6),
        ("500M", 500 * 10**6),
        ("64KiB", 64 * 1024),
        (1234, 1234),
        (2.0e9, 2 * 10**9),
    ],
)
def test_sizes_read_one_grammar(text, expected):
    assert parse_size(text) == expected


def test_a_lowercase_b_is_refused_because_transformers_reads_it_as_bits():
    with pytest.raises(ValueError, match="bits"):
        parse_size("5Gb", "max_shard_size")


def test_budgets_and_shard_sizes_read_the_same_grammar():
    from jupyter_metainit.estimates.fit import parse_bytes
    from jupyter_metainit.saving.layout import parse_size as shard_size

    for text in ("24GiB", "80 GB", "1.5TB", 12345):
        assert parse_bytes(text) == shard_size(text) == parse_size(text)


def test_a_bare_cuda_is_the_current_gpu_everywhere():
    # Without CUDA initialised the current GPU is cuda:0, as torch.empty(device="cuda") reports.
    from jupyter_metainit.estimates._arguments import check_device
    from jupyter_metainit.plan.place_arguments import parse_devices

    assert indexed_device("cuda") == check_device("cuda") == torch.device("cuda", 0)
    assert list(parse_devices({"cuda": "1GiB"})) == ["cuda:0"]
    with jm.meta_init():
        t = torch.empty(2, device="cuda")
    assert t.device == torch.device("cuda", 0)


def test_an_int_is_a_gpu_index_everywhere():
    assert parse_device(1) == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: parse_dtype("bf17"), ValueError),
        (lambda: parse_dtype(3), TypeError),
        (lambda: parse_size("lots"), ValueError),
        (lambda: parse_size(None), TypeError),
        (lambda: parse_device("gpu"), ValueError),
        (lambda: parse_device(1.5), TypeError),
    ],
    ids=["dtype-name", "dtype-type", "size-text", "size-type", "device-name", "device-type"],
)
def test_argument_errors_are_catchable_as_the_package_family_and_as_builtins(call, error):
    with pytest.raises(jm.MetaInitError) as caught:
        call()
    assert isinstance(caught.value, error)


def test_the_error_classes_are_public_at_the_package_root():
    for name in (
        "MetaInitError",
        "ArgumentError",
        "ArgumentTypeError",
        "MaterializationError",
        "NotEnoughMemoryError",
        "DeferredDataError",
        "UnsupportedOperatorError",
        "BusyError",
    ):
        assert issubclass(getattr(jm, name), jm.MetaInitError)
        assert name in jm.__all__


def test_the_same_name_has_the_same_default_everywhere():
    import inspect

    from jupyter_metainit.distributed import materialize_sharded

    def default(func, name):
        return inspect.signature(func).parameters[name].default

    assert default(jm.memory_table, "optimizer") == default(jm.summary, "optimizer")
    assert default(jm.memory_table, "optimizer") == default(jm.place, "optimizer") == "adamw"
    assert default(jm.materialize, "rng") is default(materialize_sharded, "rng") is None


def test_a_tilde_is_the_home_directory_in_every_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_path("~/ckpt") == str(tmp_path / "ckpt")
    assert parse_path("~/ckpt", typed=True) == str(tmp_path / "ckpt")


def test_typed_text_expands_environment_variables_as_a_shell(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTS", str(tmp_path))
    assert parse_path(" $CKPTS/a ", typed=True) == str(tmp_path / "a")
    assert parse_path("${CKPTS}/a", typed=True) == str(tmp_path / "a")


def test_a_python_path_naming_an_environment_variable_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("CKPTS", "/somewhere")
    with pytest.raises(jm.ArgumentError, match=r"does not expand \$CKPTS.*os.path.expandvars"):
        parse_path("$CKPTS/a", "path")


def test_a_python_path_with_a_literal_dollar_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTS", "/somewhere")
    (tmp_path / "$CKPTS").mkdir()
    assert parse_path(tmp_path / "$CKPTS") == str(tmp_path / "$CKPTS")  # it exists: as written
    assert parse_path("$NOT_AN_ENV_VARIABLE_HERE/a") == "$NOT_AN_ENV_VARIABLE_HERE/a"


def test_save_refuses_a_dollar_path_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(jm.ArgumentError, match=r"\$CKPTS"):
        jm.save(nn.Linear(2, 2), "$CKPTS/x")
    assert list(tmp_path.iterdir()) == []


def test_stats_and_compare_read_a_tilde_path_as_save_writes_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    model = nn.Linear(2, 2)
    jm.save(model, "~/x")
    assert (tmp_path / "x").is_dir()
    assert sorted(jm.stats("~/x").index) == ["bias", "weight"]
    assert (jm.compare(model, "~/x")["status"] == "equal").all()
