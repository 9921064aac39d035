"""``inspection.charts``: a statistic along the depth of a model, and its SVG chart."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pandas as pd
import pytest

from jupyter_metainit.inspection import along_depth, svg_chart

SVG = "{http://www.w3.org/2000/svg}"


def _table() -> pd.DataFrame:
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.10.mlp.down_proj.weight",
             "model.layers.2.mlp.down_proj.weight", "lm_head.weight"]  # fmt: skip
    return pd.DataFrame({"std": [1.0, 0.1, 0.5, 0.3, 0.2, 2.0]}, index=names)


def test_along_depth_takes_one_tensor_of_every_block_in_layer_order():
    series = along_depth(_table(), "mlp.down_proj.weight")
    assert list(series.index) == [0, 2, 10] and list(series) == [0.1, 0.2, 0.3]


def test_along_depth_matches_the_whole_name_inside_the_block():
    assert along_depth(_table(), "down_proj.weight").empty is False
    with pytest.raises(ValueError, match=r"no row is .proj\.weight. inside a numbered block"):
        along_depth(_table(), "proj.weight")


def test_along_depth_of_a_column_the_table_lacks_names_the_ones_it_has():
    with pytest.raises(ValueError, match="no column 'rel_l2'; take one of 'std'"):
        along_depth(_table(), "mlp.down_proj.weight", "rel_l2")


def test_along_depth_reads_any_column():
    table = _table().assign(rel_l2=[0, 1, 2, 3, 4, 5])
    assert list(along_depth(table, "mlp.down_proj.weight", "rel_l2")) == [1, 4, 3]


def test_the_chart_is_svg_with_a_line_and_a_legend_entry_per_series():
    chart = svg_chart({"a": [1, 2, 3], "b <&>": [3, 2, 1]}, title="t", dashed=["b <&>"])
    root = ET.fromstring(chart._repr_svg_())
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 2 and lines[1].get("stroke-dasharray")
    assert "b <&>" in [t.text for t in root.findall(f"{SVG}text")]


def test_bars_draw_one_rect_per_value_besides_the_background_and_legend():
    root = ET.fromstring(str(svg_chart({"a": [1, 2], "b": [0.5, 0.0]}, bars=True)))
    assert len(root.findall(f"{SVG}rect")) == 1 + 4 + 2


@pytest.mark.parametrize("values", [[], [0.0, 0.0], [float("nan"), float("inf"), 1.0]])
def test_empty_zero_and_non_finite_values_still_draw(values):
    ET.fromstring(str(svg_chart({"a": values})))
