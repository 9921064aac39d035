"""%place on a real ``InteractiveShell``: the plan of a model, and mistakes as UsageErrors."""

from __future__ import annotations

import pytest
from _ipython import run, usage_error

pytest.importorskip("transformers")

BUILD = """
import transformers
from jupyter_metainit import meta_init
with meta_init():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000))
"""


@pytest.fixture
def ip(ip):
    ip.run_cell(BUILD)
    return ip


def test_place_magic_returns_the_plan_for_the_devices_and_workload(ip):
    result, out = run(ip, "plan = %place model --devices cpu=1GiB --batch 4 --seq-len 32")
    assert result.success, out.stdout
    plan = ip.user_ns["plan"]
    assert plan.capacity == {"cpu": 1 << 30} and plan.workload == "batch 4, seq_len 32"


def test_place_magic_shows_each_devices_peak_against_its_capacity(ip):
    result, out = run(ip, "%place model --devices cuda:0=4MiB,cuda:1=4MiB --seq-len 32")
    assert result.success, out.stdout
    shown = repr(result.result)  # what the cell's output shows
    assert "cuda:0" in shown and "cuda:1" in shown and "4.00 MiB" in shown


def test_place_magic_table_option_returns_the_table(ip):
    result, _ = run(ip, "table = %place model --devices cpu=1GiB --seq-len 8 --table")
    assert result.success and "(peak)" in ip.user_ns["table"].index.get_level_values("part")


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("%place model --devices cpu --seq-len 8", "--devices takes name=value"),
        ("%place model --devices gpu0=1GiB --seq-len 8", "unknown device 'gpu0'"),
        ("%place model --devices cpu=lots --seq-len 8", "cannot read the capacity"),
        ("%place model --devices cpu=1GiB", "--seq-len"),
        ("%place nothing --devices cpu=1GiB --seq-len 8", "cannot evaluate 'nothing'"),
        ("%place model --devices cpu=1GiB --seq-len 8 --pin lm_head=cuda:3", "cuda:3 is not in"),
    ],
)
def test_place_magic_mistakes_are_one_line_usage_errors(ip, line, words):
    assert words in usage_error(ip, line)


def test_place_magic_plans_a_model_that_takes_images_from_its_input_shapes(ip):
    ip.run_cell(
        "from torch import nn\n"
        "with meta_init():\n"
        "    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))"
    )
    result, out = run(ip, "plan = %place conv --devices cpu=1GiB --inputs '(2, 3, 10, 10)'")
    assert result.success, out.stdout
    assert ip.user_ns["plan"].fits


def test_place_magic_says_to_pass_inputs_in_its_own_words(ip):
    ip.run_cell(
        "from torch import nn\n"
        "with meta_init():\n"
        "    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))"
    )
    message = usage_error(ip, "%place conv --devices cpu=1GiB --seq-len 8")
    assert "--inputs '[(8, 3, 224, 224)]'" in message and "seq_len=" not in message
