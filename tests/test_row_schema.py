"""The widget's row schema: one definition, the page's copy generated from it."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from jupyter_metainit import materialize, meta_init
from jupyter_metainit.jupyter.row_schema import (
    PATCH_FIELDS,
    ROW_FIELDS,
    STATS_FIELDS,
    make_row,
    typescript_source,
)
from jupyter_metainit.jupyter.widget import explore

ROWS_TS = pathlib.Path(__file__).resolve().parent.parent / "labextension" / "src" / "rows.ts"


def test_rows_ts_is_generated_from_the_python_schema():
    assert ROWS_TS.read_text(encoding="utf-8") == typescript_source(), (
        "regenerate: python -m jupyter_metainit.jupyter.row_schema > labextension/src/rows.ts"
    )


def test_every_tree_row_has_one_slot_per_schema_field():
    with meta_init():
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    rows = explore(model).tree["nodes"]
    assert {len(row) for row in rows} == {len(ROW_FIELDS)}


def test_patch_rows_carry_the_node_then_the_stats_fields():
    assert ("node", *STATS_FIELDS) == PATCH_FIELDS
    assert set(STATS_FIELDS) <= set(ROW_FIELDS)


def test_a_row_missing_a_field_is_refused():
    with pytest.raises(TypeError, match="missing fields"):
        make_row(parent=-1)


def test_refresh_writes_the_changed_stats_into_the_synced_tree():
    with meta_init():
        model = nn.Sequential(nn.Linear(4, 4, dtype=torch.float32))
    w = explore(model)
    materialize(model[0])
    w.refresh()
    assert [row[ROW_FIELDS.index("state")] for row in w.tree["nodes"]] == ["cpu", "cpu"]
