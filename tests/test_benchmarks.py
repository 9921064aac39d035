"""Smoke runs of the core benchmarks: each script runs with --quick and prints its tables.

Not timed tests: the figures are not checked, only that every measurement ran (ours included)
and that the tables came out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
ERROR_PREFIX = "measurement failed: "  # benchmarks/_common.py prints it for a failed measurement

SCRIPTS = {
    "bench_construction.py": ["### Construction", "jupyter_metainit.meta_init()"],
    "bench_layer.py": ["### Decoder layer", "exact layer equals eager construction"],
    "bench_materialize.py": ["### Whole model", "meta_init + materialize", "torch.equal"],
    "bench_memory_cycles.py": ["### RSS after each cycle's del", "### Against eager"],
    "bench_progress.py": ["### Progress events and cancel latency", "### Cost of the steps"],
    "bench_rng.py": ["### Jump ahead", "draws skipped", "### Fills on one thread", "same bits"],
    "bench_save.py": [
        "bfloat16 model, largest tensor",
        "generation floor",
        "eager build + `save_file`",
    ],
    "bench_selective.py": ["### (a)", "### (b)", "### (c)", "### (d)"],
    "bench_stats.py": ["never allocated", "generation floor", "`compare(dir_a, dir_b)`"],
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_run_prints_its_tables(script):
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "|---" in out, out
    for needle in SCRIPTS[script]:
        assert needle in out, out
    assert ERROR_PREFIX not in out, out
