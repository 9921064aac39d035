"""Plans of models that take no token ids alone, against real runs on the CPU.

Small transformers models of kinds the attention benchmark does not cover, each planned with
``place(model, {"cpu": ...}, inputs={...})`` (inputs given as shapes, typed by their names:
pixels and audio features float, ids and masks int64; training adds the labels the head takes)
for inference and for one training step, against the peak PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` measures on the real model materialized
from the same deferred one (inputs counted): an eval-mode forward under ``no_grad``, or the
second of two AdamW steps (``bench_attention_plans.measured_peak``). Each measurement runs in
a fresh process.

    .venv/bin/python benchmarks/bench_plan_inputs.py            # full (~5 min on 2 cores)
    .venv/bin/python benchmarks/bench_plan_inputs.py --quick    # smoke run, smaller inputs
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

MODELS = ("vit_classifier", "bert_classifier", "whisper_audio_classifier", "whisper_seq2seq",
          "clip", "wav2vec2_classifier")  # fmt: skip
SIZES = {"batch": 4, "seq": 128, "image": 64, "frames": 400, "samples": 16000}
QUICK_SIZES = {"batch": 2, "seq": 32, "image": 32, "frames": 100, "samples": 4000}


def _model(kind: str, sizes: dict[str, int]) -> Any:
    """The deferred model (built under meta_init, float32, eager's seed)."""
    import torch
    import transformers

    from jupyter_metainit import meta_init

    small = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4}  # fmt: skip
    whisper = {"d_model": 128, "encoder_layers": 2, "decoder_layers": 2,
               "encoder_attention_heads": 4, "decoder_attention_heads": 4,
               "encoder_ffn_dim": 256, "decoder_ffn_dim": 256, "num_mel_bins": 80,
               "max_source_positions": sizes["frames"] // 2, "vocab_size": 1000,
               "max_target_positions": 64, "pad_token_id": 0, "bos_token_id": 1,
               "eos_token_id": 2, "decoder_start_token_id": 1}  # fmt: skip
    builds = {
        "vit_classifier": ("ViTForImageClassification", "ViTConfig",
                           {**small, "image_size": sizes["image"], "patch_size": 8,
                            "num_labels": 10}),
        "bert_classifier": ("BertForSequenceClassification", "BertConfig",
                            {**small, "vocab_size": 1000, "num_labels": 3}),
        "whisper_audio_classifier": ("WhisperForAudioClassification", "WhisperConfig",
                                     {**whisper, "num_labels": 5}),
        "whisper_seq2seq": ("WhisperForConditionalGeneration", "WhisperConfig", whisper),
        "clip": ("CLIPModel", "CLIPConfig", {
            "text_config": {**small, "vocab_size": 1000,
                            "max_position_embeddings": sizes["seq"]},
            "vision_config": {**small, "image_size": sizes["image"], "patch_size": 8},
            "projection_dim": 64}),
        "wav2vec2_classifier": ("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", {
            **small, "vocab_size": 32, "num_labels": 4, "conv_dim": (32, 32, 32),
            "conv_stride": (5, 4, 4), "conv_kernel": (10, 4, 4),
            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4}),
    }  # fmt: skip
    cls_name, config_name, options = builds[kind]
    config = getattr(transformers, config_name)(**options)
    cls = getattr(transformers, cls_name)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with meta_init():
        return cls(config)


def _workload(kind: str, training: bool, sizes: dict[str, int]) -> tuple[dict, dict]:
    """place()'s ``inputs=`` (shapes only), and the real call's keyword inputs."""
    import torch

    batch, seq, image = sizes["batch"], sizes["seq"], sizes["image"]
    if kind == "vit_classifier":
        shapes = {"pixel_values": (batch, 3, image, image)}
        real = {"pixel_values": torch.randn(batch, 3, image, image)}
        labels = torch.zeros(batch, dtype=torch.long)
    elif kind == "bert_classifier":
        shapes = {"input_ids": (batch, seq), "attention_mask": (batch, seq)}
        real = {"input_ids": torch.randint(0, 1000, (batch, seq)),
                "attention_mask": torch.ones(batch, seq, dtype=torch.long)}  # fmt: skip
        labels = torch.zeros(batch, dtype=torch.long)
    elif kind in ("whisper_audio_classifier", "whisper_seq2seq"):
        shapes = {"input_features": (batch, 80, sizes["frames"])}
        real = {"input_features": torch.randn(batch, 80, sizes["frames"])}
        labels = torch.zeros(batch, dtype=torch.long)
        if kind == "whisper_seq2seq":
            shapes["decoder_input_ids"] = (batch, 16)
            real["decoder_input_ids"] = torch.randint(0, 1000, (batch, 16))
            labels = torch.randint(0, 1000, (batch, 16))
    elif kind == "clip":
        shapes = {"input_ids": (batch, seq), "pixel_values": (batch, 3, image, image),
                  "attention_mask": (batch, seq)}  # fmt: skip
        real = {"input_ids": torch.randint(0, 1000, (batch, seq)),
                "pixel_values": torch.randn(batch, 3, image, image),
                "attention_mask": torch.ones(batch, seq, dtype=torch.long)}  # fmt: skip
        labels = None
        if training:  # CLIP's loss is contrastive: no labels, asked for by return_loss
            shapes["return_loss"] = real["return_loss"] = True
    else:
        shapes = {"input_values": (batch, sizes["samples"])}
        real = {"input_values": torch.randn(batch, sizes["samples"])}
        labels = torch.zeros(batch, dtype=torch.long)
    if training and labels is not None:
        real["labels"] = labels
    return shapes, real


def plan_row(kind: str, training: bool, sizes: dict[str, int]) -> dict:
    """One row: the plan's peak on one CPU device and MemTracker's on the real model."""
    from bench_attention_plans import measured_peak

    from jupyter_metainit import materialize, place

    model = _model(kind, sizes)
    shapes, real = _workload(kind, training, sizes)
    if not training:
        model.eval()
    plan = place(model, {"cpu": "64GiB"}, inputs=shapes, training=training)
    materialize(model)
    _frozen_as_buffers(model)
    if not training and "use_cache" in model.forward.__code__.co_varnames:
        real["use_cache"] = True  # what the plan measured: inference with the model's cache
    return {"predicted": plan.peak["cpu"], "measured": measured_peak(model, (), real, training),
            "notes": plan.notes}  # fmt: skip


def _frozen_as_buffers(model: Any) -> None:
    """MemTracker hooks every parameter's gradient and fails on a frozen one (Whisper's
    positions): hold those as buffers, the same bytes, which no optimizer sees either way."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad:
                del module._parameters[name]
                module.register_buffer(name, param.data)


MEASUREMENTS = {"plan_row": plan_row}


def main() -> None:
    child_main(MEASUREMENTS)
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    sizes = dict(QUICK_SIZES if args.quick else SIZES)
    print("# bench_plan_inputs: place(inputs=...) against MemTracker on the CPU")
    print(f"{environment_line()}; inputs {sizes}")
    cases = [(kind, training) for kind in MODELS for training in (False, True)]
    jobs = [("plan_row", {"kind": k, "training": t, "sizes": sizes}) for k, t in cases]
    results = run_children(__file__, jobs, separate=not args.quick)
    named, rows = {}, []
    for (kind, training), r in zip(cases, results, strict=True):
        mode = "training" if training else "inference"
        named[f"{kind} {mode}"] = r
        if "error" in r:
            rows.append([kind, mode, "n/a", "n/a", "n/a"])
            continue
        rows.append([kind, mode, fmt_mb(r["predicted"]), fmt_mb(r["measured"]),
                     f"{r['predicted'] / r['measured']:.3f}"])  # fmt: skip
    print_table(
        "Predicted (place, one CPU device, inputs as shapes) against MemTracker",
        ["model", "mode", "place", "measured (MemTracker)", "place / measured"],
        rows,
    )
    print_errors(named)


if __name__ == "__main__":
    main()
