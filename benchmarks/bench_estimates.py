"""Benchmark of the estimates layer on a Llama-3-70B-sized deferred model.

Run: .venv/bin/python benchmarks/bench_estimates.py
Prints one table: memory_table vs accelerate.utils.compute_module_sizes, dry_run (1 x 4096
tokens) vs a bare meta-device forward and torch's FlopCounterMode alone, with resident memory.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
import transformers
from accelerate.utils import compute_module_sizes
from torch.utils.flop_counter import FlopCounterMode

from jupyter_metainit import meta_init
from jupyter_metainit.estimates import dry_run, memory_table, render_html

CONFIG = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
              num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
TOKENS = (1, 4096)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    cfg = transformers.LlamaConfig(**CONFIG)
    start = time.perf_counter()
    with meta_init():
        deferred = transformers.AutoModelForCausalLM.from_config(cfg)
    build_deferred = time.perf_counter() - start
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    modules = sum(1 for _ in deferred.modules())

    rows: list[tuple[str, float, str]] = []
    t_table = timed(lambda: memory_table(deferred))
    t_table_meta = timed(lambda: memory_table(meta))
    t_acc = timed(lambda: compute_module_sizes(deferred))
    t_count = timed(lambda: sum(p.numel() for p in deferred.parameters()))
    rows += [
        ("memory_table, meta_init model", t_table, f"{t_table / t_acc:.2f}x accelerate"),
        ("memory_table, torch.device('meta') model", t_table_meta,
         f"{t_table_meta / t_acc:.2f}x accelerate"),
        ("accelerate compute_module_sizes (no dedup/shared/state/training)", t_acc, "1.00x"),
        ("sum(p.numel() for p in parameters())", t_count, f"{t_count / t_acc:.2f}x accelerate"),
    ]
    table = memory_table(deferred)
    t_html = timed(lambda: render_html(table), repeat=3)
    t_html_all = timed(lambda: render_html(table, max_rows=None), repeat=1)
    rows += [
        ("render_html (default, depth-limited to 200 rows)", t_html, ""),
        (f"render_html (all {modules:,} rows)", t_html_all, ""),
    ]

    def bare_forward() -> None:
        with torch.no_grad():
            meta(torch.empty(TOKENS, dtype=torch.long, device="meta"))

    def flop_counter_only() -> None:
        with torch.no_grad(), FlopCounterMode(display=False):
            meta(torch.empty(TOKENS, dtype=torch.long, device="meta"))

    t_bare = timed(bare_forward, repeat=1)
    t_flops = timed(flop_counter_only, repeat=1)
    rss_before, peak_before = rss_mib(), peak_mib()
    start = time.perf_counter()
    result = dry_run(deferred, TOKENS)
    t_dry = time.perf_counter() - start
    rss_after, peak_after = rss_mib(), peak_mib()
    t_dry_meta = timed(lambda: dry_run(meta, TOKENS), repeat=1)
    rows += [
        ("dry_run 1x4096, meta_init model", t_dry, f"{t_dry / t_bare:.1f}x bare meta forward"),
        ("dry_run 1x4096, torch.device('meta') model", t_dry_meta,
         f"{t_dry_meta / t_bare:.1f}x bare meta forward"),
        ("bare forward on meta tensors (no estimates)", t_bare, "1.0x"),
        ("FlopCounterMode forward on meta tensors", t_flops, f"{t_flops / t_bare:.1f}x"),
    ]

    root = result.loc[""]
    print(f"Llama-3-70B-sized model: {modules:,} modules, {int(root['params']):,} parameters, "
          f"built under meta_init in {build_deferred:.2f} s")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print()
    width = max(len(r[0]) for r in rows)
    print(f"{'operation':<{width}}  {'seconds':>8}  ratio")
    for name, seconds, ratio in rows:
        print(f"{name:<{width}}  {seconds:8.3f}  {ratio}")
    print()
    print(f"dry_run resident memory: {rss_before:,.0f} MiB before, {rss_after:,.0f} MiB after; "
          f"process peak {peak_before:,.0f} -> {peak_after:,.0f} MiB")
    print(f"dry_run figures: {int(root['flops']):,} FLOPs, logits {root['output_shape']}, "
          f"peak activations {result.attrs['dry_run']['peak_activation_bytes'] / 2**30:.2f} GiB, "
          f"peak forward (weights + activations) {root['peak_forward_bytes'] / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
