"""place(): a placement plan from a deferred model, its workload and the devices' capacities."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, meta_init, place
from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.plan.partition import Costs, Load, partition, partition_by_dp
from tests._models import llama_config

transformers = pytest.importorskip("transformers")

MiB = 1 << 20
FOUR = {f"cuda:{i}": 8 * MiB for i in range(4)}


def _llama(**overrides):
    torch.manual_seed(0)
    with meta_init():
        return transformers.LlamaForCausalLM(llama_config(num_hidden_layers=6, **overrides))


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def plan(llama):
    return place(llama, FOUR, batch=2, seq_len=32)


def _device_of(device_map, name):
    """The device a tensor name goes to, and how many map entries cover it."""
    covering = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
    return [device_map[k] for k in covering]


def test_the_device_map_covers_every_parameter_and_buffer_exactly_once(llama, plan):
    names = [n for n, _ in llama.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in llama.named_buffers(remove_duplicate=False)]
    for name in names:
        assert len(_device_of(plan.device_map, name)) == 1, name


def test_accelerate_accepts_the_device_map(llama, plan):
    from accelerate.utils import check_device_map

    check_device_map(llama, plan.device_map)


def test_dispatch_model_runs_a_real_model_on_a_plans_map():
    from accelerate import dispatch_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=4))
    plan = place(model, FOUR, batch=1, seq_len=8)
    ids = torch.randint(0, 1000, (1, 8))
    expected = model(ids).logits
    cpu_map = {name: "cpu" for name in plan.device_map}  # this machine's stand-in for the GPUs
    assert len(cpu_map) > 1
    dispatched = dispatch_model(model, device_map=cpu_map)
    assert torch.equal(dispatched(ids).logits, expected)


def test_from_pretrained_loads_with_a_plans_map(tmp_path):
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=4))
    saved.save_pretrained(tmp_path)
    plan = place(saved, FOUR, batch=1, seq_len=8)
    cpu_map = {name: "cpu" for name in plan.device_map}
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, device_map=cpu_map)
    for name, value in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_repeated_blocks_are_never_split_across_devices(llama, plan):
    for i in range(6):
        block = f"model.layers.{i}"
        devices = {d for n, _ in llama.model.layers[i].named_parameters()
                   for d in _device_of(plan.device_map, f"{block}.{n}")}  # fmt: skip
        assert len(devices) == 1, block


def test_the_blocks_are_spread_over_the_devices_in_order(plan):
    order = [int(d.split(":")[1]) for n, _, d, _ in plan.parts if n.startswith("model.layers.")]
    assert order == sorted(order) and len(set(order)) > 1


def test_tied_embedding_and_lm_head_share_a_device():
    model = _llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = place(model, FOUR, batch=2, seq_len=32)
    assert _device_of(plan.device_map, "lm_head.weight") == _device_of(
        plan.device_map, "model.embed_tokens.weight"
    )


def test_the_tied_weight_counts_once_in_the_peak():
    tied, untied = _llama(tie_word_embeddings=True), _llama()
    one = {"cpu": "1GiB"}
    difference = place(untied, one, seq_len=8).peak["cpu"] - place(tied, one, seq_len=8).peak["cpu"]
    assert difference == untied.lm_head.weight.numel() * 4


def test_planning_twice_gives_the_same_plan(llama, plan):
    again = place(llama, FOUR, batch=2, seq_len=32)
    assert again.device_map == plan.device_map and again.peak == plan.peak


def test_planning_leaves_the_model_deferred(llama, plan):
    assert is_deferred(llama)


def test_the_partition_minimises_the_most_loaded_device_as_an_exhaustive_search_does():
    rng = random.Random(0)
    for training in (False, True):
        for _ in range(30):
            costs = [Costs(weights=rng.randint(1, 100), cache=rng.randint(0, 20),
                           transient=rng.randint(0, 50), grads=rng.randint(0, 30),
                           states=rng.randint(0, 60), saved=rng.randint(0, 40))
                     for _ in range(rng.randint(1, 12))]  # fmt: skip
            capacities = [rng.randint(100, 400) for _ in range(rng.randint(1, 4))]
            start = [Load(training) for _ in capacities]
            _, ours = partition(costs, capacities, start)
            assert ours == pytest.approx(partition_by_dp(costs, capacities, start), rel=1e-9)


def test_equal_blocks_on_equal_devices_are_balanced(plan):
    assert plan.balance <= 1.05 * 4 / 3  # 6 blocks + ends over 4 devices: at best 2-2-1-1 + ends


def test_a_pinned_part_goes_to_its_device_and_the_rest_is_planned_around_it(llama):
    plan = place(llama, FOUR, batch=2, seq_len=32, pin={"lm_head": "cuda:0"})
    assert _device_of(plan.device_map, "lm_head.weight") == ["cuda:0"]
    assert plan.fits


def test_the_kv_cache_is_measured_from_the_models_own_cache(llama):
    plan = place(llama, {"cpu": "1GiB"}, batch=2, seq_len=32)
    config = llama.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * 2 * config.num_key_value_heads * 32 * head_dim * 4  # keys + values, fp32
    caches = {name: costs.cache for name, _, _, costs in plan.parts}
    assert all(caches[f"model.layers.{i}"] == per_layer for i in range(6))


def test_training_counts_gradients_and_adamw_states_in_the_parameters_dtype(llama):
    plan = place(llama, {"cpu": "1GiB"}, batch=2, seq_len=32, training=True)
    layer = {name: costs for name, _, _, costs in plan.parts}["model.layers.0"]
    params = sum(p.numel() for p in llama.model.layers[0].parameters())
    assert (layer.weights, layer.grads, layer.states) == (4 * params, 4 * params, 8 * params)


def test_bf16_with_fp32_master_weights_stores_16_bytes_per_parameter_with_adamw(llama):
    plan = place(llama, {"cpu": "1GiB"}, seq_len=8, training=True, precision="bf16-master")
    layer = {name: costs for name, _, _, costs in plan.parts}["model.layers.0"]
    params = sum(p.numel() for p in llama.model.layers[0].parameters())
    assert layer.weights + layer.grads + layer.states == 16 * params


def test_a_plan_that_does_not_fit_says_by_how_much_and_what_would_fit(llama):
    plan = place(llama, {"cuda:0": MiB}, batch=2, seq_len=32)
    assert not plan.fits
    assert plan.over["cuda:0"] == plan.peak["cuda:0"] - MiB
    assert any("devices of" in a for a in plan.advice)
    assert "DOES NOT FIT" in repr(plan)


def test_the_table_has_a_peak_row_per_device_and_a_row_per_part(llama, plan):
    table = plan.table
    assert list(table.xs("(peak)", level="part")["peak"]) == list(plan.peak.values())
    assert len(table) == len(plan.parts) + len(plan.peak)


def test_fsdp_shards_the_repeated_blocks_and_the_root(llama):
    plan = place(llama, {"cuda:0": "1GiB"}, seq_len=32, training=True, strategy="fsdp",
                 world_size=4)  # fmt: skip
    assert plan.units == [f"model.layers.{i}" for i in range(6)] + [""]


def test_fsdp_needs_less_per_rank_with_more_ranks(llama):
    peaks = [place(llama, {"cuda:0": "1GiB"}, seq_len=32, training=True, strategy="fsdp",
                   world_size=n).peak["cuda:0"] for n in (1, 2, 8)]  # fmt: skip
    assert peaks[0] > peaks[1] > peaks[2]


def test_auto_devices_read_the_free_memory():
    plan = place(nn.Linear(4, 4), "auto", inputs=[(2, 4)])
    assert "cpu" in plan.capacity and plan.capacity["cpu"] > 0


@pytest.mark.parametrize(
    ("devices", "pin", "words"),
    [
        ({"gpu0": "1GiB"}, None, "unknown device 'gpu0'"),
        ({"cuda:0": "lots"}, None, "cannot read the capacity"),
        ({"cuda:0": "1GiB"}, {"lm_head": "cuda:1"}, "cuda:1 is not in devices="),
        ({"cuda:0": "1GiB", "cuda:1": 1000}, {"lm_head": "cuda:1"}, "pinned 'lm_head' need"),
        ({"cuda:0": "1GiB"}, {"model.layers.0.mlp": "cuda:0"}, "lies inside 'model.layers.0'"),
        ({"cuda:0": "1GiB"}, {"nowhere": "cuda:0"}, "has no module 'nowhere'"),
    ],
)
def test_a_mistake_is_a_clear_error_that_says_what_to_do(llama, devices, pin, words):
    with pytest.raises(ValueError, match=words):
        place(llama, devices, batch=2, seq_len=32, pin=pin)


def test_a_missing_workload_says_to_give_seq_len_or_inputs(llama):
    with pytest.raises(ValueError, match="seq_len="):
        place(llama, FOUR)


@pytest.mark.parametrize("pin", [["0"], "cpu", 3, {"lm_head": 1.5}, {0: "cuda:0"}],
                         ids=["list", "device", "int", "float-device", "int-name"])  # fmt: skip
def test_a_pin_of_the_wrong_type_is_a_type_error_that_says_what_pin_takes(llama, pin):
    with pytest.raises(TypeError, match=r"pin takes a dict of module name -> device"):
        place(llama, FOUR, batch=2, seq_len=32, pin=pin)


def test_a_pin_given_as_a_device_alone_says_how_to_pin_the_whole_model(llama):
    with pytest.raises(TypeError, match=r"pin=\{'': 'cpu'\}"):
        place(llama, FOUR, batch=2, seq_len=32, pin="cpu")


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ({"batch": "8"}, "batch takes the number of samples per step"),
        ({"batch": 2.0}, "batch takes"),
        ({"seq_len": 32.0}, "seq_len takes the tokens per sample"),
        ({"training": "yes"}, "training takes True or False"),
        ({"optimizer": ["adamw"]}, "optimizer takes a name"),
        ({"optimizer": True}, "optimizer takes a name"),
        ({"precision": 16}, "precision takes None"),
        ({"strategy": 1}, "strategy takes 'pipeline' or 'fsdp'"),
        ({"world_size": "2", "strategy": "fsdp"}, "world_size takes an int >= 1"),
        ({"no_split": 5}, "no_split must be a list"),
        ({"inputs": 5, "seq_len": None}, "inputs= takes the forward's inputs"),
        ({"inputs": {0: (2, 32)}, "seq_len": None}, "inputs= as a dict maps"),
        ({"devices": {1.5: "1GiB"}}, "is not a device"),
        ({"devices": {"cuda:0": [1]}}, "capacity of 'cuda:0' is \\[1\\]"),
        ({"devices": ["cuda:0"]}, "devices must be 'auto' or a non-empty mapping"),
    ],
)
def test_every_argument_of_the_wrong_type_is_a_type_error_naming_what_it_takes(
    llama, arguments, words
):
    call = {"devices": FOUR, "batch": 2, "seq_len": 32, **arguments}
    with pytest.raises(TypeError, match=words):
        place(llama, call.pop("devices"), **call)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "int4"])
def test_the_planners_weight_bytes_are_the_memory_tables_totals(dtype):
    from jupyter_metainit import memory_table
    from jupyter_metainit.estimates.memory import subtree_bytes

    tied = _llama(tie_word_embeddings=True)
    tied.register_buffer("table", torch.zeros(3, 5), persistent=False)
    tied.model.freqs = torch.ones(7)  # a tensor kept as a plain attribute
    table = memory_table(tied, dtype=dtype)
    assert subtree_bytes(tied, dtype=dtype) == table["total_bytes"].to_dict()


def test_seq_len_for_a_model_that_takes_no_token_ids_says_to_pass_inputs():
    config = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=32, patch_size=8)  # fmt: skip
    with meta_init():
        vit = transformers.ViTModel(config)
    with pytest.raises(ValueError, match=r"ViTModel.forward\(pixel_values.*inputs=\[\("):
        place(vit, FOUR, batch=2, seq_len=32)
    assert place(vit, FOUR, inputs=[(2, 3, 32, 32)]).fits


def _measured_peak(model, ids, training):
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if not training:
        model.eval()
        tracker.track_external(model)
        with tracker, torch.no_grad():
            model(ids, use_cache=True)
    else:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        tracker.track_external(model, optimizer)
        with tracker:
            for step in range(2):  # the second step: optimizer states exist, as in every later one
                model(ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
    return max(int(stats["Total"]) for stats in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_the_predicted_peak_is_within_5_percent_of_a_real_run_on_the_cpu(training):
    from jupyter_metainit import materialize

    model = _llama(hidden_size=128, intermediate_size=256, num_attention_heads=4)
    predicted = place(model, {"cpu": "1GiB"}, batch=4, seq_len=64, training=training).peak["cpu"]
    materialize(model)
    measured = _measured_peak(model, torch.randint(0, 1000, (4, 64)), training)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_no_split_lists_the_modules_kept_whole_instead_of_the_repeated_blocks(llama):
    plan = place(llama, FOUR, batch=2, seq_len=32, no_split=["LlamaMLP"])
    names = [name for name, _, _, _ in plan.parts]
    assert "model.layers.0.mlp" in names and "model.layers.0" not in names


def test_host_memory_takes_only_what_the_accelerators_cannot_hold(llama, plan):
    roomy = place(llama, {**FOUR, "cpu": "1GiB"}, batch=2, seq_len=32)
    assert roomy.peak["cpu"] == 0 and roomy.device_map == plan.device_map
    tight = place(llama, {"cuda:0": MiB, "cpu": "1GiB"}, batch=2, seq_len=32)
    assert tight.fits and tight.peak["cpu"] > 0 and tight.peak["cuda:0"] <= MiB


def test_bf16_halves_the_weights_of_an_fp32_model(llama):
    layer = {}
    for precision in (None, "bf16"):
        plan = place(llama, {"cpu": "1GiB"}, batch=2, seq_len=32, precision=precision)
        layer[precision] = {name: costs for name, _, _, costs in plan.parts}["model.layers.0"]
    assert layer["bf16"].weights * 2 == layer[None].weights


def test_the_html_view_shows_each_devices_peak_against_its_capacity(plan):
    html = plan._repr_html_()
    assert all(device in html for device in FOUR) and "8.00 MiB" in html


def _on_cpu(plan):
    """The plan with its GPUs read as the CPU (this machine's stand-in), under two names ("cpu"
    and "cpu:0") so that the parts still go in one group per planned device pair."""
    from jupyter_metainit.plan import Placement

    cpus = {d: "cpu" if int(d.split(":")[1]) < 2 else "cpu:0" for d in plan.capacity}
    return Placement.from_device_map({name: cpus[d] for name, d in plan.device_map.items()})


def _eager():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(num_hidden_layers=6))


def test_materializing_a_plan_gives_every_tensor_eagers_values():
    from jupyter_metainit import materialize

    model = _llama()
    plan = place(model, FOUR, batch=2, seq_len=32)
    materialize(model, placement=_on_cpu(plan))
    eager = _eager().state_dict()
    for name, value in model.state_dict().items():
        assert not is_deferred(value) and torch.equal(value, eager[name]), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_a_plan_for_gpus_on_a_machine_without_them_says_so_and_leaves_the_model_deferred():
    from jupyter_metainit import materialize

    model = _llama()
    plan = place(model, FOUR, batch=2, seq_len=32)
    with pytest.raises(MaterializationError, match="cuda:0"):
        materialize(model, placement=plan)
    assert all(is_deferred(t) for t in model.state_dict().values())


def test_materializing_a_plan_reports_one_progress_total():
    from jupyter_metainit import materialize

    model = _llama()
    plan = place(model, FOUR, batch=2, seq_len=32)
    seen = []
    materialize(model, placement=_on_cpu(plan), progress=lambda done, total: seen.append(
        (done, total)))  # fmt: skip
    totals = {total for _, total in seen}
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert (
        len(totals) == 1
        and seen[-1][0] == seen[-1][1]
        and totals.pop() >= state - 2 * 1000 * 64 * 4
    )
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_a_failure_while_materializing_a_plan_leaves_the_model_deferred():
    from jupyter_metainit import materialize

    model = _llama()
    plan = place(model, FOUR, batch=2, seq_len=32)
    calls = []

    def cancel_in_the_last_part(done, total):
        calls.append(done)
        if done > total // 2:
            raise KeyboardInterrupt

    placement = _on_cpu(plan)
    assert len(set(placement.device_map.values())) == 2  # the first group is made, then undone
    with pytest.raises(KeyboardInterrupt):
        materialize(model, placement=placement, progress=cancel_in_the_last_part)
    assert all(is_deferred(t) for t in model.state_dict().values())
    materialize(model)
    eager = _eager().state_dict()
    assert all(torch.equal(v, eager[k]) for k, v in model.state_dict().items())


def test_materialize_refuses_something_that_is_no_plan_as_a_placement(llama):
    from jupyter_metainit import materialize

    with pytest.raises(TypeError, match="from_device_map"):
        materialize(llama, placement={"": "cpu"})


def test_keyword_inputs_plan_an_encoder_decoder_with_tied_embeddings_on_one_device():
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=4, num_heads=4, vocab_size=500)
    with meta_init():
        model = transformers.T5ForConditionalGeneration(config)
    plan = place(model, FOUR, inputs={"input_ids": (2, 32), "decoder_input_ids": (2, 8)})
    on = {name: device for name, _, device, _ in plan.parts}
    assert on["shared"] == on["encoder.embed_tokens"] == on["decoder.embed_tokens"]
    assert plan.workload == "inputs input_ids=(2, 32), decoder_input_ids=(2, 8)"


def test_a_mixtral_shaped_moe_is_planned_with_its_experts_in_their_blocks():
    config = transformers.MixtralConfig(
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    with meta_init():
        model = transformers.MixtralForCausalLM(config)
    plan = place(model, {"cuda:0": "1GiB", "cuda:1": "1GiB"}, batch=2, seq_len=256,
                 precision="bf16")  # fmt: skip
    assert plan.fits and set(plan.peak) == {"cuda:0", "cuda:1"}
    assert _device_of(plan.device_map, "model.layers.0.mlp.experts") == _device_of(
        plan.device_map, "model.layers.0.self_attn"
    )
    assert is_deferred(model)
