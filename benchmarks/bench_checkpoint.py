"""Opening checkpoints without memory: ``from_pretrained`` inside ``meta_init``.

1. A Llama-3-70B-shaped checkpoint (bfloat16, 141 GB in 28 safetensors shards) written as sparse
   files (real headers, data as holes: no disk): open it with ``from_pretrained`` inside
   ``meta_init``, then materialize one decoder layer. Targets: opening in at most 2 s and 100 MB
   more resident memory; the layer, each weight read once, reads about its own bytes from the
   files (at most 1.1x, from ``rchar`` in ``/proc/self/io``, which mapped pages do not count) and
   holds at most 1.05x its bytes + 100 MB.
2. A checkpoint that fits (a 0.5 B Llama in bfloat16, written for real), loaded whole: eager
   ``from_pretrained``, ``accelerate``'s ``init_empty_weights`` + ``load_checkpoint_and_dispatch``,
   and ``meta_init`` + ``from_pretrained`` + ``materialize``, then every weight read once; fresh
   processes, the methods alternating, imports done before the measurement.
3. What checking the bytes read costs (a sum of their 64-bit words, compared with earlier reads of
   them: ``_files.CHECK_CONTENT``; mapped bytes are digested only once a free compared them with
   the file): the whole model freed and materialized again, its files in the page cache, with and
   without the check, alternating in one process.

``--before DIR`` adds a row to table 2: ``meta_init`` from another checkout of this project
(e.g. the commit before a change), alternating with the others in the same run.

    .venv/bin/python benchmarks/bench_checkpoint.py            # ~2 min, 1 GB of disk
    .venv/bin/python benchmarks/bench_checkpoint.py --quick    # smoke run, tiny model
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from _common import (
    LLAMA_70B,
    Meter,
    MiB,
    base_parser,
    bytes_read,
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
    tensor_bytes,
    verdict,
    write_sparse_checkpoint,
)

FITS = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip


def write(kind: str, directory: str, quick: bool) -> dict[str, Any]:
    """Write the checkpoint for the measurements below (in a child: it imports torch)."""
    import torch
    import transformers

    shape = TINY if quick else (LLAMA_70B if kind == "sparse" else FITS)
    cfg = llama_config(**shape, dtype="bfloat16")
    if kind == "sparse":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        total = write_sparse_checkpoint(model, directory)
    else:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(directory)
        total = tensor_bytes(model)
    return {"bytes": total, "shards": len([f for f in os.listdir(directory) if "safet" in f])}


def open_and_layer(directory: str, layer: int) -> dict[str, Any]:
    """Open under meta_init, then materialize one decoder layer."""
    import transformers

    jmi = load_core()
    with jmi.meta_init():  # warm-up: imports of the modeling code, first-call caches
        transformers.LlamaForCausalLM(llama_config(**TINY))
    opening = Meter()
    with opening(), jmi.meta_init():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    out = {"open": opening.as_dict(), "deferred": bool(jmi.is_deferred(model))}
    target = model.model.layers[layer]
    out["layer_bytes"] = tensor_bytes(target)
    before = bytes_read()
    meter = Meter()
    with meter():
        jmi.materialize(target)
        for p in target.parameters():  # mapped pages are read when first used
            p.sum()
    out["layer"] = meter.as_dict() | {"read": bytes_read() - before}
    return out


def load_whole(directory: str, method: str, checkout: str | None = None) -> dict[str, Any]:
    """Load the whole checkpoint, then read every weight once. Imports come first, outside the
    measurement, for every method (as in a notebook, where they ran in an earlier cell):
    importing the modeling code alone takes seconds here and would hide what loading costs.
    ``checkout``: another checkout of this project whose ``jupyter_metainit`` is used
    (``--before``)."""
    import importlib
    import sys

    if checkout is not None:
        sys.path.insert(0, checkout)

    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    importlib.import_module(type(config).__module__.replace("configuration_", "modeling_"))
    if method == "accelerate":
        import accelerate  # noqa: F401
    elif method == "meta_init":
        load_core()
    meter = Meter()
    with meter():
        if method == "eager":
            model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        elif method in ("eager_sync", "eager_seen"):
            # What meta_init changes around eager loading, without recording: the tensors are
            # read in the calling thread (as inside the block), and (``eager_seen``) every torch
            # call is seen once by a Python torch-function mode that only passes it on.
            seen = _pass_through() if method == "eager_seen" else contextlib.nullcontext()
            with _environment(HF_DEACTIVATE_ASYNC_LOAD="1"), seen:
                model = transformers.AutoModelForCausalLM.from_pretrained(directory)
        elif method == "accelerate":
            from accelerate import init_empty_weights, load_checkpoint_and_dispatch

            config = transformers.AutoConfig.from_pretrained(directory)
            with init_empty_weights():
                model = transformers.AutoModelForCausalLM.from_config(config)
            model = load_checkpoint_and_dispatch(
                model, directory, device_map={"": "cpu"}, dtype=torch.bfloat16
            )
        else:
            jmi = load_core()
            with jmi.meta_init():
                model = transformers.AutoModelForCausalLM.from_pretrained(directory)
            jmi.materialize(model)
        meter.lap("loaded")
        # Read every weight once: the eager loaders map the files and read pages on first use.
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
    return meter.as_dict() | {"bytes": tensor_bytes(model)}


@contextlib.contextmanager
def _environment(**values: str) -> Any:
    """Environment variables set for the block, as they were after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pass_through() -> Any:
    """A torch-function mode that sees every torch call in Python and passes it on unchanged:
    the least any recorder written in Python pays per call."""
    from torch.overrides import TorchFunctionMode

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return PassThrough()


def content_check(directory: str, rounds: int) -> dict[str, Any]:
    """Materialize the whole model again after freeing it, its files warm, with and without the
    content check (freeing compared every tensor with its file and took the digests)."""
    import time

    import transformers

    from jupyter_metainit.core.record import files as _files

    jmi = load_core()
    times: dict[str, list[float]] = {"with": [], "without": []}
    with jmi.meta_init():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    jmi.materialize(model, keep_cache=True)  # warms the page cache
    try:
        for i in range(2 * rounds):
            mode = "with" if i % 2 else "without"
            jmi.dematerialize(model)
            _files.CHECK_CONTENT = mode == "with"
            start = time.perf_counter()
            jmi.materialize(model, keep_cache=True)
            times[mode].append(time.perf_counter() - start)
            _files.CHECK_CONTENT = True
    finally:
        _files.CHECK_CONTENT = True
    nbytes = tensor_bytes(model)
    return {"bytes": nbytes, **{k: sorted(v)[len(v) // 2] for k, v in times.items()}}


MEASUREMENTS = {
    "write": write,
    "open_and_layer": open_and_layer,
    "load_whole": load_whole,
    "content_check": content_check,
}
METHODS = {
    "eager": "eager `from_pretrained`",
    "eager_sync": "eager `from_pretrained`, tensors read in the calling thread",
    "eager_seen": "the same, every torch call seen by a pass-through Python mode",
    "accelerate": "`init_empty_weights` + `load_checkpoint_and_dispatch`",
    "meta_init": "`meta_init` + `from_pretrained` + `materialize`",
}


def main() -> None:
    child_main(MEASUREMENTS)
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="DIR", help="another checkout: its meta_init row too")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    print("# bench_checkpoint: opening checkpoints without memory")
    print(f"{environment_line()}; {repeats} fresh process(es) per measurement")
    root = tempfile.mkdtemp(prefix="jmi-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        sparse, fits = os.path.join(root, "sparse"), os.path.join(root, "fits")
        os.makedirs(sparse)
        os.makedirs(fits)
        made = run_children(__file__, [("write", {"kind": "sparse", "directory": sparse,
                                                  "quick": args.quick}),
                                       ("write", {"kind": "fits", "directory": fits,
                                                  "quick": args.quick})])  # fmt: skip
        print_errors({"writing the sparse checkpoint": made[0], "writing the real one": made[1]})
        if "error" in made[0] or "error" in made[1]:
            return
        layer = 1 if args.quick else 40
        results = run_children(
            __file__,
            [("open_and_layer", {"directory": sparse, "layer": layer})] * repeats,
            separate=not args.quick,
        )
        r = median_result([x | {"seconds": x["open"]["seconds"]} if "open" in x else x
                           for x in results])  # fmt: skip
        print_errors({"open and materialize a layer": r})
        if "error" not in r:
            lb, opened, lay = r["layer_bytes"], r["open"], r["layer"]
            print_table(
                f"Sparse {made[0]['bytes'] / 2**30:.0f} GiB checkpoint in {made[0]['shards']} "
                f"shards (median of fresh processes)",
                ["step", "time", "extra RSS (peak)", "bytes read", "read / layer", "peak / layer"],
                [
                    ["open with from_pretrained in meta_init", fmt_s(opened["seconds"]),
                     fmt_mb(opened["peak_extra"]), "", "", ""],
                    [f"materialize layer {layer} ({fmt_mb(lb)}), read each weight once",
                     fmt_s(lay["seconds"]),
                     fmt_mb(lay["peak_extra"]), fmt_mb(lay["read"]), fmt_ratio(lay["read"] / lb),
                     fmt_ratio(lay["peak_extra"] / lb)],
                ],
            )  # fmt: skip
            print(f"model reports deferred: {r['deferred']}")
            print(
                f"target open <= 2 s and < 100 MB: "
                f"{verdict(opened['seconds'] <= 2 and opened['peak_extra'] < 100 * MiB)}"
            )
            ok_layer = lay["read"] <= 1.1 * lb and lay["peak_extra"] <= 1.05 * lb + 100 * MiB
            print(f"target layer read <= 1.1x and peak <= 1.05x + 100 MB: {verdict(ok_layer)}")
        # Alternating methods, one fresh process each: a busy machine's slow spells fall on all.
        methods = dict(METHODS)
        if args.before and not args.quick:  # (--quick runs all in one process: no second copy)
            methods["before"] = f"{METHODS['meta_init']}, before ({args.before})"
        jobs = [("load_whole", {"directory": fits, "method": m} if m != "before" else
                 {"directory": fits, "method": "meta_init", "checkout": args.before})
                for _ in range(repeats) for m in methods]  # fmt: skip
        whole = run_children(__file__, jobs, separate=not args.quick)
        by = {m: median_result(whole[i :: len(methods)]) for i, m in enumerate(methods)}
        ref = by["eager"]
        rows = []
        for m, label in methods.items():
            x = by[m]
            if "error" in x:
                rows.append([label, "n/a", "n/a", "n/a", "n/a"])
                continue
            ratio = fmt_ratio(x["seconds"] / ref["seconds"]) if "error" not in ref else "n/a"
            peak = x["peak_extra"]
            loaded = fmt_s(x["laps"]["loaded"])
            per_byte = fmt_ratio(peak / x["bytes"])
            rows.append([label, loaded, fmt_s(x["seconds"]), ratio, fmt_mb(peak), per_byte])
        print_table(
            f"Whole checkpoint that fits ({made[1]['bytes'] / 2**30:.2f} GiB, bfloat16): load, "
            "then read every weight once",
            ["method", "loaded", "loaded + read", "vs eager", "peak extra RSS", "peak / bytes"],
            rows,
        )
        print(
            "(every method maps the files and reads the pages when first used: materialize "
            "digests mapped bytes only after a free; the sparse table's 'bytes read' counts "
            "read() calls, which mapped tensors do not make)"
        )
        print_errors({methods[m]: x for m, x in by.items()})
        check = run_children(
            __file__, [("content_check", {"directory": fits, "rounds": 1 if args.quick else 3})]
        )[0]
        print_errors({"content check": check})
        if "error" not in check:
            gib = check["bytes"] / 2**30
            print_table(
                f"Materializing the whole checkpoint again after dematerialize ({gib:.2f} GiB, "
                "files in the page cache) with and without the check of the bytes read (median "
                "of alternating runs)",
                ["materialize(model)", "time", "GiB/s", "vs without"],
                [
                    [f"{mode} the content check", fmt_s(check[mode]), f"{gib / check[mode]:.2f}",
                     fmt_ratio(check[mode] / check["without"])]
                    for mode in ("without", "with")
                ],
            )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
