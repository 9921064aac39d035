"""Saving a model that was never allocated: ``jupyter_metainit.save`` against the hardware floors.

1. An 8 B-shaped Llama (Llama-3-8B shapes, bfloat16, ~16 GB) built under ``meta_init`` and saved as
   sharded safetensors (5 GB shards) with ``save``: time and peak RSS in a fresh process. Targets:
   peak RSS <= 2 x the largest tensor + 200 MB; time <= 1.1 x max(generation floor, disk write).
2. The floors, measured in the same run: the generation floor (``normal_`` on every core over
   the same number of bfloat16 bytes, into reused buffers, as ``save`` reuses written batches'
   buffers) and a ``dd``-style sequential write of the same bytes into the same directory
   (64 MiB blocks, no fsync: neither does ``save``), and, for reference, the same with
   ``O_DIRECT`` (the disk itself, as ``save`` writes where the file system allows it). Wall and
   CPU time of each: the CPU time of the save against the first two floors' CPU time added up.
3. For comparison, a 1 B-shaped Llama: eager build + ``safetensors.torch.save_file`` (its memory is
   the whole model) and ``meta_init`` + ``save``.

    .venv/bin/python benchmarks/bench_save.py                 # full size: ~17 GB of disk
                                                              # and ~8 GB RAM (eager 1 B)
    .venv/bin/python benchmarks/bench_save.py --size small    # ~0.5 GB, for development
    .venv/bin/python benchmarks/bench_save.py --quick         # smoke run, tiny model

With ``--dcp``: ``save(format="dcp")`` of a 0.17 B Llama (bfloat16, 0.34 GB) built under
``meta_init``: one file per rank (this version) against one file per tensor (the writer it
replaced: torch's ``FileSystemWriter(single_file_per_rank=False)`` with the same planner), and
torch's own ``dcp.save`` of the eagerly built model (one file, the whole model in memory);
``--repeats`` alternating rounds in fresh processes, medians shown.

    .venv/bin/python benchmarks/bench_save.py --dcp --repeats 3
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
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
    load_core,
    median_result,
    print_errors,
    print_table,
    run_children,
    verdict,
)

SIZES = {
    "8b": (LLAMA_8B, LLAMA_1B),
    "small": (LLAMA_SMALL, LLAMA_SMALLER),
    "quick": (TINY_LLAMA, TINY_LLAMA),
}
BLOCK = 64 << 20


def _model(shape: dict[str, Any], deferred: bool) -> Any:
    import torch
    import transformers

    cfg = llama_config(**shape)
    torch.manual_seed(0)
    if not deferred:
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    jmi = load_core()
    with jmi.meta_init():
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def _sizes(model: Any) -> tuple[int, int]:
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    return sum(sizes), max(sizes)


def save_deferred(shape: dict[str, Any], directory: str) -> dict[str, Any]:
    """meta_init build, then ``save`` as 5 GB shards."""
    from jupyter_metainit import save

    model = _model(shape, deferred=True)
    total, largest = _sizes(model)
    meter = Meter()
    with meter():
        save(model, directory, max_shard_size="5GB")
    written = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    return meter.as_dict() | {"bytes": total, "largest": largest, "written": written}


def eager_save_file(shape: dict[str, Any], directory: str) -> dict[str, Any]:
    """Eager build + ``save_file`` (the whole model in memory)."""
    import transformers.models.llama.modeling_llama  # noqa: F401 - imports are not the build
    from safetensors.torch import save_file

    meter = Meter()
    with meter():
        model = _model(shape, deferred=False)
        meter.lap("built")
        os.makedirs(directory, exist_ok=True)
        save_file(model.state_dict(), os.path.join(directory, "model.safetensors"))
    total, largest = _sizes(model)
    return meter.as_dict() | {"bytes": total, "largest": largest}


def generation_floor(nbytes: int) -> dict[str, Any]:
    """``normal_`` in bfloat16 on every core over ``nbytes``, into one reused buffer per core
    (each core's share of the elements, all of them: the last fill of a core is the rest)."""
    import torch

    cores = len(os.sched_getaffinity(0))
    per_core = nbytes // 2 // cores  # elements

    def fill(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        buffer = torch.empty(max(1, min(per_core, BLOCK // 2)), dtype=torch.bfloat16)
        for start in range(0, per_core, buffer.numel()):
            buffer[: per_core - start].normal_(generator=gen)

    torch.set_num_threads(1)
    meter = Meter()
    with meter():
        threads = [threading.Thread(target=fill, args=(k,)) for k in range(cores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return meter.as_dict() | {"cores": cores}


def sequential_write(nbytes: int, directory: str) -> dict[str, Any]:
    """``dd if=/dev/zero bs=64M``-style: one file, 64 MiB blocks, no fsync."""
    block = os.urandom(1 << 20) * (BLOCK >> 20)
    path = os.path.join(directory, "dd.bin")
    meter = Meter()
    with meter(), open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, BLOCK)])
    os.remove(path)
    return {"seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds}


def all_in_one(big: dict[str, Any], small: dict[str, Any], root: str) -> dict[str, Any]:
    """Every measurement in this one process (the ``--quick`` smoke run: one start of Python)."""
    ours = save_deferred(big, f"{root}/big")
    shutil.rmtree(f"{root}/big", ignore_errors=True)
    floors = [generation_floor(ours["bytes"]), sequential_write(ours["bytes"], root),
              direct_write(ours["bytes"], root)]  # fmt: skip
    small_runs = [eager_save_file(small, f"{root}/eager"), save_deferred(small, f"{root}/small")]
    return {"ours": ours, "floors": floors, "small_runs": small_runs}


def direct_write(nbytes: int, directory: str) -> dict[str, Any]:
    """The disk's own speed: the same bytes with ``O_DIRECT`` (no page cache), 64 MiB blocks
    from aligned memory, as ``save`` writes where the file system allows it."""
    import mmap

    block = mmap.mmap(-1, BLOCK)
    block.write(os.urandom(1 << 20) * (BLOCK >> 20))
    path = os.path.join(directory, "direct.bin")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as exc:
        return {"refused": f"O_DIRECT refused here: {exc}"}  # then save uses the page cache
    meter = Meter()
    with meter():
        done = 0
        while done < nbytes:
            done += os.pwrite(fd, block, done)
        os.ftruncate(fd, nbytes)
    os.close(fd)
    os.remove(path)
    return {"seconds": meter.seconds, "cpu_seconds": meter.cpu_seconds}


def _files_and_bytes(directory: str) -> dict[str, int]:
    names = os.listdir(directory)
    return {"files": len(names),
            "written": sum(os.path.getsize(os.path.join(directory, n)) for n in names)}  # fmt: skip


def dcp_save_deferred(shape: dict[str, Any], directory: str) -> dict[str, Any]:
    """meta_init build, then ``save(format="dcp")``: one file per rank."""
    from jupyter_metainit import save

    model = _model(shape, deferred=True)
    meter = Meter()
    with meter():
        save(model, directory, format="dcp")
    return meter.as_dict() | _files_and_bytes(directory)


def dcp_save_file_per_tensor(shape: dict[str, Any], directory: str) -> dict[str, Any]:
    """The writer ``save(format="dcp")`` used before: torch's one file per tensor, values
    computed on demand by the same planner."""
    import torch.distributed.checkpoint as dcp

    from jupyter_metainit.saving.dcp import ValuesOnDemandPlanner
    from jupyter_metainit.saving.writer import Progress

    model = _model(shape, deferred=True)
    planner = ValuesOnDemandPlanner(Progress(None, 0))
    meter = Meter()
    with meter():
        writer = dcp.FileSystemWriter(directory, single_file_per_rank=False, thread_count=1)
        dcp.save(model.state_dict(), storage_writer=writer, planner=planner, no_dist=True)
    planner.close()
    return meter.as_dict() | _files_and_bytes(directory)


def dcp_save_eager(shape: dict[str, Any], directory: str) -> dict[str, Any]:
    """Eager build + torch's ``dcp.save`` (its default writer: one file per rank)."""
    import torch.distributed.checkpoint as dcp
    import transformers.models.llama.modeling_llama  # noqa: F401 - imports are not the build

    meter = Meter()
    with meter():
        model = _model(shape, deferred=False)
        meter.lap("built")
        dcp.save(model.state_dict(), checkpoint_id=directory, no_dist=True)
    return meter.as_dict() | _files_and_bytes(directory)


MEASUREMENTS = {
    "dcp_save_deferred": dcp_save_deferred,
    "dcp_save_file_per_tensor": dcp_save_file_per_tensor,
    "dcp_save_eager": dcp_save_eager,
    "all_in_one": all_in_one,
    "save_deferred": save_deferred,
    "eager_save_file": eager_save_file,
    "generation_floor": generation_floor,
    "direct_write": direct_write,
    "sequential_write": sequential_write,
}


def main() -> None:
    child_main(MEASUREMENTS)
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="8b", help="model shapes")
    parser.add_argument("--dcp", action="store_true", help="one file per rank or per tensor")
    args = parser.parse_args()
    big, small = SIZES["quick" if args.quick else args.size]
    print("# bench_save: saving a model that was never allocated")
    print(environment_line())
    root = tempfile.mkdtemp(prefix="jmi-bench-save-", dir=os.environ.get("BENCH_DIR"))
    try:
        if args.dcp:
            _measure_dcp(SIZES["quick" if args.quick else "small"][0], root, args.repeats or 1)
            return
        if args.quick:  # the smoke run: one process for everything
            job = ("all_in_one", {"big": big, "small": small, "root": root})
            every = run_children(__file__, [job])[0]
            print_errors({"quick run": every})
            if "error" in every:
                return
            ours, floors, small_runs = every["ours"], every["floors"], every["small_runs"]
        else:
            ours, floors, small_runs = _measure_apart(big, small, root)
            if "error" in ours:
                return
        print_errors({"generation floor": floors[0], "sequential write": floors[1],

                      "eager save_file": small_runs[0],
                      "save of the small model": small_runs[1]})  # fmt: skip
        _print_big(ours, floors)
        _print_small(small_runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _measure_apart(big: dict[str, Any], small: dict[str, Any], root: str) -> tuple:
    """Each measurement in a fresh process: ours first (the floors need its byte count)."""
    job = ("save_deferred", {"shape": big, "directory": f"{root}/big"})
    ours = run_children(__file__, [job])[0]
    shutil.rmtree(f"{root}/big", ignore_errors=True)
    print_errors({"save of the big model": ours})
    if "error" in ours:
        return ours, [], []
    floors = run_children(__file__, [("generation_floor", {"nbytes": ours["bytes"]}),
                                     ("sequential_write", {"nbytes": ours["bytes"],
                                                           "directory": root}),
                                     ("direct_write", {"nbytes": ours["bytes"],
                                                       "directory": root})])  # fmt: skip
    small_runs = run_children(__file__, [
        ("eager_save_file", {"shape": small, "directory": f"{root}/eager"}),
        ("save_deferred", {"shape": small, "directory": f"{root}/small"}),
    ])  # fmt: skip
    return ours, floors, small_runs


def _print_big(ours: dict[str, Any], floors: list[dict[str, Any]]) -> None:
    gen, write = floors[0].get("seconds"), floors[1].get("seconds")
    gen_cpu, write_cpu = floors[0].get("cpu_seconds"), floors[1].get("cpu_seconds")
    floor = max(gen, write) if gen is not None and write is not None else None
    work = gen_cpu + write_cpu if gen_cpu is not None and write_cpu is not None else None
    peak_target = 2 * ours["largest"] + 200 * 10**6
    rows = [
        ["`meta_init` + `save` (sharded safetensors)", fmt_s(ours["seconds"]),
         fmt_s(ours["cpu_seconds"]), fmt_mb(ours["peak_extra"]),
         fmt_ratio(ours["seconds"] / floor) if floor else "n/a",
         fmt_ratio(ours["cpu_seconds"] / work) if work else "n/a"],
        [f"generation floor: `normal_` on {floors[0].get('cores', '?')} cores", fmt_s(gen),
         fmt_s(gen_cpu), "", "", ""],
        ["sequential write (64 MiB blocks, no fsync)", fmt_s(write), fmt_s(write_cpu), "", "",
         ""],
        ["same, `O_DIRECT` (the disk itself)", fmt_s(floors[2].get("seconds")),
         fmt_s(floors[2].get("cpu_seconds")), "", "", ""],
    ]  # fmt: skip
    print_table(
        f"{ours['bytes'] / 1e9:.1f} GB bfloat16 model, largest tensor "
        f"{ours['largest'] / 1e6:.0f} MB",
        ["step", "time", "CPU time", "peak extra RSS", "time / max(floors)",
         "CPU / (floors' CPU)"],
        rows,
    )  # fmt: skip
    print(f"peak RSS <= 2 x largest + 200 MB ({fmt_mb(peak_target)}): "
          f"{verdict(ours['peak_extra'] <= peak_target)}; time <= 1.1 x max(floors): "
          f"{verdict(None if floor is None else ours['seconds'] <= 1.1 * floor)}")  # fmt: skip
    print(
        "CPU time: all threads. The floors are the generation and the page-cache write (as "
        "before; neither it nor `save` fsyncs). Writing into the page cache costs about as much "
        "CPU as generating; `save` writes with O_DIRECT where the file system allows it (the "
        "device copies from the values' memory: almost no CPU, data on the device at the end), "
        "else through the page cache. CPU against the floors' CPU added up: below 1 means "
        "the page-cache copy was avoided."
    )


DCP_RUNS = {
    "`meta_init` + `save(format='dcp')`: one file per rank": "dcp_save_deferred",
    "same, one file per tensor (the writer before)": "dcp_save_file_per_tensor",
    "eager build + torch's `dcp.save` (one file per rank)": "dcp_save_eager",
}


def _measure_dcp(shape: dict[str, Any], root: str, repeats: int) -> None:
    """Each way ``repeats`` times, in alternating rounds of fresh processes; medians."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in DCP_RUNS.values()}
    for round_ in range(repeats):
        for name in DCP_RUNS.values():
            directory = f"{root}/{name}-{round_}"
            results[name] += run_children(__file__, [(name, {"shape": shape,
                                                             "directory": directory})])  # fmt: skip
            shutil.rmtree(directory, ignore_errors=True)
    medians = {name: median_result(runs) for name, runs in results.items()}
    print_errors(medians)
    rows = []
    for label, name in DCP_RUNS.items():
        r = medians[name]
        if "error" in r:
            continue
        spread = r.get("all_seconds", [r["seconds"]])
        rows.append([label, r["files"], fmt_s(r["seconds"]),
                     f"{min(spread):.2f}-{max(spread):.2f} s", fmt_s(r["cpu_seconds"]),
                     fmt_mb(r["peak_extra"]), f"{r['written'] / 1e6:,.0f} MB"])  # fmt: skip
    print_table(
        f"DCP save, {len(next(iter(results.values())))} round(s) in fresh processes (medians)",
        ["run", "files", "time", "range", "CPU time", "peak extra RSS", "written"],
        rows,
    )


def _print_small(runs: list[dict[str, Any]]) -> None:
    eager, ours = runs
    if "error" in eager or "error" in ours:
        return
    print_table(
        f"{eager['bytes'] / 1e9:.2f} GB bfloat16 model: eager against deferred",
        ["method", "time", "peak extra RSS"],
        [
            ["eager build + `save_file`", fmt_s(eager["seconds"]), fmt_mb(eager["peak_extra"])],
            ["`meta_init` + `save`", fmt_s(ours["seconds"]), fmt_mb(ours["peak_extra"])],
        ],
    )


if __name__ == "__main__":
    main()
