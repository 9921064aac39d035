"""``%stats`` and ``%compare`` on a real ``InteractiveShell``: the tables of ``stats`` and
``compare``, one-line ``UsageError``s for mistakes."""

from __future__ import annotations

import pytest
import torch
from _ipython import ok, usage_error

from jupyter_metainit import compare, is_deferred, stats

EXT = "jupyter_metainit"


@pytest.fixture
def ip(ip):
    ip.run_cell(
        "import torch\nfrom torch import nn\nfrom jupyter_metainit import meta_init\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(8, 4), nn.Sequential(nn.Linear(4, 2)))\n"
        "with meta_init():\n    m = build()\n"
        "e = build()"
    )
    return ip


def _value(ip, line: str):
    ok(ip, f"result = {line}")
    return ip.user_ns.pop("result")


def test_stats_magic_returns_the_table_of_stats_and_leaves_the_model_deferred(ip):
    table = _value(ip, "%stats m")
    assert table.equals(stats(ip.user_ns["e"]))
    assert is_deferred(ip.user_ns["m"])


def test_stats_magic_per_module_down_to_a_depth(ip):
    table = _value(ip, "%stats m --per module --depth 1")
    assert list(table.index) == ["", "0", "1"]


def test_stats_magic_depth_alone_means_module_rows(ip):
    assert list(_value(ip, "%stats m --depth 0").index) == [""]


def test_stats_magic_of_a_tensor_is_one_row_named_by_the_expression(ip):
    table = _value(ip, "%stats e[0].weight")
    assert list(table.index) == ["e[0].weight"]


def test_stats_magic_reads_a_path_typed_without_quotes(ip, tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6.0)}, str(tmp_path / "w.safetensors"))
    table = _value(ip, f"%stats {tmp_path / 'w.safetensors'}")
    assert table.loc["w", "max"] == 5.0


def test_stats_magic_bins_add_histograms(ip):
    table = _value(ip, "%stats e --bins 3")
    assert table["histogram"].map(len).eq(3).all()


def test_compare_magic_returns_the_table_of_compare(ip):
    table = _value(ip, "%compare m e.state_dict()")
    assert table.equals(compare(ip.user_ns["m"], ip.user_ns["e"]))
    assert (table["status"] == "equal").all()


def test_compare_magic_reads_a_checkpoint_path(ip, tmp_path):
    from jupyter_metainit import save

    save(ip.user_ns["e"], tmp_path / "ckpt")
    table = _value(ip, f"%compare m {tmp_path / 'ckpt'}")
    assert (table["status"] == "equal").all()


def test_stats_and_compare_magics_read_paths_as_save_does(ip, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CKPTS", str(tmp_path))
    ok(ip, '%save e "~/my ckpt"')
    names = ["0.bias", "0.weight", "1.0.bias", "1.0.weight"]
    assert sorted(_value(ip, '%stats "~/my ckpt"').index) == names
    assert (_value(ip, '%compare m "$CKPTS/my ckpt"')["status"] == "equal").all()
    ok(ip, "%save e $CKPTS/plain")
    assert (_value(ip, "%compare m $CKPTS/plain")["status"] == "equal").all()
    assert _value(ip, "%stats ~/plain")["max"].notna().all()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("%stats", "%stats: missing EXPR"),
        ("%stats nothere", "%stats: cannot evaluate 'nothere': name 'nothere' is not defined"),
        ("%stats m --per layer", "%stats: argument --per: invalid choice: 'layer'"),
        ("%stats m --per tensor --depth 1", "%stats: --depth chooses module rows"),
        ("%stats m --per module --bins 4", "%stats: --bins gives a histogram per tensor"),
        ("%stats m --bins 0", "%stats: --bins takes a whole number from 1"),
        ("%stats 3", "%stats: stats() takes a module, a dict of tensors"),
        ("%stats m extra --per module", "%stats: cannot evaluate 'm extra'"),
        ("%compare m", "%compare: needs two operands"),
        ("%compare m nothere/", "%compare: no such file or directory: 'nothere/'"),
        ("%stats ./nope", "%stats: no such file or directory: './nope'"),
        ("%stats ~/nope", "%stats: no such file or directory: '~/nope'"),
        ('%stats "~/no pe"', "%stats: stats(): no such file or directory"),
        ("%stats /no/such/dir", "%stats: no such file or directory: '/no/such/dir'"),
        ("%stats nope.safetensors", "%stats: no such file or directory: 'nope.safetensors'"),
        ("%compare m nope/model.safetensors", "%compare: no such file or directory"),
        ("%stats nothere / 2", "%stats: cannot evaluate 'nothere / 2': name 'nothere'"),
        ("%compare m 3", "%compare: compare(): b takes a module"),
    ],
)
def test_mistakes_are_one_line_usage_errors(ip, line, expected):
    assert usage_error(ip, line).startswith(expected)


def test_unload_ext_removes_stats_and_compare(ip):
    ok(ip, f"%unload_ext {EXT}")
    assert "stats" not in ip.magics_manager.magics["line"]
    assert "compare" not in ip.magics_manager.magics["line"]
    assert "ValueMagics" not in ip.magics_manager.registry
    ok(ip, f"%load_ext {EXT}")
    assert "stats" in ip.magics_manager.magics["line"]
