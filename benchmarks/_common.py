"""Shared helpers for the benchmark scripts: fresh-process measurements, resident memory, tables.

Why a fresh process per measurement: resident memory (RSS) is a property of a whole process, and
allocators keep freed memory; a measurement that follows another in the same process inherits its
heap and its imported modules. Each measurement therefore runs as
``python <script> --child '<json>'`` and sends one JSON line back.

A benchmark script defines ``MEASUREMENTS = {"name": function}`` (each function takes keyword
parameters and returns a JSON-able dict) and calls :func:`child_main` first thing in ``main``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULT_TAG = "@@BENCH-RESULT@@ "
MiB = 1024 * 1024
# The shapes of Llama-3-70B, the size the targets are stated for. One definition, a data file
# beside the scripts, because the tests read it too (tests/_models.py): neither folder is a
# package the other can import without changing sys.path.
LLAMA_70B: dict[str, int] = json.loads(
    (Path(__file__).resolve().parent / "llama_70b.json").read_text()
)
# Smaller Llama shapes the scripts measure at (parameters counted with untied embeddings, as
# llama_config builds them). LLAMA_8B and LLAMA_1B are Llama-3.1-8B's and Llama-3.2-1B's shapes.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
# 0.49 B parameters (1 GB in bfloat16)
LLAMA_MEDIUM = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
# 0.17 B and 0.05 B parameters
LLAMA_SMALL = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
LLAMA_SMALLER = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
# for --quick runs, which check that a script works, not how fast
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip

# --------------------------------------------------------------------------- resident memory


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size: VmHWM (resettable) when readable, else ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


@dataclass
class Meter:
    """Wall time, CPU time (all threads), peak extra RSS and retained extra RSS of the code
    inside ``with meter():``. CPU time / wall time shows how many cores the code kept busy."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    peak_extra: int = 0
    retained_extra: int = 0
    baseline: int = 0
    peak_is_reset: bool = False
    laps: dict[str, float] = field(default_factory=dict)
    _t0: float = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Meter]:
        gc.collect()
        self.baseline = rss_bytes()
        self.peak_is_reset = _reset_peak()
        if not self.peak_is_reset:  # the peak so far counts: take the larger mark as baseline
            self.baseline = max(self.baseline, peak_rss_bytes())
        self._t0 = time.perf_counter()
        c0 = time.process_time()
        yield self
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - c0
        self.peak_extra = max(0, peak_rss_bytes() - self.baseline)
        self.retained_extra = rss_bytes() - self.baseline

    def lap(self, name: str) -> None:
        """Record the time elapsed since the block started under ``name``."""
        self.laps[name] = time.perf_counter() - self._t0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "peak_extra": self.peak_extra,
            "retained_extra": self.retained_extra,
            "laps": dict(self.laps),
        }


def _libc() -> Any:
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def malloc_trim() -> bool:
    """Ask glibc to return freed heap memory to the system; False where there is no glibc."""
    try:
        _libc().malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def fresh_pages_for_tensors() -> bool:
    """Fix glibc's mmap threshold at 64 KiB, so that every tensor is mapped fresh and freed to
    the system: each build then writes fresh memory, as in a fresh process. Left dynamic,
    glibc decides by allocation history whether a freed tensor's pages are reused, which alone
    moved vit_b_16's materialization between 0.37 s and 0.55 s from one process to the next.
    False where there is no glibc."""
    try:
        return bool(_libc().mallopt(-3, 1 << 16))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def tensor_bytes(obj: Any) -> int:
    """Bytes that the parameters and buffers of a module (or a tensor) hold once real."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    tensors = list(obj.parameters()) + list(obj.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------- the library under test


def load_core() -> Any:
    """``jupyter_metainit`` with the core API, or raise an ImportError saying what is missing."""
    import jupyter_metainit

    for name in ("meta_init", "materialize", "dematerialize", "is_deferred"):
        if not hasattr(jupyter_metainit, name):
            raise ImportError(f"jupyter_metainit.{name} is missing")
    return jupyter_metainit


def llama_config(**overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` (float32, untied embeddings unless overridden)."""
    from transformers import LlamaConfig

    kw = dict(tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def build_causal_lm(config: Any) -> Any:
    """``AutoModelForCausalLM.from_config(config)`` in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def torchvision_models() -> Any:
    """``torchvision.models``, for its model constructors only (pure Python).

    PyPI's torchvision is a CUDA build whose op registrations fail beside the CPU torch, and
    once in the venv it breaks ``transformers`` imports. So it is installed with ``--no-deps``
    into ``.bench-deps/`` at the repository root (with pillow, which its import needs), kept out
    of the venv, and its two registration modules are stubbed before it is imported.
    """
    import importlib
    import types

    import torch

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".bench-deps")
    if not os.path.isdir(os.path.join(root, "torchvision")):
        major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        spec = f"torchvision=={major - 2}.{minor + 15}.*"  # torch 2.13 pairs with 0.28
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", root,
             spec, "pillow"],
            check=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    if root not in sys.path:
        sys.path.insert(0, root)
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    return importlib.import_module("torchvision.models")


def write_sparse_checkpoint(model: Any, directory: str, shard_bytes: int = 5 << 30) -> int:
    """Save ``model``'s state dict (shapes and dtypes only: it may live on the meta device) as a
    sharded safetensors checkpoint whose tensor data are holes: real headers and index, the
    files' full logical size, almost no disk. Reads return zeros. Returns the total bytes."""
    import struct

    import torch

    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    entries = [(k, tuple(v.shape), v.dtype, v.numel() * v.element_size())
               for k, v in model.state_dict().items()]  # fmt: skip
    shards: list[list[tuple]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry[3] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, shape, dtype, nbytes in shard:
            header[key] = {"dtype": names[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}  # fmt: skip
            offset += nbytes
            weight_map[key] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(directory, fname), "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            f.truncate(8 + len(raw) + offset)  # the data: a hole
        total += offset
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    model.config.save_pretrained(directory)
    return total


def bytes_read() -> int:
    """Bytes this process has read through read/pread calls (``rchar``): holes count too."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


# --------------------------------------------------------------------------- processes


def child_main(measurements: dict[str, Callable[..., dict[str, Any]]]) -> None:
    """If this process was started as a measurement child, run it, print its result and exit."""
    if len(sys.argv) < 3 or sys.argv[1] != "--child":
        return
    jobs = json.loads(sys.argv[2])
    results = []
    for name, params in jobs:
        try:
            results.append(measurements[name](**params))
        except Exception as exc:  # reported in the table, never hidden
            last = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{os.path.basename(last.filename)}:{last.lineno}"
            results.append({"error": f"{type(exc).__name__}: {exc}".strip()[:300] + f" ({where})"})
        gc.collect()
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(results), flush=True)
    sys.exit(0)


def run_children(
    script: str,
    jobs: Sequence[tuple[str, dict[str, Any]]],
    *,
    separate: bool = True,
    timeout: float = 900,
) -> list[dict[str, Any]]:
    """Run ``jobs`` [(measurement, params)] in fresh processes: one each, or all in one if not
    ``separate`` (the ``--quick`` smoke runs). A crashed or silent child yields an error dict."""
    groups = [[job] for job in jobs] if separate else [list(jobs)]
    out: list[dict[str, Any]] = []
    for group in groups:
        cmd = [sys.executable, script, "--child", json.dumps(group)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            out.extend({"error": f"timed out after {timeout:.0f} s"} for _ in group)
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if lines:
            out.extend(json.loads(lines[-1][len(RESULT_TAG) :]))
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            msg = f"child exited {proc.returncode}: " + " | ".join(tail)
            out.extend({"error": msg[:400]} for _ in group)
    return out


def repeat_jobs(name: str, params: dict[str, Any], repeats: int) -> list[tuple[str, dict]]:
    return [(name, params)] * repeats


def median_result(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The result whose ``seconds`` is the median; one error makes the whole an error."""
    for r in results:
        if "error" in r:
            return r
    if any("seconds" not in r for r in results):
        return dict(results[0])
    ordered = sorted(results, key=lambda r: r["seconds"])
    med = dict(ordered[(len(ordered) - 1) // 2])
    med["all_seconds"] = [r["seconds"] for r in results]
    if len(results) > 1:
        med["stdev_seconds"] = statistics.pstdev(med["all_seconds"])
    return med


# --------------------------------------------------------------------------- printing


def fmt_s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def fmt_mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MiB:,.1f} MiB"


def fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A Markdown table (readable as text, pastes into the docs as is)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    print(f"\n### {title}\n")
    print(line(cells[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print(line(row))
    print(flush=True)


ERROR_PREFIX = "measurement failed: "


def print_errors(named: dict[str, dict[str, Any]]) -> None:
    """One line per failed measurement (tests/test_benchmarks.py looks for ERROR_PREFIX)."""
    for name, res in named.items():
        if "error" in res:
            print(f"{ERROR_PREFIX}{name}: {res['error']}")


def environment_line() -> str:
    import platform

    import torch

    return (
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one process: a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="fresh processes per measurement")
    return p
