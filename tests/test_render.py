from __future__ import annotations

import re

import torch
import transformers
from _models import llama_config
from torch import nn

from jupyter_metainit.estimates import MemoryTable, memory_table, render_html, to_text
from jupyter_metainit.estimates.render import format_table


def model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(50000, 1024), nn.Linear(1024, 4096), nn.Linear(4096, 8))


def test_table_is_a_dataframe_of_raw_numbers():
    table = memory_table(model())
    assert isinstance(table, MemoryTable)
    assert table["total_bytes"].dtype.kind == "i"
    assert isinstance(table.sort_values("total_bytes"), MemoryTable)


def test_html_shows_units_counts_and_tree():
    html = memory_table(model())._repr_html_()
    assert "MiB" in html and "KiB" in html
    assert "51,200,000" in html  # embedding parameters
    assert "(root)" in html and "└" in html


def highlighted_rows(html: str) -> set[int]:
    rows = set()
    for selectors, props in re.findall(r"([^{}]+)\{([^}]*)\}", html):
        if "rgba(255, 165, 0" in props:
            rows |= {int(r) for r in re.findall(r"_row(\d+)_col", selectors)}
    return rows


def test_html_highlights_largest_leaves():
    table = memory_table(model())  # rows: root, embedding (largest), linear, small linear
    assert highlighted_rows(render_html(table, highlight=1)) == {1}
    assert highlighted_rows(render_html(table, highlight=2)) == {1, 2}


def test_a_depth_limited_table_highlights_its_largest_deepest_rows_not_its_small_leaves():
    with torch.device("meta"):
        layer = nn.Sequential(
            nn.Sequential(nn.Linear(512, 2048), nn.Linear(2048, 512)), nn.LayerNorm(512)
        )
    html = render_html(memory_table(layer, depth=1), highlight=1)
    assert highlighted_rows(html) == {1}  # the mlp, not the (smaller) norm that is a leaf
    assert "highlighted: the 1 largest of the deepest rows shown" in html


def test_html_caption_is_the_summary():
    html = render_html(memory_table(model()))
    assert "largest leaf 0 (Embedding, 195 MiB)" in html


def test_html_table_scrolls_sideways_in_a_narrow_output_instead_of_being_cut():
    html = render_html(memory_table(model()), columns="all")
    box = re.search(r'<div class="jmi-table-scroll" style="([^"]*)"[^>]*>', html)
    assert box is not None and "overflow-x: auto" in box.group(1)
    assert html.rstrip().endswith("</div>") and html.count("<table") == 1


def test_html_summary_line_sits_above_the_scrolling_box_so_a_narrow_output_wraps_it():
    html = render_html(memory_table(model()), columns="all")
    summary, box = html.index("largest leaf 0 (Embedding"), html.index('"jmi-table-scroll"')
    assert summary < box and "<caption" not in html
    assert "white-space: normal" in html[html.rindex("<p", 0, summary) : summary]


def test_large_table_shows_shallow_levels_within_max_rows():
    cfg = llama_config(num_hidden_layers=30)
    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(cfg)
    html = render_html(memory_table(llama), max_rows=50)
    assert "showing depth ≤ 3: 37 of" in html
    assert "q_proj" not in html


def test_text_rendering_has_units():
    text = to_text(memory_table(model()))
    assert "MiB" in text and "params" in text.splitlines()[0]


def test_format_table_keeps_selected_columns():
    table = format_table(memory_table(model()), columns=["params", "total_bytes"])
    assert list(table.columns) == ["params", "total"]
    assert table.iloc[0, 0] == "55,431,176"
