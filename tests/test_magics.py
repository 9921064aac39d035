"""The IPython extension on a real ``InteractiveShell``: %%meta_init and the line magics."""

from __future__ import annotations

import os
import re

import pytest
import torch
from _ipython import ok, run, usage_error
from IPython.utils.capture import capture_output

from jupyter_metainit import is_deferred, is_meta_init

EXT = "jupyter_metainit"
MAGICS = {"cell": ["meta_init"], "line": ["materialize", "dematerialize", "meta_table"]}
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def ip(ip):
    ip.run_cell("import torch\nfrom torch import nn")
    return ip


def registered(shell) -> dict[str, list[str]]:
    manager = shell.magics_manager
    return {kind: [n for n in names if n in manager.magics[kind]] for kind, names in MAGICS.items()}


def mimes(out) -> list[str]:
    return [mime for output in out.outputs for mime in output.data]


# --------------------------------------------------------------------------- extension


def test_load_ext_registers_all_magics(ip):
    assert registered(ip) == MAGICS


def test_reload_ext_keeps_a_single_registration(ip):
    ok(ip, f"%reload_ext {EXT}")
    assert registered(ip) == MAGICS
    owners = {type(ip.magics_manager.magics[k][n].__self__) for k, ns in MAGICS.items() for n in ns}
    assert len(owners) == 1
    assert sum(name == "MetaInitMagics" for name in ip.magics_manager.registry) == 1


def test_reload_ext_magics_still_work(ip):
    ok(ip, f"%reload_ext {EXT}")
    ok(ip, "%%meta_init --no-display\nm = nn.Linear(3, 3)")
    assert is_deferred(ip.user_ns["m"])


def test_unload_ext_removes_magics(ip):
    ok(ip, f"%unload_ext {EXT}")
    assert registered(ip) == {"cell": [], "line": []}
    assert "MetaInitMagics" not in ip.magics_manager.registry
    message = usage_error(ip, "%%meta_init\nx = 1")
    assert "not found" in message
    ok(ip, f"%load_ext {EXT}")  # the fixture unloads again


def test_load_unload_leaves_no_event_callbacks(shell):
    before = {event: list(cbs) for event, cbs in shell.events.callbacks.items()}
    shell.run_cell(f"%load_ext {EXT}")
    shell.run_cell(f"%reload_ext {EXT}")
    shell.run_cell(f"%unload_ext {EXT}")
    assert {event: list(cbs) for event, cbs in shell.events.callbacks.items()} == before
    assert registered(shell) == {"cell": [], "line": []}


# --------------------------------------------------------------------------- %%meta_init cell


def test_cell_defers_the_model(ip):
    ok(ip, "%%meta_init --no-display\nm = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU())")
    assert is_deferred(ip.user_ns["m"])
    assert ip.user_ns["m"][0].weight.shape == (4096, 4096)


def test_meta_init_ends_with_the_cell(ip):
    ok(ip, "%%meta_init --no-display\nm = nn.Linear(2, 2)")
    assert not is_meta_init()
    ok(ip, "t = torch.ones(2)")
    assert not is_deferred(ip.user_ns["t"])


def test_last_expression_is_displayed(ip):
    result, out = run(ip, "%%meta_init --no-display\nm = nn.Linear(4, 3)\nm.weight.shape")
    assert result.success
    assert result.result == torch.Size([3, 4])
    assert "Out[" in out.stdout and "torch.Size([3, 4])" in out.stdout


def test_print_works(ip):
    out = ok(ip, "%%meta_init --no-display\nprint('hello from the cell')")
    assert "hello from the cell" in out.stdout


def test_nested_line_magic_runs(ip):
    ok(ip, "%%meta_init --no-display\n%alias_magic jm_test_alias time\nx = 1")
    assert "jm_test_alias" in ip.magics_manager.magics["line"]
    del ip.magics_manager.magics["line"]["jm_test_alias"]
    del ip.magics_manager.magics["cell"]["jm_test_alias"]


def test_shell_command_runs(ip):
    ok(ip, "%%meta_init --no-display\nlines = !echo shell-ok")
    assert list(ip.user_ns["lines"]) == ["shell-ok"]


def test_variables_land_in_user_namespace(ip):
    ok(ip, "%%meta_init --no-display\nm = nn.Linear(2, 2)\nn_out = m.out_features")
    assert ip.user_ns["n_out"] == 2


def test_shows_summary_and_widget_for_new_module(ip):
    out = ok(ip, "%%meta_init\nm = nn.Linear(8, 4)")
    assert "m: Linear, 36 parameters, 144 B, deferred" in out.stdout
    assert WIDGET_MIME in mimes(out)


def test_shows_only_top_level_new_modules(ip):
    ok(ip, "%%meta_init --no-display\nold = nn.Linear(2, 2)")
    out = ok(ip, "%%meta_init\nm = nn.Sequential(nn.Linear(2, 2))\nfirst = m[0]\nalias = m\n")
    lines = [line for line in out.stdout.splitlines() if ": " in line]
    assert [line.split(":")[0] for line in lines] == ["m"]
    assert mimes(out).count(WIDGET_MIME) == 1


def test_lazy_module_is_shown(ip):
    out = ok(ip, "%%meta_init\nm = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))")
    assert "m: Sequential, 10 parameters, 40 B, 2 lazy tensors, deferred" in out.stdout
    assert WIDGET_MIME in mimes(out)


def test_display_failure_does_not_fail_the_cell(ip):
    code = (
        "class Broken(nn.Module):\n"
        "    def parameters(self, recurse=True):\n"
        "        raise RuntimeError('cannot list')\n"
    )
    ok(ip, code)
    result, out = run(ip, "%%meta_init\nm = Broken()")
    assert result.success and "m" in ip.user_ns
    assert "jupyter_metainit: could not show m as a summary (RuntimeError: cannot list)" in (
        out.stderr
    )


def test_rebound_name_is_shown_again(ip):
    ok(ip, "%%meta_init --no-display\nm = nn.Linear(2, 2)")
    out = ok(ip, "%%meta_init\nm = nn.Linear(3, 3)")
    assert "m: Linear, 12 parameters" in out.stdout


def test_two_new_models_are_both_shown(ip):
    out = ok(ip, "%%meta_init\na = nn.Linear(2, 2)\nb = nn.Linear(3, 3)")
    assert "a: Linear" in out.stdout and "b: Linear" in out.stdout
    assert mimes(out).count(WIDGET_MIME) == 2


def test_no_display_option_shows_nothing(ip):
    out = ok(ip, "%%meta_init --no-display\nm = nn.Linear(2, 2)")
    assert out.stdout == "" and out.outputs == []


def test_table_option_shows_memory_table(ip):
    out = ok(ip, "%%meta_init --table\nm = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))")
    assert WIDGET_MIME not in mimes(out)
    html = next(o.data["text/html"] for o in out.outputs if "text/html" in o.data)
    assert "<table" in html


def test_depth_option_limits_table_rows(ip):
    code = "%%meta_init --table --depth {}\nm = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))"
    shallow = ok(ip, code.format(0)).outputs[-1].data["text/plain"]
    deep = ok(ip, code.format(2)).outputs[-1].data["text/plain"]
    assert len(shallow.splitlines()) < len(deep.splitlines())


def test_depth_option_opens_widget_to_depth(ip):
    from ipywidgets.widgets.widget import _instances

    out = ok(ip, "%%meta_init --depth 3\nm = nn.Linear(2, 2)")
    (view,) = [o.data[WIDGET_MIME] for o in out.outputs if WIDGET_MIME in o.data]
    assert _instances[view["model_id"]].expand_depth == 3


def test_device_option_sets_reported_device(ip):
    ok(ip, "%%meta_init --no-display --device cuda:1\nm = nn.Linear(2, 2)")
    assert ip.user_ns["m"].weight.device == torch.device("cuda", 1)
    assert is_deferred(ip.user_ns["m"])


@pytest.mark.parametrize("spelling", ["bfloat16", "torch.bfloat16", "bf16"])
def test_dtype_option_sets_default_dtype(ip, spelling):
    ok(ip, f"%%meta_init --no-display --dtype {spelling}\nm = nn.Linear(2, 2)")
    assert ip.user_ns["m"].weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


def test_dtype_option_reaches_a_lazy_layer_run_in_init(ip):
    code = (
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv = nn.LazyConv2d(4, 3)\n"
        "        self.conv(torch.randn(1, 2, 8, 8))\n"
    )
    ok(ip, code)
    ok(ip, "%%meta_init --no-display --dtype float64\nm = Net()")
    conv = ip.user_ns["m"].conv
    assert conv.weight.dtype == conv.bias.dtype == torch.float64 and is_deferred(conv)


def test_help_lists_every_option(ip):
    out = ok(ip, "%%meta_init?")
    for option in ("--no-display", "--table", "--device DEV", "--dtype DT", "--depth N"):
        assert option in out.stdout


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("--bogus", "%%meta_init: unknown option --bogus (its options: --depth, --device"),
        ("--dtype int8", "--dtype: 'int8' is not a usable floating dtype"),
        ("--dtype float8_e4m3fn", "--dtype: 'float8_e4m3fn' is not a usable floating dtype"),
        ("--dtype nonsense", "--dtype: 'nonsense' is not a usable floating dtype"),
        ("--device gpu7", "--device: 'gpu7' is not a device"),
        ("--device meta", "--device: 'meta' is not a real device"),
        ("--depth two", "%%meta_init: argument --depth: invalid int value: 'two'"),
        ("--depth -1", "--depth: must be 0 or more, got -1"),
        ("--device", "%%meta_init: argument --device: expected one argument"),
    ],
)
def test_bad_option_is_one_line_usage_error(ip, options, expected):
    message = usage_error(ip, f"%%meta_init {options}\nran = True")
    assert message.startswith(expected)
    assert "ran" not in ip.user_ns


@pytest.mark.parametrize(
    ("line", "magic", "typed", "closest"),
    [
        ("%%meta_init --depht 2\nran = True", "%%meta_init", "--depht", "--depth"),
        ("%materialize m --devcie cpu", "%materialize", "--devcie", "--device"),
        ("%dematerialize m --forse", "%dematerialize", "--forse", "--force"),
        ("%meta_table m --depht 2", "%meta_table", "--depht", "--depth"),
        ("%place m --trainig --seq-len 8", "%place", "--trainig", "--training"),
        ("%save m ./ckpt --formt dcp", "%save", "--formt", "--format"),
        ("%stats m --dpeth 1", "%stats", "--dpeth", "--depth"),
    ],
)
def test_a_mistyped_option_names_the_magic_and_suggests_the_closest_one(
    ip, line, magic, typed, closest
):
    ok(ip, "%%meta_init\nm = nn.Sequential(nn.Linear(4, 3))")
    message = usage_error(ip, line)
    assert message.startswith(f"{magic}: unknown option {typed}; did you mean {closest}? ("), (
        message
    )
    assert "ran" not in ip.user_ns


def test_a_mistyped_choice_names_the_magic_and_suggests_the_closest_one(ip):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    assert usage_error(ip, "%materialize m --rng fastt") == (
        "%materialize: argument --rng: invalid choice: 'fastt' (choose from 'exact', 'fast'); "
        "did you mean 'fast'?"
    )


def test_a_magic_without_options_says_an_option_is_unknown(ip):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    assert usage_error(ip, "%compare m m --quick") == "%compare: unknown option --quick"


def test_an_unknown_option_with_nothing_close_lists_the_magics_options(ip):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    assert usage_error(ip, "%meta_table m --zzz") == (
        "%meta_table: unknown option --zzz (its options: --depth, --dtype, --full)"
    )


# --------------------------------------------------------------------------- errors in the cell


def test_exception_fails_the_cell(ip):
    result, _ = run(ip, "%%meta_init\nm = nn.Linear(2, 2)\n1 / 0")
    assert not result.success
    assert isinstance(result.error_in_exec, ZeroDivisionError)


def test_traceback_is_shown_once_and_names_the_user_line(ip):
    _, out = run(ip, "%%meta_init\n\nm = nn.Linear(2, 2)\nboom = 1 / 0\n")
    assert out.stdout.count("Traceback (most recent call last)") == 1
    assert out.stdout.count("ZeroDivisionError: division by zero") == 1
    assert "----> 4 boom = 1 / 0" in out.stdout
    assert "run_cell_magic" not in out.stdout


def test_error_in_called_function_points_into_it(ip):
    ok(ip, "def build():\n    return nn.Linear(2, 2, bias='nope') + 1")
    _, out = run(ip, "%%meta_init\nm = build()")
    assert "----> 2 m = build()" in out.stdout
    assert out.stdout.count("Traceback (most recent call last)") == 1


def test_traceback_line_inside_nested_cell_magic(ip):
    result, out = run(ip, "%%time\n%%meta_init\nx = 1\nboom = 1 / 0")
    assert not result.success
    assert "----> 4 boom = 1 / 0" in out.stdout


def test_failure_raises_when_called_from_python(ip):
    from jupyter_metainit.jupyter.cell_runner import CellFailed

    with capture_output(), pytest.raises(CellFailed, match="ZeroDivisionError"):
        ip.run_cell_magic("meta_init", "--no-display", "m = nn.Linear(2, 2)\n1 / 0")
    assert is_deferred(ip.user_ns["m"])


def test_syntax_error_fails_the_cell(ip):
    result, out = run(ip, "%%meta_init\nx = (\n")
    assert not result.success
    assert isinstance(result.error_before_exec, SyntaxError)
    # Shown once, by its own name: Python 3.13 raises a SyntaxError subclass for an unclosed
    # bracket (``_IncompleteInputError: incomplete input``), 3.10 to 3.12 a plain SyntaxError.
    assert out.stdout.count(type(result.error_before_exec).__name__) == 1


def test_failed_cell_shows_no_model(ip):
    _, out = run(ip, "%%meta_init\nm = nn.Linear(2, 2)\nraise RuntimeError('stop')")
    assert "m: Linear" not in out.stdout
    assert WIDGET_MIME not in mimes(out)


def test_meta_init_ends_after_a_failed_cell(ip):
    run(ip, "%%meta_init\nraise RuntimeError('stop')")
    assert not is_meta_init()


def test_models_built_before_the_error_stay_valid(ip):
    run(ip, "%%meta_init\ntorch.manual_seed(0)\nm = nn.Linear(16, 8)\nraise RuntimeError('x')")
    m = ip.user_ns["m"]
    assert is_deferred(m)
    ok(ip, "%materialize m")
    torch.manual_seed(0)
    eager = torch.nn.Linear(16, 8)
    assert torch.equal(m.weight, eager.weight) and torch.equal(m.bias, eager.bias)


# --------------------------------------------------------------------------- line magics


@pytest.fixture
def model(ip):
    ok(
        ip,
        "%%meta_init --no-display\ntorch.manual_seed(0)\n"
        "m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))",
    )
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return ip.user_ns["m"], eager


def test_materialize_expression_equals_eager(ip, model):
    m, eager = model
    out = ok(ip, "%materialize m[2]")
    assert "materialized m[2]: Linear, 68 parameters" in out.stdout
    assert not is_deferred(m[2]) and is_deferred(m[0])
    assert torch.equal(m[2].weight, eager[2].weight) and torch.equal(m[2].bias, eager[2].bias)


def test_materialize_reports_the_device_and_the_time_it_took(ip, model):
    # The wording of the time itself (ms below a second) is format_duration's, in test_format.
    out = ok(ip, "%materialize m[0]")
    assert re.search(r", cpu in (<1 ms|\d+ ms|\d+\.\d s)$", out.stdout.strip()), out.stdout


def test_materialize_list_expression(ip, model):
    m, _ = model
    ok(ip, "%materialize [m[0], m[2]]")
    assert not is_deferred(m)


def test_materialize_dtype_option(ip, model):
    m, eager = model
    ok(ip, "%materialize m[0] --dtype float64")
    assert m[0].weight.dtype == torch.float64
    assert torch.equal(m[0].weight, eager[0].weight.double())


def test_materialize_device_option(ip, model):
    m, _ = model
    ok(ip, "%materialize m[0] --device cpu")
    assert m[0].weight.device == torch.device("cpu") and not is_deferred(m[0])


def test_materialize_rng_fast(ip, model):
    m, _ = model
    ok(ip, "%materialize m --rng fast")
    assert not is_deferred(m)
    assert m[0].weight.std() > 0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("%materialize nothere", "%materialize: cannot evaluate 'nothere': name 'nothere'"),
        ("%materialize m.nope", "%materialize: cannot evaluate 'm.nope'"),
        ("%materialize m[7]", "%materialize: cannot evaluate 'm[7]'"),
        ("%materialize", "%materialize: missing EXPR"),
        ("%materialize m.training", "%materialize: m.training is a bool, not a torch.nn.Module"),
        ("%materialize m --rng slow", "%materialize: argument --rng: invalid choice: 'slow'"),
        ("%materialize m --dtype int4", "--dtype: 'int4' is not a usable floating dtype"),
        ("%materialize m --device nowhere", "--device: 'nowhere' is not a device"),
        ("%materialize m --device mps", "--device: 'mps' is not available here"),
        ("%materialize m --dtype bf16 --rng fast --device cpu extra", "%materialize: unexp"),
        ("%materialize m --bogus", "%materialize: unknown option --bogus"),
        ("%materialize m --rng fast extra", "%materialize: unexpected argument(s) 'extra'"),
        ("%dematerialize nothere", "%dematerialize: cannot evaluate 'nothere'"),
        ("%meta_table nothere", "%meta_table: cannot evaluate 'nothere'"),
        ("%materialize 1/0", "%materialize: cannot evaluate '1/0': division by zero (Zero"),
        ("%dematerialize int('x')", "%dematerialize: cannot evaluate \"int('x')\": invalid"),
        ("%meta_table m(1)", "%meta_table: cannot evaluate 'm(1)': "),
        ("%meta_table m[0].weight", "%meta_table: m[0].weight is a tensor, not a torch.nn.Module"),
        ("%meta_table m --depth x", "%meta_table: argument --depth: invalid int value: 'x'"),
        ("%meta_table m --dtype int33", "--dtype: dtype='int33' is not a dtype"),
    ],
)
def test_line_magic_usage_errors(ip, model, line, expected):
    assert usage_error(ip, line).startswith(expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_materialize_to_cuda_without_cuda_is_one_line(ip, model):
    m, _ = model
    assert usage_error(ip, "%materialize m --device cuda").startswith(
        "--device: 'cuda': CUDA is not available here"
    )
    assert is_deferred(m)


def test_materialize_refusal_from_the_core_is_one_line(ip, model):
    ok(ip, "with torch.device('meta'):\n    plain = nn.Linear(2, 2)")
    message = usage_error(ip, "%materialize [m, plain]")
    assert message.startswith("%materialize: ") and "meta device" in message


def test_expression_keeps_quotes_and_spaces(ip, model):
    m, _ = model
    ok(ip, "layers = {'first layer': m[0]}")
    ok(ip, "%materialize layers['first layer'] --rng exact")
    assert not is_deferred(m[0])


def test_dematerialize_makes_deferred_again(ip, model):
    m, eager = model
    ok(ip, "%materialize m")
    out = ok(ip, "%dematerialize m[0]")
    assert "dematerialized m[0]: Linear, 144 parameters" in out.stdout
    assert is_deferred(m[0]) and not is_deferred(m[2])
    ok(ip, "%materialize m[0]")
    assert torch.equal(m[0].weight, eager[0].weight)


def test_dematerialize_refuses_modified_tensor(ip, model):
    m, _ = model
    ok(ip, "%materialize m[0]\nwith torch.no_grad():\n    m[0].weight.add_(1)")
    message = usage_error(ip, "%dematerialize m[0]")
    assert not is_deferred(m[0])
    assert message.endswith("With the magic: %dematerialize m[0] --force")


def test_dematerialize_force_drops_modified_tensor(ip, model):
    m, _ = model
    ok(ip, "%materialize m[0]\nwith torch.no_grad():\n    m[0].weight.add_(1)")
    ok(ip, "%dematerialize m[0] --force")
    assert is_deferred(m[0])


def test_meta_table_returns_the_dataframe(ip, model):
    ok(ip, "df = %meta_table m")
    df = ip.user_ns["df"]
    assert int(df.loc["", "params"]) == sum(p.numel() for p in model[0].parameters())


def test_meta_table_depth_option(ip, model):
    ok(ip, "df = %meta_table m --depth 0")
    assert list(ip.user_ns["df"].index) == [""]


def test_meta_table_dtype_option(ip, model):
    ok(ip, "full = %meta_table m\nhalf = %meta_table m --dtype bfloat16")
    full, half = ip.user_ns["full"], ip.user_ns["half"]
    assert int(half.loc["", "param_bytes"]) * 2 == int(full.loc["", "param_bytes"])


def test_line_magic_help_lists_options(ip):
    out = ok(ip, "%materialize?")
    for option in ("EXPR", "--device DEV", "--dtype DT", "--rng {exact,fast}"):
        assert option in out.stdout


def test_a_trailing_comment_does_not_force_dematerialize(ip, model):
    m, _ = model
    ok(ip, "%materialize m[0]\nwith torch.no_grad():\n    m[0].weight.add_(1)")
    message = usage_error(ip, "%dematerialize m[0]  # --force")
    assert not is_deferred(m[0]) and "--force" in message


def test_a_trailing_comment_does_not_cast_on_materialize(ip, model):
    m, _ = model
    ok(ip, "%materialize m[0]  # --dtype bfloat16")
    assert m[0].weight.dtype == torch.float32 and not is_deferred(m[0])


def test_a_hash_inside_a_string_of_the_expression_is_not_a_comment(ip, model):
    m, _ = model
    ok(ip, "layers = {'#1': m[0]}")
    ok(ip, "%materialize layers['#1'] --dtype float64  # the first layer")
    assert m[0].weight.dtype == torch.float64


def test_options_before_the_expression_are_accepted(ip, model):
    m, eager = model
    ok(ip, "%materialize --device cpu --dtype float64 m[0]")
    assert m[0].weight.dtype == torch.float64
    assert torch.equal(m[0].weight, eager[0].weight.double())


def test_options_before_and_after_the_expression_are_combined(ip, model):
    m, _ = model
    ok(ip, "%materialize --rng exact m[0] --dtype float64")
    assert m[0].weight.dtype == torch.float64


def test_a_comment_on_the_meta_init_line_is_not_an_option(ip):
    out = ok(ip, "%%meta_init  # --no-display\nm = nn.Linear(2, 2)")
    assert "m: Linear" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_materialize_of_a_cell_recorded_for_a_missing_gpu_says_how_to_pick_the_cpu(ip):
    ok(ip, "%%meta_init --device cuda --no-display\nlin = nn.Linear(2, 2)")
    message = usage_error(ip, "%materialize lin")
    assert "recorded for cuda:0" in message
    assert message.endswith("With the magic: %materialize lin --device cpu")
    assert is_deferred(ip.user_ns["lin"])
    ok(ip, "%materialize lin --device cpu")
    assert not is_deferred(ip.user_ns["lin"])


_NOT_SET_UP = "class NotSetUp(nn.Module):\n    def __init__(self):\n        self.size = 3\n"


def test_a_module_never_set_up_by_its_init_does_not_fail_the_cell(ip):
    ok(ip, _NOT_SET_UP)
    out = ok(ip, "%%meta_init\nbroken = NotSetUp()\nm = nn.Linear(2, 2)")
    assert "broken: NotSetUp, not shown" in out.stdout
    assert "add super().__init__() at the start of NotSetUp.__init__" in out.stdout
    assert "m: Linear" in out.stdout


def test_a_model_holding_a_part_never_set_up_names_that_part(ip):
    ok(ip, _NOT_SET_UP)
    cell = "%%meta_init\nm = nn.Sequential(nn.Linear(2, 2))\nm._modules['inner'] = NotSetUp()"
    out = ok(ip, cell)
    assert "m: Sequential, not shown (its part inner): NotSetUp.__init__ never called" in out.stdout


def test_line_magics_refuse_a_module_never_set_up_with_the_fix(ip):
    ok(ip, _NOT_SET_UP + "broken = NotSetUp()")
    message = usage_error(ip, "%materialize broken")
    assert message.startswith("%materialize: broken: NotSetUp, refused")
    assert message.endswith("(add super().__init__() at the start of NotSetUp.__init__)")


def test_a_torch_error_in_the_cell_shows_one_short_traceback_ending_at_the_user_line(ip):
    _, out = run(ip, "%%meta_init\nm = nn.Linear(3, 4)\ny = m(torch.ones(2, 5))")
    shown = out.stdout
    assert shown.count("Traceback (most recent call last)") == 1
    assert "During handling of the above exception" not in shown
    assert "jupyter_metainit" not in shown and "File " not in shown
    assert "----> 3 y = m(torch.ones(2, 5))" in shown
    assert shown.rstrip().endswith("mat1 and mat2 shapes cannot be multiplied (2x5 and 3x4)")


def eager_error(run_eagerly) -> str:
    """The text of the error eager torch raises: it varies by version (torch 2.15 puts the op's
    name first, ``mm: mat1 and mat2 ...``; up to 2.14 it starts ``mat1 and mat2 ...``), and a
    deferred cell must show exactly eager's."""
    with pytest.raises(RuntimeError) as raised:
        run_eagerly()
    return str(raised.value)


def test_a_torch_error_in_a_users_forward_ends_at_the_forward_line(ip):
    ok(
        ip,
        "class Proj(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = nn.Parameter(torch.ones(3, 4))\n"
        "    def forward(self, x):\n        return x @ self.w\n",
    )
    _, out = run(ip, "%%meta_init\np = Proj()\ny = p(torch.ones(2, 5))")
    shown = out.stdout
    assert shown.count("Traceback (most recent call last)") == 1
    assert "jupyter_metainit" not in shown and "During handling" not in shown
    message = eager_error(lambda: torch.ones(2, 5) @ torch.ones(3, 4))
    assert message.endswith("mat1 and mat2 shapes cannot be multiplied (2x5 and 3x4)")
    assert shown.rstrip().endswith(f"----> 6     return x @ self.w\n\nRuntimeError: {message}")


def test_a_torch_error_on_a_deferred_model_in_a_plain_cell_shows_one_short_traceback(ip):
    ok(ip, "%%meta_init --no-display\nm = nn.Linear(3, 4)")
    _, out = run(ip, "y = m(torch.ones(2, 5))")
    shown = out.stdout
    assert shown.count("Traceback (most recent call last)") == 1
    assert "During handling of the above exception" not in shown
    assert "jupyter_metainit" not in shown and "File " not in shown
    assert "----> 1 y = m(torch.ones(2, 5))" in shown


def test_a_users_forward_in_a_plain_cell_shows_no_chained_traceback(ip):
    ok(
        ip,
        "class Head(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.lin = nn.Linear(3, 4)\n"
        "    def forward(self, x):\n        return self.lin(x)\n",
    )
    ok(ip, "%%meta_init --no-display\nh = Head()")
    _, out = run(ip, "y = h(torch.ones(2, 5))")
    shown = out.stdout
    assert shown.count("Traceback (most recent call last)") == 1
    assert "jupyter_metainit" not in shown and "During handling" not in shown
    assert "----> 6     return self.lin(x)" in shown


def test_unloading_the_extension_gives_back_ipythons_own_tracebacks(ip):
    ip.run_cell(f"%unload_ext {EXT}")
    assert "showtraceback" not in ip.__dict__
    ip.run_cell(f"%load_ext {EXT}")


# --------------------------------------------------------------------------- %save


def test_save_magic_writes_the_checkpoint_and_leaves_the_model_deferred(ip, tmp_path):
    ok(ip, "%%meta_init\ntorch.manual_seed(0)\nm = nn.Linear(4, 3)")
    out = ok(ip, f"%save m {tmp_path / 'ckpt'}")
    assert "saved m to" in out.stdout
    from safetensors.torch import load_file

    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 3)
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(saved["weight"], eager.weight.detach())
    assert is_deferred(ip.user_ns["m"])


def test_save_magic_with_format_dcp_writes_a_distributed_checkpoint(ip, tmp_path):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    ok(ip, f"%save m {tmp_path / 'seed'} --format dcp")
    assert (tmp_path / "seed" / ".metadata").exists()


def test_save_magic_without_a_path_is_a_usage_error_and_writes_nothing(ip, tmp_path):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    assert "missing PATH" in usage_error(ip, "%save m")


def test_save_magic_with_an_unknown_format_is_a_usage_error(ip, tmp_path):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    assert "format" in usage_error(ip, f"%save m {tmp_path / 'x'} --format pickle")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("expr", "words"),
    [
        ("nope", "cannot evaluate 'nope': name 'nope' is not defined"),
        ("m.weight", "is a tensor, not a module"),
    ],
)
def test_save_magic_of_a_mistyped_name_or_a_tensor_is_our_usage_error_not_ipythons(
    ip, tmp_path, expr, words
):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    message = usage_error(ip, f"%save {expr} {tmp_path / 'x'}")
    assert words in message and "IPython's own" in message
    assert not (tmp_path / "x").exists()


def test_save_magic_to_a_path_it_cannot_write_says_what_to_do(ip, tmp_path):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    (tmp_path / "a_file").write_text("")
    message = usage_error(ip, f"%save m {tmp_path / 'a_file' / 'ckpt'}")
    assert "choose a directory you can write to" in message and "Errno" not in message


@pytest.mark.parametrize("path", ["~/ckpt", "$CKPT_ROOT/ckpt", "${CKPT_ROOT}/ckpt"])
def test_save_magic_expands_home_and_environment_variables_as_ipythons_magics_do(
    ip, tmp_path, monkeypatch, path
):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CKPT_ROOT", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    out = ok(ip, f"%save m {path}")
    assert (tmp_path / "home" / "ckpt" / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["home"]  # no directory named "~" or "$CKPT_ROOT"
    assert f"saved m to {tmp_path / 'home' / 'ckpt'} " in out.stdout


@pytest.mark.parametrize("quote", ['"', "'"])
def test_save_magic_takes_a_quoted_path_with_spaces_and_a_hash(ip, tmp_path, quote):
    ok(ip, "%%meta_init\nm = nn.Linear(4, 3)")
    ok(ip, f"%save m {quote}{tmp_path / 'my dir' / 'ck#1'}{quote} --format dcp")
    assert sorted(os.listdir(tmp_path / "my dir" / "ck#1")) == [".metadata", "__0_0.distcp"]


def test_ipythons_own_save_of_code_still_works_with_the_extension_loaded(ip, tmp_path):
    ok(ip, "x = 1")
    ok(ip, f"%save -f {tmp_path / 'code.py'} 1-2")
    assert (tmp_path / "code.py").exists()


def test_unloading_the_extension_gives_back_ipythons_own_save(ip):
    own = type(ip.magics_manager.magics["line"]["save"].__self__).__name__
    ok(ip, f"%unload_ext {EXT}")
    back = type(ip.magics_manager.magics["line"]["save"].__self__).__name__
    ok(ip, f"%load_ext {EXT}")  # the fixture unloads again
    assert (own, back) == ("MetaInitMagics", "CodeMagics")
