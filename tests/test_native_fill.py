from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from jupyter_metainit.core.rng.native_fill import (
    ENV_SWITCH,
    MIN_ELEMENTS,
    native_covers,
    native_normal,
    native_status,
    native_uniform,
)

HAS_COMPILER = bool(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))
needs_kernel = pytest.mark.skipif(
    not HAS_COMPILER or not native_status().startswith("on"),
    reason=f"the native normal_ is off here: {native_status()}",
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pair(seed: int, skip: int = 0) -> tuple[torch.Generator, torch.Generator]:
    gens = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for g in gens:  # some draws in: the state is in the middle of its 624-word block
        torch.empty(skip, dtype=torch.int64).random_(0, 2, generator=g)
    return gens


def _skip_unless_covered(op: str, dtype: torch.dtype) -> None:
    """Where this PyTorch makes ``op`` in ``dtype`` another way (2.12's bfloat16 normal_), the
    native kernel leaves it to torch's; what replay gives there is tested elsewhere."""
    if not native_covers(op, dtype):
        pytest.skip(f"torch's kernel makes {op}_ {dtype} here: {native_status()}")


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_the_native_normal_is_on_where_a_compiler_is() -> None:
    assert native_status().startswith("on: "), native_status()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [MIN_ELEMENTS, MIN_ELEMENTS + 1, MIN_ELEMENTS + 15, 16 * 4099 + 9])
def test_the_native_normal_gives_torchs_bits_and_generator_state(
    dtype: torch.dtype, n: int
) -> None:
    _skip_unless_covered("normal", dtype)
    ours, theirs = _pair(n, skip=n % 613)
    expected = torch.empty(n, dtype=dtype).normal_(0.25, 0.02, generator=theirs)
    got = torch.empty(n, dtype=dtype)
    assert native_normal(got, 0.25, 0.02, ours)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(ours.get_state(), theirs.get_state())


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bounds", [(-0.05, 0.05), (0.0, 1.0), (-1e-3, 1e-3)], ids=str)
def test_the_native_uniform_gives_torchs_bits_and_generator_state(
    dtype: torch.dtype, bounds: tuple[float, float]
) -> None:
    _skip_unless_covered("uniform", dtype)
    n = 16 * 4099 + 9
    ours, theirs = _pair(n, skip=7)
    expected = torch.empty(n, dtype=dtype).uniform_(*bounds, generator=theirs)
    got = torch.empty(n, dtype=dtype)
    assert native_uniform(got, *bounds, ours)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(ours.get_state(), theirs.get_state())


@needs_kernel
def test_consecutive_native_fills_continue_the_stream_as_torch_does() -> None:
    _skip_unless_covered("normal", torch.bfloat16)
    ours, theirs = _pair(3)
    for n in (MIN_ELEMENTS + 5, 1000 * 624 + 3, MIN_ELEMENTS):
        expected = torch.empty(n, dtype=torch.bfloat16).normal_(generator=theirs)
        got = torch.empty(n, dtype=torch.bfloat16)
        assert native_normal(got, 0.0, 1.0, ours)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(ours.get_state(), theirs.get_state())


@needs_kernel
def test_a_native_fill_counts_as_an_in_place_write() -> None:
    t = torch.empty(MIN_ELEMENTS)
    before = t._version
    assert native_normal(t, 0.0, 1.0, torch.Generator().manual_seed(0))
    assert t._version == before + 1


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.empty(MIN_ELEMENTS)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(MIN_ELEMENTS - 1),  # small: torch's kernel
        lambda: torch.empty(2 * MIN_ELEMENTS)[::2],  # not contiguous
        lambda: torch.empty(MIN_ELEMENTS, dtype=torch.float64),  # another dtype
        lambda: torch.empty(MIN_ELEMENTS, device="meta"),
        lambda: torch.empty(MIN_ELEMENTS, requires_grad=True),  # torch refuses it in-place
        lambda: _inference_tensor(),  # torch refuses it in-place outside inference mode
    ],
    ids=["small", "strided", "float64", "meta", "requires-grad", "inference"],
)
def test_the_native_normal_leaves_what_it_does_not_copy_to_torch(make) -> None:
    t = make()
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert not native_normal(t, 0.0, 1.0, gen)
    assert torch.equal(gen.get_state(), state)


def test_the_process_default_generator_is_left_to_torchs_locked_kernel() -> None:
    assert not native_normal(torch.empty(MIN_ELEMENTS), 0.0, 1.0, torch.default_generator)


@pytest.mark.parametrize("std", [-1.0, float("nan"), float("inf")])
def test_arguments_torch_would_refuse_or_make_nan_go_to_torch(std: float) -> None:
    assert not native_normal(torch.empty(MIN_ELEMENTS), 0.0, std, torch.Generator())


@pytest.mark.parametrize(
    "bounds", [(0.0, -1.0), (0.0, float("nan")), (float("-inf"), 0.0)], ids=str
)
def test_bounds_torch_would_refuse_or_make_nan_go_to_torch(bounds: tuple[float, float]) -> None:
    assert not native_uniform(torch.empty(MIN_ELEMENTS), *bounds, torch.Generator())


def test_the_switch_turns_the_native_normal_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert native_status() == f"off: {ENV_SWITCH}=0"
    assert not native_normal(torch.empty(MIN_ELEMENTS), 0.0, 1.0, torch.Generator())


_MATERIALIZE_A_BF16_LLAMA_BLOCK = textwrap.dedent(
    """
    import torch
    from jupyter_metainit import materialize, meta_init
    from jupyter_metainit.core.rng.native_fill import native_status

    def build():
        torch.manual_seed(0)
        layer = torch.nn.Linear(256, 688, dtype=torch.bfloat16)  # kaiming_uniform_, uniform_
        torch.nn.init.normal_(layer.weight, std=0.02)
        torch.nn.init.uniform_(layer.bias, -0.5, 0.5)
        return layer
    eager = build()
    with meta_init():
        deferred = build()
    materialize(deferred)
    assert torch.equal(deferred.weight.view(torch.int16), eager.weight.view(torch.int16))
    assert torch.equal(deferred.bias.view(torch.int16), eager.bias.view(torch.int16))
    print(native_status())
    """
)


def _materialize_in_a_fresh_process(env: dict[str, str]) -> str:
    """Run the block above in a new Python with ``env`` added; its exactness asserts must hold
    there. Returns what it printed: the native fills' status in that process."""
    done = subprocess.run(
        [sys.executable, "-c", _MATERIALIZE_A_BF16_LLAMA_BLOCK],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize(
    "env, said",
    [
        ({"CXX": "/nonexistent/c++"}, "off: building them failed"),
        ({"JUPYTER_METAINIT_CACHE": "/proc/no-such-place"}, "off: cannot write its cache"),
        ({ENV_SWITCH: "0"}, f"off: {ENV_SWITCH}=0"),
    ],
    ids=["no-compiler", "cache-unwritable", "switched-off"],
)
def test_without_the_native_normal_replay_is_exact_on_torchs_kernel(
    env: dict[str, str], said: str, tmp_path
) -> None:
    said_there = _materialize_in_a_fresh_process({"JUPYTER_METAINIT_CACHE": str(tmp_path), **env})
    assert said_there.startswith(said), said_there


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_a_fresh_cache_builds_the_kernel_and_replay_is_exact_on_it(tmp_path) -> None:
    said_there = _materialize_in_a_fresh_process({"JUPYTER_METAINIT_CACHE": str(tmp_path)})
    assert said_there.startswith("on: "), said_there
    assert [p.suffix for p in (tmp_path / "native").iterdir()] == [".so"]  # no temporary left
