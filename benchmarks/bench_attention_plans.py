"""Plans against real runs on the CPU, per model, attention implementation and mode.

Two tables, each measurement in a fresh process:

1. GPT-2, GPT-BigCode, Llama, T5 and ViT (transformers, small configs) x ``eager`` / ``sdpa``
   attention x inference / training: the peak ``place`` predicts on one CPU device, what
   ``dry_run`` says of the same inference (the model in eval mode), and the peak PyTorch's
   ``torch.distributed._tools.mem_tracker.MemTracker`` measures on the real model materialized
   from the same deferred one (inputs counted): an eval-mode forward under ``no_grad`` with the
   cache, or the second of two AdamW steps (the optimizer states exist then, as in every
   later step). ``kernel``: how the plan costed SDPA (the CPU's flash kernel, "fused", or its
   math kernel, which holds the [batch, heads, queries, keys] scores: the CPU takes no dropout
   in its flash kernel, so training with attention dropout runs math).
2. The case of issue 33: GPT-BigCode, batch 8 x 1024, ``sdpa``, 300 MiB: the inference plan,
   ``dry_run`` in eval and in training mode, and the real forward in both modes (in training
   mode dropout runs, and with it the math kernel).

    .venv/bin/python benchmarks/bench_attention_plans.py            # full (~2 min on 2 cores)
    .venv/bin/python benchmarks/bench_attention_plans.py --quick    # smoke run, smaller inputs
"""

from __future__ import annotations

from typing import Any

from _common import (
    base_parser,
    child_main,
    environment_line,
    fmt_mb,
    print_errors,
    print_table,
    run_children,
)

MODELS = ("gpt2", "gpt_bigcode", "llama", "t5", "vit")
CLASSES = {"gpt2": "GPT2LMHeadModel", "gpt_bigcode": "GPTBigCodeForCausalLM",
           "llama": "LlamaForCausalLM", "t5": "T5ForConditionalGeneration",
           "vit": "ViTForImageClassification"}  # fmt: skip
SIZES = {"batch": 4, "seq": 256, "decoded": 64, "image": 64}
QUICK_SIZES = {"batch": 2, "seq": 64, "decoded": 16, "image": 32}


def _config(kind: str, attn: str, seq: int, image: int) -> Any:
    import transformers

    small = {"vocab_size": 1000}
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=seq,
                                         **small)  # fmt: skip
    elif kind == "gpt_bigcode":
        config = transformers.GPTBigCodeConfig(n_embd=128, n_layer=2, n_head=4, n_positions=seq,
                                               **small)  # fmt: skip
    elif kind == "llama":
        config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, **small)  # fmt: skip
    elif kind == "t5":
        config = transformers.T5Config(d_model=128, d_ff=256, num_layers=2, num_heads=4,
                                       d_kv=32, decoder_start_token_id=0, pad_token_id=0,
                                       **small)  # fmt: skip
    else:
        config = transformers.ViTConfig(hidden_size=128, intermediate_size=512,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        image_size=image, patch_size=8)  # fmt: skip
    config._attn_implementation = attn
    return config


def _deferred(kind: str, config: Any) -> Any:
    import torch
    import transformers

    from jupyter_metainit import meta_init

    torch.manual_seed(0)
    with meta_init():
        return getattr(transformers, CLASSES[kind])(config)


def _workload(kind: str, training: bool, sizes: dict[str, int]) -> tuple[dict, tuple, dict]:
    """place()'s workload arguments, and the real call's positional and keyword inputs."""
    import torch

    batch, seq, decoded, image = (sizes[k] for k in ("batch", "seq", "decoded", "image"))
    ids = torch.randint(0, 1000, (batch, seq))
    if kind == "t5":
        second = "labels" if training else "decoder_input_ids"
        real = {"input_ids": ids, second: torch.randint(0, 1000, (batch, decoded))}
        real |= {} if training else {"use_cache": True}
        return {"inputs": {"input_ids": (batch, seq), second: (batch, decoded)}}, (), real
    if kind == "vit":
        pixels = torch.randn(batch, 3, image, image)
        if training:
            shapes = {"pixel_values": torch.zeros(()).expand(pixels.shape), "labels": (batch,)}
            labels = torch.zeros(batch, dtype=torch.long)
            return {"inputs": shapes}, (), {"pixel_values": pixels, "labels": labels}
        return {"inputs": [tuple(pixels.shape)]}, (pixels,), {}
    real = {"labels": ids} if training else {"use_cache": True}
    return {"batch": batch, "seq_len": seq}, (ids,), real


def measured_peak(model: Any, args: tuple, kwargs: dict, training: bool,
                  mode: bool | None = None) -> int:  # fmt: skip
    """MemTracker's peak: a forward under ``no_grad`` (in eval mode, or ``mode``), or the
    second of two AdamW steps; the inputs counted."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not training:
        model.train(bool(mode))
        tracker.track_external(model, *inputs)
        with tracker, torch.no_grad():
            model(*args, **kwargs)
    else:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.track_external(model, optimizer, *inputs)
        with tracker:
            for step in range(2):
                model(*args, **kwargs).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
    return max(int(stats["Total"]) for stats in tracker.get_tracker_snapshot("peak").values())


def _kernel(model: Any) -> str:
    from jupyter_metainit.estimates.memory import DRY_RUN_ATTR

    record = model.__dict__[DRY_RUN_ATTR]["run"]["attention"]
    kinds = [k for k in ("fused", "math") if record[k]]
    return " + ".join(f"{k} x{record[k]}" for k in kinds) or "none (eager)"


def attention_row(kind: str, attn: str, training: bool, sizes: dict[str, int]) -> dict:
    """One row of table 1."""
    from jupyter_metainit import dry_run, materialize, place

    model = _deferred(kind, _config(kind, attn, sizes["seq"], sizes["image"]))
    workload, args, kwargs = _workload(kind, training, sizes)
    plan = place(model, {"cpu": "64GiB"}, training=training, **workload)
    row: dict[str, Any] = {"predicted": plan.peak["cpu"], "kernel": _kernel(model),
                           "notes": plan.notes}  # fmt: skip
    if not training:
        shapes = [tuple(a.shape) if a.is_floating_point() else a for a in args]
        table = dry_run(model.eval(), *shapes, **kwargs, flops=False)
        row["dry_run"] = int(table.loc["", "peak_forward_bytes"])
    materialize(model)
    row["measured"] = measured_peak(model, args, kwargs, training)
    return row


def issue_case(batch: int, seq: int) -> dict:
    """Table 2: GPT-BigCode (n_embd 256, 2 layers, 8 heads), sdpa, 300 MiB."""
    import torch
    import transformers

    from jupyter_metainit import dry_run, materialize, meta_init, place

    config = transformers.GPTBigCodeConfig(n_embd=256, n_layer=2, n_head=8, vocab_size=1000,
                                           n_positions=seq)  # fmt: skip
    torch.manual_seed(0)
    with meta_init():
        model = transformers.GPTBigCodeForCausalLM(config)
    plan = place(model, {"cpu": "300MiB"}, batch=batch, seq_len=seq)
    result = {"predicted": plan.peak["cpu"], "fits": plan.fits, "notes": plan.notes}
    for mode in ("eval", "train"):
        table = dry_run(model.train(mode == "train"), (batch, seq), use_cache=True, flops=False)
        result[f"dry_run_{mode}"] = int(table.loc["", "peak_forward_bytes"])
    materialize(model)
    ids = torch.randint(0, 1000, (batch, seq))
    for mode in ("eval", "train"):
        result[f"measured_{mode}"] = measured_peak(model, (ids,), {"use_cache": True}, False,
                                                   mode=mode == "train")  # fmt: skip
    return result


MEASUREMENTS = {"attention_row": attention_row, "issue_case": issue_case}


def _ratio(a: int | None, b: int | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.3f}"


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    sizes = dict(QUICK_SIZES if args.quick else SIZES)
    issue = (2, 256) if args.quick else (8, 1024)
    print("# bench_attention_plans: place() and dry_run() against MemTracker on the CPU")
    print(f"{environment_line()}; inputs {sizes}")
    cases = [(kind, attn, training) for kind in MODELS for attn in ("eager", "sdpa")
             for training in (False, True)]  # fmt: skip
    jobs = [("attention_row", {"kind": k, "attn": a, "training": t, "sizes": sizes})
            for k, a, t in cases]  # fmt: skip
    jobs.append(("issue_case", {"batch": issue[0], "seq": issue[1]}))
    results = run_children(__file__, jobs, separate=not args.quick)
    named, rows = {}, []
    for (kind, attn, training), r in zip(cases, results[:-1], strict=True):
        mode = "training" if training else "inference"
        named[f"{kind} {attn} {mode}"] = r
        if "error" in r:
            rows.append([kind, attn, mode, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"])
            continue
        rows.append([kind, attn, mode, r["kernel"], fmt_mb(r["predicted"]),
                     fmt_mb(r.get("dry_run")), fmt_mb(r["measured"]),
                     _ratio(r["predicted"], r["measured"]),
                     _ratio(r["predicted"], r.get("dry_run"))])  # fmt: skip
    print_table(
        "Predicted (place, one CPU device) against dry_run and MemTracker, per model, "
        "attention implementation and mode",
        ["model", "attn_implementation", "mode", "SDPA costed as", "place", "dry_run",
         "measured (MemTracker)", "place / measured", "place / dry_run"],
        rows,
    )  # fmt: skip
    r = results[-1]
    named["issue 33 case"] = r
    if "error" not in r:
        print_table(
            f"Issue 33: GPT-BigCode, batch {issue[0]} x {issue[1]}, sdpa, on the CPU",
            ["", "eval mode (model.eval())", "training mode (dropout on)"],
            [
                ["place (inference, 300 MiB)",
                 f"{fmt_mb(r['predicted'])}, {'fits' if r['fits'] else 'does not fit'}",
                 "a note: the plan is for model.eval()" if r["notes"] else "no note"],
                ["dry_run", fmt_mb(r["dry_run_eval"]), fmt_mb(r["dry_run_train"])],
                ["measured forward (MemTracker)", fmt_mb(r["measured_eval"]),
                 fmt_mb(r["measured_train"])],
            ],
        )  # fmt: skip
    print_errors(named)


if __name__ == "__main__":
    main()
