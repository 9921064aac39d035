"""The version claims: pyproject.toml's bounds, the recorded runs of both ends, the compatibility
page, and the import-time checks of operators that differ between the admitted torch releases."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "scripts" / "compatibility_table.py").is_file():
    pytest.skip("the scripts are not in this checkout", allow_module_level=True)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


table = _load("compatibility_table")
RUNS = json.loads(table.RUNS.read_text())
PROJECT = table.read_pyproject()


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _run(end: str) -> dict:
    return next(r for r in RUNS if r["end"] == end)


def test_the_compatibility_page_is_the_one_the_recorded_runs_make():
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert page == table.page(RUNS), "run python scripts/compatibility_table.py"


def test_the_newest_torch_tested_is_admitted_and_the_cap_is_one_minor_ahead():
    spec = table.requirement(PROJECT, "torch")
    newest = _minor(_run("newest")["versions"]["torch"])
    cap = _minor(table.bound(spec, "<"))
    assert newest < cap and cap == (newest[0], newest[1] + 1)


def _release(version: str) -> tuple[int, ...]:
    """``2.11`` and ``2.11.0+cu128`` alike as (2, 11, 0)."""
    numbers = [int(x) for x in re.match(r"[\d.]+", version).group(0).strip(".").split(".")]
    return tuple(numbers + [0] * (3 - len(numbers)))


def test_the_declared_lower_bounds_are_the_lowest_end_tested():
    lowest = _run("lowest")["versions"]
    for name in ("torch", "transformers", "accelerate"):
        declared = table.bound(table.requirement(PROJECT, name), ">=")
        assert _release(lowest[name]) == _release(declared), name


def test_the_python_classifiers_are_the_pythons_of_the_recorded_runs():
    tested = sorted({_minor(r["versions"]["python"]) for r in RUNS})
    assert [_minor(p) for p in PROJECT["pythons"]] == tested
    assert PROJECT["requires_python"] == f">={PROJECT['pythons'][0]}"


def test_every_recorded_end_passed_its_tests_and_was_exact():
    for run in RUNS:
        if run.get("tests"):
            assert run["tests"]["failed"] == run["tests"]["errors"] == 0, run["end"]
            assert run["smoke"] == "exact", run["end"]


def test_setup_sh_installs_a_torch_the_project_admits():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    pinned = re.search(r'TORCH_SPEC="\$\{TORCH_SPEC:-torch==([\d.]+)\}"', setup).group(1)
    spec = table.requirement(PROJECT, "torch")
    assert _minor(table.bound(spec, ">=")) <= _minor(pinned) < _minor(table.bound(spec, "<"))


def test_the_like_ops_take_a_generator_only_where_torch_has_the_overload():
    # rand_like.generator / randn_like.generator exist from torch 2.10; before, importing the
    # package must still work, with no *_like op given a draw-count formula.
    from jupyter_metainit.core.rng import draws

    aten = torch.ops.aten
    expected = {
        packet.generator
        for packet in (aten.rand_like, aten.randn_like)
        if "generator" in packet.overloads()
    }
    assert expected == draws._LIKE_OPS
    assert draws._overloads(aten.rand_like, "no_such_overload") == set()


def test_grouped_mm_is_cast_for_its_meta_kernel_only_where_torch_has_it():
    # aten._grouped_mm is missing in torch 2.6; the dtype table must then simply lack it.
    from jupyter_metainit.estimates.forward import dtype_checks

    has = hasattr(torch.ops.aten, "_grouped_mm")
    listed = {op.name() for op in dtype_checks._CUDA_ONLY_META_DTYPE}
    assert listed == ({"aten::_grouped_mm"} if has else set())
