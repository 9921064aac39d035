"""``normal_`` and ``uniform_`` on the CPU three to four times faster than torch's kernels, with
the same bits.

When and why: every deferred tensor initialised at random (``normal_`` in every ``transformers``
model, ``uniform_`` in ``nn.Linear``'s and ``nn.Conv``'s own init) is made by replaying that
fill; on the CPU torch's kernels spend most of their time per draw (a call into the generator
per 32-bit number, a cast per element), about 6 ns an element for a bfloat16 ``normal_``.
:func:`native_normal` and :func:`native_uniform` run the same algorithms as tight loops
(``native/fills.cpp``): the same MT19937 draws, the same uniforms, torch's own Box-Muller code
of each block of 16 (its ``avx_mathfun.h`` on AVX2 machines, where torch uses it), the same
roundings, so the same values and the same generator state after, about 1.4 ns an element.
Replay calls them for every CPU fill it makes (``replay.random_modes.call_with_generator``):
``materialize``, ``save`` and ``stats`` of deferred models all gain.

Note [the native fills are trusted only after they are checked]:
The kernel is compiled on first use with the machine's C++ compiler (``$CXX``, else ``c++`` or
``g++``) into a cache directory (``$JUPYTER_METAINIT_CACHE``, else ``$XDG_CACHE_HOME`` or
``~/.cache``, then ``jupyter_metainit/native``), once per machine, torch version and source.
Before a fill runs in a process, it is compared with torch's own kernel for that op and
dtype, bit for bit, values and generator state, over sizes with and without a partial last
block and generators in the middle of their 624-word block. Anything else (no compiler, a
failed build, another PyTorch whose kernel differs, a CPU capability it does not copy) leaves
torch's kernel in use: the values never depend on whether this runs. ``JUPYTER_METAINIT_NATIVE=0``
turns them off; :func:`native_status` says whether they are on and why not.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from jupyter_metainit.core.rng.segments import raw_get_state, raw_set_state
from jupyter_metainit.core.runtime.plain import plain

__all__ = [
    "MIN_ELEMENTS",
    "NATIVE_OPS",
    "native_call",
    "native_covers",
    "native_normal",
    "native_status",
    "native_uniform",
]

ENV_SWITCH = "JUPYTER_METAINIT_NATIVE"
ENV_CACHE = "JUPYTER_METAINIT_CACHE"

# Below this many elements the generator state's round trip (about 10 us) outweighs the gain.
MIN_ELEMENTS = 1 << 12

_SOURCE = Path(__file__).with_name("native") / "fills.cpp"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

aten = torch.ops.aten

# The ATen ops the native kernels make -> their kernel's name.
NATIVE_OPS = {aten.normal_.default: "normal", aten.uniform_.default: "uniform"}
# Each op's two scalar arguments: (name, default) as its schema has them.
_SCALARS = {"normal": (("mean", 0.0), ("std", 1.0)), "uniform": (("from", 0.0), ("to", 1.0))}

_lock = threading.Lock()
_kernels: dict[str, Callable[..., int]] | None = None  # "normal", "uniform" -> the C function
_where = ""  # the library's path
_reason: str | None = None  # why there are no kernels (None: not tried yet, or there are)
_checked: dict[tuple[str, torch.dtype], bool] = {}


def native_call(func: Any, args: tuple, kwargs: dict, generator: Any) -> bool:
    """``func(*args, **kwargs)`` drawing from ``generator``, by the native kernel where it applies:
    ``func`` one of :data:`NATIVE_OPS` and its tensor and arguments as the kernel takes them.

    Returns:
        True if done (``args[0]`` filled); False otherwise: call ``func`` itself.
    """
    op = NATIVE_OPS.get(func)
    if op is None or not args:
        return False
    (a_name, a_default), (b_name, b_default) = _SCALARS[op]
    a = args[1] if len(args) > 1 else kwargs.get(a_name, a_default)
    b = args[2] if len(args) > 2 else kwargs.get(b_name, b_default)
    fill = native_normal if op == "normal" else native_uniform
    return fill(args[0], a, b, generator)


def native_normal(t: Any, mean: float, std: float, generator: Any) -> bool:
    """``t.normal_(mean, std, generator=generator)`` by the native kernel, when it applies.

    Args:
        t: the tensor to fill in place: a contiguous CPU float32, bfloat16 or float16 tensor
            of at least :data:`MIN_ELEMENTS` elements (no subclass).
        mean, std: as ``normal_`` takes them (finite, ``std >= 0``).
        generator: a CPU ``torch.Generator``, moved as ``normal_`` would move it.

    Returns:
        True if ``t`` was filled (bit-identical to torch's kernel, the generator advanced the
        same); False where it does not apply or the kernel is off: call torch's ``normal_``.
    """
    ok = _finite(mean, std) and std >= 0
    return ok and _fill("normal", t, mean, std, generator)


def native_uniform(t: Any, low: float, high: float, generator: Any) -> bool:
    """``t.uniform_(low, high, generator=generator)`` by the native kernel, when it applies.

    Args:
        t: as for :func:`native_normal`.
        low, high: as ``uniform_``'s ``from`` and ``to`` take them (finite, ``low <= high``).
        generator: a CPU ``torch.Generator``, moved as ``uniform_`` would move it.

    Returns:
        True if ``t`` was filled (bit-identical to torch's kernel); False otherwise: call
        torch's ``uniform_``.
    """
    ok = _finite(low, high) and low <= high and high - low <= _FLOAT_MAX
    return ok and _fill("uniform", t, low, high, generator)


def native_status() -> str:
    """Whether the native fills are in use in this process, and if not, why.

    Returns:
        ``"on: ..."`` with the kernels' variant and file (and any op and dtype left to torch),
        or ``"off: ..."`` with the reason.

    Example:
        >>> from jupyter_metainit.core.rng.native_fill import native_status
        >>> native_status().split(":")[0] in ("on", "off")
        True
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"off: {ENV_SWITCH}=0"
    kernels = _get_kernels()
    if kernels is None:
        return f"off: {_reason}"
    pairs = [(op, d) for op in kernels for d in _DTYPES]
    differs = [
        f"{op}_ {str(d).removeprefix('torch.')}" for op, d in pairs if not native_covers(op, d)
    ]
    if len(differs) == len(pairs):
        return "off: they differ from this PyTorch's kernels (torch's are used)"
    note = f" (torch's kernel for {', '.join(differs)}: ours differs there)" if differs else ""
    return f"on: the {_variant()[0]} kernels, {_where}{note}"


def native_covers(op: str, dtype: torch.dtype) -> bool:
    """Whether the native kernel makes ``op`` (``"normal"`` or ``"uniform"``) in ``dtype`` in
    this process: it is built, not switched off, and gives this PyTorch's bits (PyTorch 2.12,
    for one, made bfloat16 and float16 ``normal_`` values another way: torch's kernel runs)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or dtype not in _DTYPES:
        return False
    kernels = _get_kernels()
    return kernels is not None and op in kernels and _exact(op, dtype)


def _finite(a: Any, b: Any) -> bool:
    return (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and math.isfinite(a)
        and math.isfinite(b)
    )


_FLOAT_MAX = torch.finfo(torch.float32).max


def _fill(op: str, t: Any, a: float, b: float, generator: Any) -> bool:
    code = _DTYPES.get(getattr(t, "dtype", None))
    if (
        code is None
        or type(t) not in (torch.Tensor, torch.nn.Parameter)
        or not isinstance(generator, torch.Generator)
        or generator is torch.default_generator  # others may draw from it meanwhile: torch locks it
        or t.device.type != "cpu"
        or generator.device.type != "cpu"
        or t.numel() < MIN_ELEMENTS
        or not t.is_contiguous()
        or (t.requires_grad and torch.is_grad_enabled())  # torch refuses in-place on a leaf
        or (t.is_inference() and not torch.is_inference_mode_enabled())  # and this too
        or not native_covers(op, t.dtype)
    ):
        return False
    return _run((_kernels or {})[op], t, code, a, b, generator)


def _run(
    kernel: Callable[..., int],
    t: torch.Tensor,
    code: int,
    a: float,
    b: float,
    generator: torch.Generator,
) -> bool:
    state = raw_get_state(generator)  # a copy, updated in place by the kernel
    if kernel(t.data_ptr(), code, t.numel(), a, b, state.data_ptr()) != 0:
        return False
    raw_set_state(generator, state)
    torch.autograd.graph.increment_version(t)  # an in-place write, as torch's kernel counts it
    return True


def _variant() -> tuple[str, list[str]]:
    """The kernel torch runs here, and the flags that build ours like it: torch's AVX2 code on
    an x86 CPU whose torch capability is AVX2, its scalar code anywhere else."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX2" and platform.machine().lower() in ("x86_64", "amd64"):
        include = Path(torch.__file__).parent / "include"
        return "avx2", ["-DJMI_AVX2", "-mavx2", "-mfma", "-mf16c", f"-I{include}"]
    return "scalar", []


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE)
    if not root:
        root = os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "jupyter_metainit",
        )
    return Path(root) / "native"


def _get_kernels() -> dict[str, Callable[..., int]] | None:
    global _kernels, _reason
    if _kernels is not None or _reason is not None:
        return _kernels
    with _lock:
        if _kernels is None and _reason is None:
            try:
                _kernels = _load()
            except _Unavailable as e:
                _reason = str(e)
    return _kernels


class _Unavailable(Exception):
    pass


def _load() -> dict[str, Callable[..., int]]:
    global _where
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise _Unavailable("no C++ compiler ($CXX, c++ or g++) to build them")
    variant, flags = _variant()
    if variant == "avx2" and not (Path(flags[-1][2:]) / "ATen/native/cpu/avx_mathfun.h").exists():
        raise _Unavailable("this PyTorch has no ATen/native/cpu/avx_mathfun.h to build them from")
    flags = ["-O3", "-std=c++17", "-fPIC", "-shared", *flags]
    source = _SOURCE.read_bytes()
    parts = [source, " ".join(flags).encode(), torch.__version__.encode(), compiler.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    directory = _cache_dir()
    path = directory / f"fills-{variant}-{key}.so"
    if not path.exists():
        _build(compiler, flags, directory, path)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        raise _Unavailable(f"could not load {path}: {e}") from None
    kernels = {}
    for op, symbol in (("normal", "jmi_normal_fill"), ("uniform", "jmi_uniform_fill")):
        kernel = getattr(library, symbol)
        kernel.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double,
                           ctypes.c_double, ctypes.c_void_p]  # fmt: skip
        kernel.restype = ctypes.c_int
        kernels[op] = kernel
    _where = str(path)
    return kernels


def _build(compiler: str, flags: list[str], directory: Path, path: Path) -> None:
    """Compile into a temporary file beside ``path``, then move it there (another process
    building the same file at the same time leaves one whole file)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(suffix=".so.tmp", dir=directory)
        os.close(fd)
    except OSError as e:
        raise _Unavailable(f"cannot write its cache directory {directory}: {e}") from None
    try:
        done = subprocess.run(
            [compiler, *flags, str(_SOURCE), "-o", temporary],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["?"])[0]
            raise _Unavailable(f"building them failed ({compiler}): {first}")
        os.replace(temporary, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise _Unavailable(f"building them failed ({compiler}): {e}") from None
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _exact(op: str, dtype: torch.dtype) -> bool:
    """Once per op, dtype and process: the kernel gives torch's values and generator state."""
    ok = _checked.get((op, dtype))
    if ok is None:
        with _lock, plain():
            ok = _checked.get((op, dtype))
            if ok is None:
                ok = _same_as_torch(op, dtype)
                _checked[op, dtype] = ok
    return ok


# (elements, a, b, draws made before): partial last blocks, generators mid-block, a zero spread
_CASES = {
    "normal": [(16, 0.0, 1.0, 0), (17, 0.0, 1.0, 5), (16 * 41 + 9, 0.5, 0.02, 623),
               (MIN_ELEMENTS + 7, -3.0, 7.5, 1), (1 << 16, 0.0, 0.02, 0),
               (1 << 16, 1.0, 0.0, 17)],
    "uniform": [(1, 0.0, 1.0, 0), (17, -1.0, 1.0, 5), (16 * 41 + 9, -0.0625, 0.0625, 623),
                (MIN_ELEMENTS + 7, -3.0, 7.5, 1), (1 << 16, 0.0, 1.0, 0),
                (1 << 16, 2.0, 2.0, 17), (1 << 16, -1e-3, 1e-3, 3)],
}  # fmt: skip


def _same_as_torch(op: str, dtype: torch.dtype) -> bool:
    kernel = (_kernels or {})[op]
    for n, a, b, skip in _CASES[op]:
        ours = torch.Generator().manual_seed(n + skip)
        theirs = torch.Generator().manual_seed(n + skip)
        for g in (ours, theirs):  # mid-block: ``skip`` draws in
            torch.empty(skip, dtype=torch.int64).random_(0, 2, generator=g)
        expected = getattr(torch.empty(n, dtype=dtype), f"{op}_")(a, b, generator=theirs)
        got = torch.empty(n, dtype=dtype)
        if not _run(kernel, got, _DTYPES[dtype], a, b, ours):
            return False
        same = torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        if not (same and torch.equal(ours.get_state(), theirs.get_state())):
            return False
    return True
