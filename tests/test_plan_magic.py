"""%place on a real ``InteractiveShell``: the plan of a model, and mistakes as UsageErrors."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytest.importorskip("transformers")

EXT = "jupyter_metainit"
BUILD = """
import transformers
from jupyter_metainit import meta_init
with meta_init():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000))
"""


@pytest.fixture
def ip():
    shell = InteractiveShell.instance()
    shell.colors = "nocolor"
    names = set(shell.user_ns)
    shell.run_cell(f"%load_ext {EXT}")
    shell.run_cell(BUILD)
    yield shell
    shell.run_cell(f"%unload_ext {EXT}")
    for name in set(shell.user_ns) - names:
        del shell.user_ns[name]
    shell.user_ns["Out"].clear()


def _run(shell, code):
    with capture_output() as out:
        result = shell.run_cell(code, store_history=True)
    return result, out


def _usage_error(shell, code) -> str:
    result, out = _run(shell, code)
    assert isinstance(result.error_in_exec, UsageError), (result.error_in_exec, out.stdout)
    assert "\n" not in str(result.error_in_exec) and "Traceback" not in out.stdout
    return str(result.error_in_exec)


def test_place_magic_returns_the_plan_for_the_devices_and_workload(ip):
    result, out = _run(ip, "plan = %place model --devices cpu=1GiB --batch 4 --seq-len 32")
    assert result.success, out.stdout
    plan = ip.user_ns["plan"]
    assert plan.capacity == {"cpu": 1 << 30} and plan.workload == "batch 4, seq_len 32"


def test_place_magic_shows_each_devices_peak_against_its_capacity(ip):
    result, out = _run(ip, "%place model --devices cuda:0=4MiB,cuda:1=4MiB --seq-len 32")
    assert result.success, out.stdout
    shown = repr(result.result)  # what the cell's output shows
    assert "cuda:0" in shown and "cuda:1" in shown and "4.00 MiB" in shown


def test_place_magic_table_option_returns_the_table(ip):
    result, _ = _run(ip, "table = %place model --devices cpu=1GiB --seq-len 8 --table")
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
    assert words in _usage_error(ip, line)
