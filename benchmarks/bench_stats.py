"""Looking at the values: ``jupyter_metainit.stats`` and ``compare`` against what they replace.

1. A Llama built under ``meta_init`` (bfloat16), ``stats(model)``: time and peak RSS in a fresh
   process, against the generation floor ``save`` is measured against (``normal_`` on every
   core over the same bytes, bench_save.py) and against computing the values alone (the core's
   ``values_to_write``, a batch at a time, as ``save`` computes them), with the statistics
   alone (the per-chunk measuring over the same bytes, on one thread) beside them. Targets:
   time <= 1.1 x the generation floor; peak RSS <= 2 x the largest tensor + 200 MB.
2. A smaller Llama's checkpoint: ``from_pretrained`` under ``meta_init`` + ``stats`` against
   eager ``from_pretrained`` + the same statistics with torch (float64, tensor by tensor).
   Target: <= 1.0 x eager.
3. Two such checkpoints (two seeds): ``compare(dir_a, dir_b)`` against reading both into
   memory (``safetensors.torch.load_file`` of every file, each tensor copied out of the
   mapping), and against reading both + the same comparison with torch. Target: <= 1.0 x
   reading both.

The files are written once, then read from the page cache by every measurement. Each row is
the median of ``--repeats`` rounds (1 by default), each round every measurement once in a fresh
process, the generation floor among them; the CPU-time ratios (medians of the rounds' CPU
times) are the steadier figures on a busy machine.

    .venv/bin/python benchmarks/bench_stats.py                 # 8 B (16 GB, generated only)
                                                               # and 1 B checkpoints
    .venv/bin/python benchmarks/bench_stats.py --size small    # 0.35 GB and 0.1 GB
    .venv/bin/python benchmarks/bench_stats.py --quick         # smoke run, tiny model
    .venv/bin/python benchmarks/bench_stats.py --size small --part deferred   # table 1 only
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from typing import Any

from _common import (
    LLAMA_1B,
    LLAMA_8B,
    LLAMA_SMALL,
    LLAMA_SMALLER,
    TINY_LLAMA,
    Meter,
    base_parser,
    child_main,
    environment_line,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    llama_config,
    median_result,
    print_errors,
    print_table,
    run_children,
    verdict,
)
from bench_save import generation_floor

SIZES = {
    "8b": (LLAMA_8B, LLAMA_1B),
    "small": (LLAMA_SMALL, LLAMA_SMALLER),
    "quick": (TINY_LLAMA, TINY_LLAMA),
}


def _deferred(shape: dict[str, Any], seed: int = 0) -> Any:
    import torch
    import transformers

    from jupyter_metainit import meta_init

    torch.manual_seed(seed)
    with meta_init():
        return transformers.AutoModelForCausalLM.from_config(llama_config(**shape),
                                                             dtype=torch.bfloat16)  # fmt: skip


def _sizes(model: Any) -> tuple[int, int]:
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    return sum(sizes), max(sizes)


def stats_deferred(shape: dict[str, Any]) -> dict[str, Any]:
    """``stats`` of a model built under ``meta_init``."""
    from jupyter_metainit import stats

    model = _deferred(shape)
    total, largest = _sizes(model)
    stats({"warm-up": model.lm_head.weight[:2]})  # the worker threads started
    meter = Meter()
    with meter():
        table = stats(model)
    return meter.as_dict() | {"bytes": total, "largest": largest, "rows": len(table)}


def values_only(shape: dict[str, Any]) -> dict[str, Any]:
    """The values alone: the core's ``values_to_write`` a batch at a time into the memory a
    ``Recycler`` hands on, as ``stats`` and ``save`` compute them; nothing measured."""
    from jupyter_metainit.core import Recycler, values_to_write
    from jupyter_metainit.inspection.pipeline import batches

    model = _deferred(shape)
    tensors = list(model.state_dict().values())
    values_to_write(model.lm_head.weight[:2])  # the warm-up stats_deferred has
    recycler = Recycler()
    meter = Meter()
    with meter():
        for batch in batches(tensors, lambda t: t.numel() * t.element_size()):
            recycler.start_batch(t.numel() * t.element_size() for t in batch)
            values = values_to_write(batch, recycler)
            recycler.settle(values)
            recycler.give_back(values)
            del values
    return meter.as_dict()


def statistics_alone(nbytes: int) -> dict[str, Any]:
    """The measuring alone, on one thread: ``stats``'s per-chunk statistics over ``nbytes`` of
    bfloat16 ``normal_`` values (one 64 MiB buffer measured again until the bytes are done, as
    the model's values come in batches that leave the cache); nothing generated in the time."""
    import torch

    from jupyter_metainit.inspection.moments import CHUNK_ELEMENTS, chunk_moments

    torch.set_num_threads(1)  # as each measuring worker runs
    buffer = torch.empty(min(nbytes, 64 << 20) // 2, dtype=torch.bfloat16).normal_()
    left = nbytes // 2
    meter = Meter()
    with meter():
        while left > 0:
            part = buffer[: min(left, buffer.numel())]
            for a in range(0, part.numel(), CHUNK_ELEMENTS):
                chunk_moments(part[a : a + CHUNK_ELEMENTS])
            left -= part.numel()
    return meter.as_dict() | {"ns_per_element": meter.cpu_seconds / (nbytes // 2) * 1e9}


def model_bytes(shape: dict[str, Any]) -> dict[str, Any]:
    """The model's bytes (the generation floor's), and its largest tensor's."""
    total, largest = _sizes(_deferred(shape))
    return {"bytes": total, "largest": largest}


def write_checkpoints(shape: dict[str, Any], root: str) -> dict[str, Any]:
    """Two checkpoints of the same shapes (seeds 0 and 1), written with ``save``."""
    from jupyter_metainit import save

    for seed in (0, 1):
        save(_deferred(shape, seed), f"{root}/seed{seed}", max_shard_size="1GB")
    return {"bytes": _sizes(_deferred(shape))[0]}


def _torch_statistics(t: Any) -> tuple:
    import torch

    x = t.detach().double()
    norm = torch.linalg.vector_norm(x)
    counts = ((x == 0).sum(), x.isnan().sum(), x.isinf().sum())
    return (x.mean(), x.std(correction=0), x.min(), x.max(), x.abs().max(), norm, *counts)


def eager_statistics(directory: str) -> dict[str, Any]:
    """Eager ``from_pretrained`` + the statistics with torch, tensor by tensor."""
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # imports are not the load

    meter = Meter()
    with meter():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        meter.lap("loaded")
        for t in model.state_dict().values():
            _torch_statistics(t)
    return meter.as_dict()


def stats_opened(directory: str) -> dict[str, Any]:
    """``from_pretrained`` under ``meta_init`` + ``stats``: read from the files."""
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # imports are not the load

    from jupyter_metainit import meta_init, stats

    stats({"warm-up": torch.ones(2)})
    meter = Meter()
    with meter():
        with meta_init():
            auto = transformers.AutoModelForCausalLM
            model = auto.from_pretrained(directory, dtype=torch.bfloat16)
        meter.lap("opened")
        stats(model)
    return meter.as_dict()


def _load_all(directory: str) -> dict[str, Any]:
    """Every tensor of a checkpoint's files, copied into memory (``load_file`` maps the file;
    the copy is the read)."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update({k: v.clone() for k, v in load_file(os.path.join(directory, name)).items()})
    return out


def read_both(directories: list[str]) -> dict[str, Any]:
    """Both checkpoints read into memory, one after the other."""
    import safetensors.torch  # noqa: F401 - imports are not the read

    meter = Meter()
    with meter():
        for directory in directories:
            loaded = _load_all(directory)
            del loaded
    return meter.as_dict()


def eager_compare(directories: list[str]) -> dict[str, Any]:
    """Both checkpoints read into memory + the same comparison with torch, tensor by tensor."""
    import safetensors.torch  # noqa: F401 - imports are not the read
    import torch

    meter = Meter()
    with meter():
        a, b = (_load_all(d) for d in directories)
        for name in a:
            x, y = a[name].double(), b[name].double()
            norm_x, norm_y = torch.linalg.vector_norm(x), torch.linalg.vector_norm(y)
            torch.equal(a[name], b[name])
            ((x - y).abs().max(), torch.linalg.vector_norm(x - y) / norm_x,
             x.reshape(-1) @ y.reshape(-1) / (norm_x * norm_y))  # fmt: skip
    return meter.as_dict()


def compare_checkpoints(directories: list[str]) -> dict[str, Any]:
    """``compare(dir_a, dir_b)``."""
    import torch

    from jupyter_metainit import compare

    compare({"w": torch.ones(2)}, {"w": torch.ones(2)})
    meter = Meter()
    with meter():
        table = compare(*directories)
    return meter.as_dict() | {"differ": int((table["status"] == "differ").sum())}


MEASUREMENTS = {
    "stats_deferred": stats_deferred,
    "values_only": values_only,
    "statistics_alone": statistics_alone,
    "generation_floor": generation_floor,
    "model_bytes": model_bytes,
    "write_checkpoints": write_checkpoints,
    "eager_statistics": eager_statistics,
    "stats_opened": stats_opened,
    "read_both": read_both,
    "eager_compare": eager_compare,
    "compare_checkpoints": compare_checkpoints,
}


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose time is the median, with the median CPU time of all rounds."""
    out = median_result(results)
    if "cpu_seconds" in out:
        out["cpu_seconds"] = statistics.median(r["cpu_seconds"] for r in results)
    return out


def _jobs(
    big: dict[str, Any], root: str, nbytes: int | None, part: str
) -> list[tuple[str, dict[str, Any]]]:
    dirs = [f"{root}/seed0", f"{root}/seed1"]
    floor = [("generation_floor", {"nbytes": nbytes})] if nbytes else []
    alone = [("statistics_alone", {"nbytes": nbytes})] if nbytes else []
    deferred = [("stats_deferred", {"shape": big}), ("values_only", {"shape": big}), *floor,
                *alone]  # fmt: skip
    checkpoints = [("eager_statistics", {"directory": dirs[0]}),
                   ("stats_opened", {"directory": dirs[0]}), ("read_both", {"directories": dirs}),
                   ("eager_compare", {"directories": dirs}),
                   ("compare_checkpoints", {"directories": dirs})]  # fmt: skip
    return {"deferred": deferred, "checkpoints": checkpoints}.get(part, deferred + checkpoints)


def main() -> None:
    child_main(MEASUREMENTS)
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="8b", help="model shapes")
    parser.add_argument(
        "--part", choices=["all", "deferred", "checkpoints"], default="all",
        help="the deferred model's table, the checkpoints' table, or both",
    )  # fmt: skip
    args = parser.parse_args()
    big, small = SIZES["quick" if args.quick else args.size]
    print("# bench_stats: statistics and comparisons of models, streamed")
    print(environment_line())
    root = tempfile.mkdtemp(prefix="jmi-bench-stats-", dir=os.environ.get("BENCH_DIR"))
    try:
        prepare = [("model_bytes", {"shape": big})]
        if args.part != "deferred":
            prepare.insert(0, ("write_checkpoints", {"shape": small, "root": root}))
        written = dict(zip(["sizing the model"] if len(prepare) == 1 else
                           ["writing the checkpoints", "sizing the model"],
                           run_children(__file__, prepare), strict=True))  # fmt: skip
        print_errors(written)
        jobs = _jobs(big, root, written["sizing the model"].get("bytes"), args.part)
        repeats = 1 if args.quick else args.repeats or 1
        # Rounds of every job (the floor among them): the load drifts during a run, and each
        # ratio's two rows then see the same drift.
        results = run_children(__file__, [job for _ in range(repeats) for job in jobs],
                               separate=not args.quick)  # fmt: skip
        named = {name: _median(results[k :: len(jobs)]) for k, (name, _) in enumerate(jobs)}
        print_errors(named)
        if args.part != "checkpoints":
            _print_deferred(named)
        if args.part != "deferred":
            _print_checkpoints(named, written["writing the checkpoints"].get("bytes"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str = "seconds") -> float | None:
    if key not in a or not b.get(key):
        return None
    return a[key] / b[key]


_FIGURES = ["time", "CPU time", "peak extra RSS", "ratio"]


def _figures(one: dict[str, Any], against: dict[str, Any]) -> list[str]:
    """Time, CPU time, peak, and the ratios of time and CPU time to ``against``'s (the row
    each ratio is against is named in the table's text)."""
    if "seconds" not in one:
        return ["n/a"] * 5
    return [fmt_s(one["seconds"]), fmt_s(one["cpu_seconds"]),
            fmt_mb(one.get("peak_extra")) if "peak_extra" in one else "",
            fmt_ratio(_ratio(one, against)) if against else "",
            fmt_ratio(_ratio(one, against, "cpu_seconds")) if against else ""]  # fmt: skip


def _print_deferred(named: dict[str, dict[str, Any]]) -> None:
    keys = ("stats_deferred", "generation_floor", "values_only", "statistics_alone")
    ours, floor, values, alone = (named.get(k, {}) for k in keys)
    if "seconds" not in ours:
        return
    peak_target = 2 * ours["largest"] + 200 * 10**6
    rows = [
        ["`meta_init` + `stats`", *_figures(ours, floor)],
        [f"generation floor: `normal_` on {floor.get('cores', '?')} cores",
         *_figures(floor, {})],
        ["the values alone (`values_to_write`, as `save` computes them)",
         *_figures(values, floor)],
        [f"the statistics alone, one thread ({alone.get('ns_per_element', 0):.2f} ns an element)",
         *_figures(alone, floor)],
    ]  # fmt: skip
    print_table(
        f"stats of a {ours['bytes'] / 1e9:.2f} GB bfloat16 model never allocated, largest "
        f"tensor {ours['largest'] / 1e6:.0f} MB",
        ["step", *_FIGURES[:3], "time / floor", "CPU / floor's CPU"], rows,
    )  # fmt: skip
    ratio = _ratio(ours, floor)
    print(f"peak RSS <= 2 x largest + 200 MB ({fmt_mb(peak_target)}): "
          f"{verdict(ours['peak_extra'] <= peak_target)}; time <= 1.1 x generation floor: "
          f"{verdict(None if ratio is None else ratio <= 1.1)}")  # fmt: skip


def _print_checkpoints(named: dict[str, dict[str, Any]], nbytes: int | None) -> None:
    eager, opened = named["eager_statistics"], named["stats_opened"]
    both, ours = named["read_both"], named["compare_checkpoints"]
    eager_pairs = named["eager_compare"]
    size = f"{nbytes / 1e9:.2f} GB" if nbytes else "?"
    rows = [
        ["eager `from_pretrained` + the statistics with torch", *_figures(eager, {})],
        ["`from_pretrained` under `meta_init` + `stats`", *_figures(opened, eager)],
        ["reading both checkpoints into memory", *_figures(both, {})],
        ["reading both + the same comparison with torch", *_figures(eager_pairs, both)],
        ["`compare(dir_a, dir_b)`", *_figures(ours, both)],
    ]  # fmt: skip
    print_table(f"{size} bfloat16 checkpoints in the page cache",
                ["method", *_FIGURES, "CPU ratio"], rows)  # fmt: skip
    r1, r2 = _ratio(opened, eager), _ratio(ours, both)
    v1, v2 = verdict(None if r1 is None else r1 <= 1.0), verdict(None if r2 is None else r2 <= 1)
    print(f"stats of a checkpoint <= 1.0 x eager: {v1}; compare <= 1.0 x reading both: {v2}")


if __name__ == "__main__":
    main()
