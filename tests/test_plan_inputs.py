"""place()'s inputs= given as shapes: the dtype each becomes, and the labels of a training plan."""

from __future__ import annotations

import pytest
import torch
import transformers

from jupyter_metainit import meta_init, place

CPU = {"cpu": "1GiB"}
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _vit_classifier(**config):
    config = transformers.ViTConfig(**SMALL, image_size=32, patch_size=8, num_labels=3, **config)
    with meta_init():
        return transformers.ViTForImageClassification(config)


def _bert_classifier(**config):
    config = transformers.BertConfig(**SMALL, vocab_size=100, **config)
    with meta_init():
        return transformers.BertForSequenceClassification(config)


def _whisper(cls, **config):
    config = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=50, vocab_size=100, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **config,
    )  # fmt: skip
    with meta_init():
        return cls(config)


def _first_call(model):
    """The tensors' (shape, dtype) the model's first forward of the plan is called with."""
    seen = []

    def note(module, args, kwargs):
        if not seen:
            named = {**dict(enumerate(args)), **kwargs}
            seen.append({k: (tuple(v.shape), v.dtype) for k, v in named.items()
                         if isinstance(v, torch.Tensor)})  # fmt: skip

    model.register_forward_pre_hook(note, with_kwargs=True)
    return seen


def test_a_float_input_given_by_name_as_a_shape_is_a_float_tensor():
    model = _whisper(transformers.WhisperForAudioClassification)
    seen = _first_call(model)
    place(model, CPU, inputs={"input_features": (2, 16, 100)})
    assert seen[0]["input_features"] == ((2, 16, 100), torch.float32)


def test_a_float_input_given_as_a_shape_takes_the_models_dtype():
    model = _vit_classifier().to(torch.bfloat16)
    seen = _first_call(model)
    place(model, CPU, inputs={"pixel_values": (2, 3, 32, 32)})
    assert seen[0]["pixel_values"] == ((2, 3, 32, 32), torch.bfloat16)


def test_ids_and_attention_masks_given_as_shapes_are_int64():
    model = _bert_classifier()
    seen = _first_call(model)
    place(model, CPU, inputs={"input_ids": (2, 16), "attention_mask": (2, 16),
                              "token_type_ids": (2, 16)})  # fmt: skip
    assert {k: seen[0][k] for k in ("input_ids", "attention_mask", "token_type_ids")} == {
        k: ((2, 16), torch.long) for k in ("input_ids", "attention_mask", "token_type_ids")
    }


def test_an_attention_mask_given_as_a_shape_holds_ones():
    model = _bert_classifier()
    ones = []
    model.register_forward_pre_hook(
        lambda m, a, kw: ones.append(bool(kw["attention_mask"].eq(1).all())), with_kwargs=True
    )
    place(model, CPU, inputs={"input_ids": (2, 16), "attention_mask": (2, 16)})
    assert ones[0] is True


def test_a_positional_shape_is_typed_by_the_forwards_parameter_at_its_place():
    config = transformers.CLIPConfig(
        text_config={**SMALL, "vocab_size": 100}, projection_dim=16,
        vision_config={**SMALL, "image_size": 32, "patch_size": 8},
    )  # fmt: skip
    with meta_init():
        model = transformers.CLIPModel(config)  # starts with an embedding, takes pixels second
    seen = _first_call(model)
    place(model, CPU, inputs=[(2, 16), (2, 3, 32, 32)])
    assert seen[0][0] == ((2, 16), torch.long)
    assert seen[0][1] == ((2, 3, 32, 32), torch.float32)


def test_a_tensor_given_instead_of_a_shape_keeps_its_dtype():
    model = _vit_classifier()
    seen = _first_call(model)
    pixels = torch.empty(2, 3, 32, 32, dtype=torch.float64, device="meta")
    place(model.to(torch.float64), CPU, inputs={"pixel_values": pixels})
    assert seen[0]["pixel_values"] == ((2, 3, 32, 32), torch.float64)


def test_a_shape_and_a_tensor_of_the_dtype_it_stands_for_plan_the_same():
    model = _whisper(transformers.WhisperForAudioClassification)
    by_shape = place(model, CPU, inputs={"input_features": (2, 16, 100)}, training=True)
    features = torch.empty(2, 16, 100, device="meta")
    by_tensor = place(model, CPU, inputs={"input_features": features}, training=True)
    assert by_shape.peak == by_tensor.peak


def test_training_a_sequence_classifier_adds_one_class_id_per_sample():
    model = _bert_classifier(num_labels=3)
    seen = _first_call(model)
    place(model, CPU, batch=2, seq_len=16, training=True)
    assert seen[0]["labels"] == ((2,), torch.long)


def test_training_an_image_classifier_from_a_positional_shape_adds_one_class_id_per_sample():
    model = _vit_classifier()
    seen = _first_call(model)
    place(model, CPU, inputs=[(2, 3, 32, 32)], training=True)
    assert seen[0]["labels"] == ((2,), torch.long)


@pytest.mark.parametrize(
    ("config", "labels"),
    [
        ({"num_labels": 1}, ((2,), torch.float32)),
        ({"num_labels": 3, "problem_type": "regression"}, ((2, 3), torch.float32)),
        ({"num_labels": 3, "problem_type": "multi_label_classification"},
         ((2, 3), torch.float32)),
    ],
    ids=["one_label_regression", "regression", "multi_label"],
)  # fmt: skip
def test_training_a_regression_or_multi_label_head_adds_float_labels(config, labels):
    model = _bert_classifier(**config)
    seen = _first_call(model)
    place(model, CPU, inputs={"input_ids": (2, 16)}, training=True)
    assert seen[0]["labels"] == labels


def test_training_a_language_model_from_keyword_inputs_adds_labels_of_the_ids_shape():
    config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, vocab_size=100)
    with meta_init():
        model = transformers.LlamaForCausalLM(config)
    seen = _first_call(model)
    place(model, CPU, inputs={"input_ids": (2, 16)}, training=True)
    assert seen[0]["labels"] == ((2, 16), torch.long)


def test_training_an_encoder_decoder_adds_labels_of_the_decoder_ids_shape():
    model = _whisper(transformers.WhisperForConditionalGeneration)
    seen = _first_call(model)
    place(model, CPU, inputs={"input_features": (2, 16, 100), "decoder_input_ids": (2, 8)},
          training=True)  # fmt: skip
    assert seen[0]["labels"] == ((2, 8), torch.long)


def test_training_labels_given_in_the_inputs_are_kept():
    model = _bert_classifier(num_labels=1)
    seen = _first_call(model)
    labels = torch.empty(2, dtype=torch.float64, device="meta")
    place(model, CPU, inputs={"input_ids": (2, 16), "labels": labels}, training=True)
    assert seen[0]["labels"] == ((2,), torch.float64)


def test_training_a_model_without_token_ids_or_a_classifier_head_adds_no_labels():
    config = transformers.Wav2Vec2Config(
        **SMALL, vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
    )  # fmt: skip
    with meta_init():
        model = transformers.Wav2Vec2ForCTC(config)  # takes labels, of transcripts' ids
    seen = _first_call(model)
    plan = place(model, CPU, inputs={"input_values": (2, 4000)}, training=True)
    assert "labels" not in seen[0]
    assert plan.peak["cpu"] > 0


def _wav2vec2_classifier(layerdrop):
    config = transformers.Wav2Vec2Config(
        **SMALL, vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=2,
        layerdrop=layerdrop, mask_time_prob=0.0,
    )  # fmt: skip
    with meta_init():
        return transformers.Wav2Vec2ForSequenceClassification(config)


def test_a_training_plan_with_layerdrop_counts_every_layer():
    inputs = {"input_values": (2, 4000)}
    kept = place(_wav2vec2_classifier(0.0), CPU, inputs=inputs, training=True)
    dropping = place(_wav2vec2_classifier(0.99), CPU, inputs=inputs, training=True)
    assert dropping.peak == kept.peak


def test_planning_leaves_the_layerdrop_as_it_was():
    model = _wav2vec2_classifier(0.99)
    place(model, CPU, inputs={"input_values": (2, 4000)}, training=True)
    assert model.config.layerdrop == 0.99


def _measured_training_peak(model, kwargs):
    from torch.distributed._tools.mem_tracker import MemTracker

    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *kwargs.values())
    with tracker:
        for step in range(2):  # the second step: optimizer states exist, as in every later one
            model(**kwargs).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                tracker.reset_mod_stats()
    return max(int(stats["Total"]) for stats in tracker.get_tracker_snapshot("peak").values())


def test_an_image_classifiers_training_plan_is_within_5_percent_of_a_real_step_on_the_cpu():
    from jupyter_metainit import materialize

    model = _vit_classifier()
    predicted = place(model, CPU, inputs={"pixel_values": (4, 3, 32, 32)}, training=True)
    materialize(model)
    real = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.zeros(4, dtype=torch.long)}
    assert predicted.peak["cpu"] == pytest.approx(_measured_training_peak(model, real), rel=0.05)
