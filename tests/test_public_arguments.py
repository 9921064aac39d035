"""Every public function refuses an argument of the wrong type, and changes nothing.

A wrong type is an ``ArgumentTypeError`` (a ``TypeError`` and a ``MetaInitError``) whose message
names the argument and what it takes; a wrong value of the right type an ``ArgumentError`` (a
``ValueError``); ``except jupyter_metainit.MetaInitError`` catches both. Note [One argument
policy] in ``core/runtime/arguments.py``. The model each call is given is deferred and stays so;
a refused ``save`` writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import jupyter_metainit as jm
from jupyter_metainit.core.runtime.arguments import parse_dtype, parse_size


def _model() -> nn.Module:
    with jm.meta_init():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _sharded(model: nn.Module, **kwargs: Any) -> Any:
    from jupyter_metainit.distributed import materialize_sharded

    return materialize_sharded(model, **kwargs)


# Each case: (the call with one argument of a wrong type, the argument's name as the message
# gives it, a pattern for what the message says the argument takes).
Call = Callable[[nn.Module, Path], Any]
_NOT_A_MODULE = "(takes|must be) an? (nn.Module|module|tensor)"
_PROGRESS = r"None, (True|a bool).*callable"
_FLAG = r"True or False"
_TENSORS = "a tensor, a module"

WRONG_TYPES: dict[str, tuple[Call, str, str]] = {
    # meta_init
    "meta_init device=[0]": (lambda m, p: jm.meta_init(device=[0]), "device", "device name"),
    "meta_init dtype=5": (lambda m, p: jm.meta_init(dtype=5), "dtype", "torch.dtype"),
    # materialize
    "materialize obj=None": (lambda m, p: jm.materialize(None), "materialize", _TENSORS),
    "materialize obj=5": (lambda m, p: jm.materialize(5), "materialize", _TENSORS),
    "materialize device=1.5": (lambda m, p: jm.materialize(m, 1.5), "device", "device name"),
    "materialize dtype=5": (lambda m, p: jm.materialize(m, dtype=5), "dtype", "torch.dtype"),
    "materialize rng=1": (lambda m, p: jm.materialize(m, rng=1), "rng", "'exact'"),
    "materialize keep_cache='no'": (
        lambda m, p: jm.materialize(m, keep_cache="no"),
        "keep_cache",
        _FLAG,
    ),
    "materialize progress=5": (lambda m, p: jm.materialize(m, progress=5), "progress", _PROGRESS),
    "materialize checkpoint=5": (
        lambda m, p: jm.materialize(m, checkpoint=5),
        "checkpoint",
        "safetensors",
    ),
    "materialize missing=True": (lambda m, p: jm.materialize(m, missing=True), "missing", "'init'"),
    "materialize root=5": (lambda m, p: jm.materialize(m, root=5), "root", "nn.Module"),
    "materialize root='model'": (
        lambda m, p: jm.materialize(m[0], root="model"),
        "root",
        "nn.Module",
    ),
    "materialize placement=5": (
        lambda m, p: jm.materialize(m, placement=5),
        "placement",
        r"place\(",
    ),
    # dematerialize
    "dematerialize obj=5": (lambda m, p: jm.dematerialize(5), "dematerialize", _TENSORS),
    "dematerialize force='no'": (lambda m, p: jm.dematerialize(m, force="no"), "force", _FLAG),
    "dematerialize root=5": (lambda m, p: jm.dematerialize(m, root=5), "root", "nn.Module"),
    # save
    "save obj=5": (lambda m, p: jm.save(5, p), "save", "module"),
    "save path=None": (lambda m, p: jm.save(m, None), "path", "directory"),
    "save path=5": (lambda m, p: jm.save(m, 5), "path", "directory"),
    "save format=5": (lambda m, p: jm.save(m, p, format=5), "format", "'safetensors'"),
    "save max_shard_size=[1]": (
        lambda m, p: jm.save(m, p, max_shard_size=[1]),
        "max_shard_size",
        "'5GB'",
    ),
    "save dtype=5": (lambda m, p: jm.save(m, p, dtype=5), "dtype", "torch.dtype"),
    "save progress=5": (lambda m, p: jm.save(m, p, progress=5), "progress", _PROGRESS),
    # memory_table, summary, fits, dry_run
    "memory_table module=None": (lambda m, p: jm.memory_table(None), "memory_table", _NOT_A_MODULE),
    "memory_table depth='2'": (lambda m, p: jm.memory_table(m, depth="2"), "depth", "int"),
    "memory_table dtype=5": (lambda m, p: jm.memory_table(m, dtype=5), "dtype", "torch.dtype"),
    "memory_table optimizer=[8]": (
        lambda m, p: jm.memory_table(m, optimizer=[8]),
        "optimizer",
        "'adamw'",
    ),
    "summary module=5": (lambda m, p: jm.summary(5), "summary", _NOT_A_MODULE),
    "summary dtype=5": (lambda m, p: jm.summary(m, dtype=5), "dtype", "torch.dtype"),
    "summary optimizer={}": (lambda m, p: jm.summary(m, optimizer={}), "optimizer", "'adamw'"),
    "fits module=5": (lambda m, p: jm.fits(5, "cpu", "1GB"), "fits", _NOT_A_MODULE),
    "fits device=[0]": (lambda m, p: jm.fits(m, [0], "1GB"), "device", "device name"),
    "fits budget=[1]": (lambda m, p: jm.fits(m, "cpu", [1]), "budget", "'80GiB'"),
    "fits dtype=5": (lambda m, p: jm.fits(m, "cpu", "1GB", dtype=5), "dtype", "torch.dtype"),
    "fits depth=1.0": (lambda m, p: jm.fits(m, "cpu", "1GB", depth=1.0), "depth", "int"),
    "dry_run module=5": (lambda m, p: jm.dry_run(5, (1, 4)), "dry_run", _NOT_A_MODULE),
    "dry_run input_dtype=5": (
        lambda m, p: jm.dry_run(m, (1, 4), input_dtype=5),
        "input_dtype",
        "torch.dtype",
    ),
    "dry_run flops='no'": (lambda m, p: jm.dry_run(m, (1, 4), flops="no"), "flops", _FLAG),
    # place
    "place model=None": (
        lambda m, p: jm.place(None, {"cpu": "1GB"}, inputs=[(1, 4)]),
        "place",
        _NOT_A_MODULE,
    ),
    "place devices=5": (lambda m, p: jm.place(m, 5, inputs=[(1, 4)]), "devices", "'cuda:0'"),
    "place devices={'cpu': [1]}": (
        lambda m, p: jm.place(m, {"cpu": [1]}, inputs=[(1, 4)]),
        "cpu",
        "'80GiB'",
    ),
    "place batch='1'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, batch="1", inputs=[(1, 4)]),
        "batch",
        "int",
    ),
    "place seq_len='8'": (lambda m, p: jm.place(m, {"cpu": "1GB"}, seq_len="8"), "seq_len", "int"),
    "place training='no'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, training="no", inputs=[(1, 4)]),
        "training",
        _FLAG,
    ),
    "place optimizer=[8]": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, optimizer=[8], inputs=[(1, 4)]),
        "optimizer",
        "'adamw'",
    ),
    "place precision=5": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, precision=5, inputs=[(1, 4)]),
        "precision",
        "'bf16'",
    ),
    "place pin=3": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, pin=3, inputs=[(1, 4)]),
        "pin",
        "dict",
    ),
    "place pin=['0']": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, pin=["0"], inputs=[(1, 4)]),
        "pin",
        "dict",
    ),
    "place pin='0=cuda:0'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, pin="0=cuda:0", inputs=[(1, 4)]),
        "pin",
        "dict",
    ),
    "place no_split='Linear'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, no_split="Linear", inputs=[(1, 4)]),
        "no_split",
        "list",
    ),
    "place strategy=1": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, strategy=1, inputs=[(1, 4)]),
        "strategy",
        "'pipeline'",
    ),
    "place world_size='2'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, strategy="fsdp", world_size="2", inputs=[(1, 4)]),
        "world_size",
        "int",
    ),
    "place inputs=5": (lambda m, p: jm.place(m, {"cpu": "1GB"}, inputs=5), "inputs", "shape"),
    "place attention=3": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, attention=3, inputs=[(1, 4)]),
        "attention",
        "'auto'",
    ),
    # stats, compare
    "stats obj=5": (lambda m, p: jm.stats(5), "stats", "module"),
    "stats per=1": (lambda m, p: jm.stats(m, per=1), "per", "'tensor'"),
    "stats bins='10'": (lambda m, p: jm.stats(m, bins="10"), "bins", "whole number"),
    "stats depth='1'": (lambda m, p: jm.stats(m, per="module", depth="1"), "depth", "whole number"),
    "stats progress=5": (lambda m, p: jm.stats(m, progress=5), "progress", _PROGRESS),
    "compare a=5": (lambda m, p: jm.compare(5, m), "compare", "module"),
    "compare b=None": (lambda m, p: jm.compare(m, None), "compare", "module"),
    "compare progress=5": (lambda m, p: jm.compare(m, m, progress=5), "progress", _PROGRESS),
    # skip_init, the widget, the extension hooks, materialize_sharded
    "skip_init module_cls=5": (lambda m, p: jm.skip_init(5), "skip_init", "nn.Module subclass"),
    "explore module=5": (lambda m, p: jm.explore(5), "explore", "nn.Module"),
    "explore depth='2'": (lambda m, p: jm.explore(m, depth="2"), "depth", "int"),
    "explore name=5": (lambda m, p: jm.explore(m, name=5), "name", "str"),
    "ModuleTreeWidget module=5": (
        lambda m, p: jm.ModuleTreeWidget(5),
        "ModuleTreeWidget",
        "nn.Module",
    ),
    "widgets_of module=5": (lambda m, p: jm.widgets_of(5), "widgets_of", "nn.Module"),
    "load_ipython_extension ipython=5": (
        lambda m, p: jm.load_ipython_extension(5),
        "ipython",
        "InteractiveShell",
    ),
    "unload_ipython_extension ipython=5": (
        lambda m, p: jm.unload_ipython_extension(5),
        "ipython",
        "InteractiveShell",
    ),
    "materialize_sharded module=5": (lambda m, p: _sharded(5), "materialize_sharded", "nn.Module"),
    "materialize_sharded rng=1": (lambda m, p: _sharded(m, rng=1), "rng", "'exact'"),
    "materialize_sharded progress=5": (lambda m, p: _sharded(m, progress=5), "progress", _PROGRESS),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_a_wrong_type_is_refused_naming_the_argument_and_what_it_takes(case, tmp_path):
    call, argument, takes = WRONG_TYPES[case]
    model = _model()
    with pytest.raises(jm.ArgumentTypeError) as caught:
        call(model, tmp_path / "out")
    message = str(caught.value)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, jm.MetaInitError)
    assert argument in message, message
    assert re.search(takes, message), message
    assert jm.is_deferred(model)
    assert not (tmp_path / "out").exists()


def test_every_public_function_has_a_wrong_type_case():
    callables = {n for n in jm.__all__ if callable(getattr(jm, n))}
    errors = {n for n in callables if isinstance(getattr(jm, n), type)
              and issubclass(getattr(jm, n), BaseException)}  # fmt: skip
    takes_nothing = {"clear_meta_init_cache", "is_meta_init", "is_deferred"}  # is_deferred: any
    tested = {case.split()[0] for case in WRONG_TYPES}
    assert callables - errors - takes_nothing <= tested


# Right types, values the function cannot use: ArgumentError (a ValueError), in the family.
WRONG_VALUES: dict[str, tuple[Call, str]] = {
    "a size past a float's range, fits": (lambda m, p: jm.fits(m, "cpu", "1e400GB"), "budget"),
    "a size past a float's range, save": (
        lambda m, p: jm.save(m, p, max_shard_size="1e400GB"),
        "max_shard_size",
    ),
    "a size past a float's range, place": (
        lambda m, p: jm.place(m, {"cpu": "1e400GB"}, inputs=[(1, 4)]),
        "cpu",
    ),
    "a lowercase b in place's capacities": (
        lambda m, p: jm.place(m, {"cpu": "5gb"}, inputs=[(1, 4)]),
        "bits",
    ),
    "materialize rng='bogus'": (lambda m, p: jm.materialize(m, rng="bogus"), "rng"),
    "materialize missing='skip'": (lambda m, p: jm.materialize(m, missing="skip"), "missing"),
    "materialize device='meta'": (lambda m, p: jm.materialize(m, device="meta"), "meta"),
    "materialize device= with placement=": (
        lambda m, p: jm.materialize(m, "cpu", placement=object()),
        "placement",
    ),
    "materialize dtype=int8": (lambda m, p: jm.materialize(m, dtype="int8"), "dtype"),
    "save format='zip'": (lambda m, p: jm.save(m, p, format="zip"), "format"),
    "save dtype=int8": (lambda m, p: jm.save(m, p, dtype="int8"), "dtype"),
    "save path=''": (lambda m, p: jm.save(m, ""), "path"),
    "memory_table dtype='bogus'": (lambda m, p: jm.memory_table(m, dtype="bogus"), "dtype"),
    "memory_table depth=-1": (lambda m, p: jm.memory_table(m, depth=-1), "depth"),
    "memory_table optimizer='lion9'": (
        lambda m, p: jm.memory_table(m, optimizer="lion9"),
        "optimizer",
    ),
    "summary dtype='bogus'": (lambda m, p: jm.summary(m, dtype="bogus"), "dtype"),
    "fits device='meta'": (lambda m, p: jm.fits(m, "meta"), "meta"),
    "fits a word that is no directory and no hub name": (
        lambda m, p: jm.fits("no such model here"),
        "no such model here",
    ),
    "place precision='bool'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, precision="bool", inputs=[(1, 4)]),
        "precision",
    ),
    "place precision='int64'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, precision="int64", inputs=[(1, 4)]),
        "precision",
    ),
    "place precision='complex64'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, precision="complex64", inputs=[(1, 4)]),
        "precision",
    ),
    "place batch=0": (lambda m, p: jm.place(m, {"cpu": "1GB"}, batch=0, inputs=[(1, 4)]), "batch"),
    "place attention='flash'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, attention="flash", inputs=[(1, 4)]),
        "attention",
    ),
    "place strategy='ring'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, strategy="ring", inputs=[(1, 4)]),
        "strategy",
    ),
    "place optimizer='lion9'": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, optimizer="lion9", inputs=[(1, 4)]),
        "optimizer",
    ),
    "place pin to an unknown part": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, pin={"nope": "cpu"}, inputs=[(1, 4)]),
        "nope",
    ),
    "place without a workload": (lambda m, p: jm.place(m, {"cpu": "1GB"}), "seq_len"),
    "place world_size=0": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, strategy="fsdp", world_size=0, inputs=[(1, 4)]),
        "world_size",
    ),
    "stats per='layer'": (lambda m, p: jm.stats(m, per="layer"), "per"),
    "stats bins=0": (lambda m, p: jm.stats(m, bins=0), "bins"),
    "dry_run a shape with a float": (lambda m, p: jm.dry_run(m, (1, 4.0)), "(1, 4.0)"),
    "dry_run a shape with a bool": (lambda m, p: jm.dry_run(m, (True, 4)), "(True, 4)"),
    "dry_run an empty shape": (lambda m, p: jm.dry_run(m, ()), "()"),
    "dry_run a negative size": (lambda m, p: jm.dry_run(m, (1, -4)), "(1, -4)"),
    "place a shape with a float": (
        lambda m, p: jm.place(m, {"cpu": "1GB"}, inputs=[(1, 4.0)]),
        "(1, 4.0)",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_VALUES))
def test_a_wrong_value_is_an_argument_error_in_the_family(case, tmp_path):
    call, named = WRONG_VALUES[case]
    model = _model()
    with pytest.raises(jm.ArgumentError) as caught:
        call(model, tmp_path / "out")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, jm.MetaInitError)
    assert named in str(caught.value), str(caught.value)
    assert jm.is_deferred(model)
    assert not (tmp_path / "out").exists()


def test_a_truth_tested_flag_never_drops_trained_values():
    with jm.meta_init():
        m = nn.Linear(2, 2)
    jm.materialize(m, keep_cache=True)
    with torch.no_grad():
        m.weight.add_(1.0)  # trained
    trained = m.weight.clone()
    with pytest.raises(jm.ArgumentTypeError, match="force"):
        jm.dematerialize(m, force="no")
    assert not jm.is_deferred(m) and torch.equal(m.weight, trained)


@pytest.mark.parametrize("name", ["fp8", "float8", "nf4", "int4"])
def test_estimate_only_sizes_are_what_ifs_of_the_estimates_and_refused_elsewhere_saying_so(name):
    model = _model()
    jm.memory_table(model, dtype=name)  # a what-if size: how big the weights would be
    for call in (
        lambda: jm.materialize(model, dtype=name),
        lambda: jm.meta_init(dtype=name),
        lambda: jm.place(model, {"cpu": "1GB"}, precision=name, inputs=[(1, 4)]),
    ):
        with pytest.raises(jm.ArgumentError, match="estimate"):
            call()
    assert jm.is_deferred(model)


def test_a_non_floating_dtype_is_the_same_error_in_meta_init_and_materialize():
    model = _model()
    with pytest.raises(jm.ArgumentError) as in_meta_init:
        jm.meta_init(dtype=torch.int64)
    with pytest.raises(jm.ArgumentError) as in_materialize:
        jm.materialize(model, dtype=torch.int64)
    for caught in (in_meta_init, in_materialize):
        assert str(caught.value).startswith("dtype=torch.int64 is not a floating-point dtype")


def test_a_dtype_name_is_read_whatever_its_case_and_spaces():
    assert parse_dtype(" Torch.BFloat16 ") is torch.bfloat16


def test_the_lowercase_b_refusal_suggests_the_unit_as_written_in_the_docs():
    with pytest.raises(jm.ArgumentError) as caught:
        parse_size("5 gib", "budget")
    assert "'5GiB'" in str(caught.value)
    with pytest.raises(jm.ArgumentError) as caught:
        parse_size("5gb", "budget")
    assert "'5GB'" in str(caught.value)


def test_a_size_past_a_floats_range_is_an_argument_error():
    with pytest.raises(jm.ArgumentError, match="1e400"):
        parse_size("1e400GB", "budget")
    with pytest.raises(jm.ArgumentError, match="inf"):
        parse_size(float("inf"), "budget")
