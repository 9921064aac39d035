"""Questions about a deferred tensor's metadata (``is_pinned()``, ``is_set_to``, ``is_same_size``)
are answered from its recording, never by computing its values (``dispatch.metadata``):
``torch.distributed.checkpoint`` asks ``is_pinned()`` of every tensor it saves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jupyter_metainit import is_deferred, meta_init
from jupyter_metainit.core.errors import MaterializationError
from jupyter_metainit.core.replay.read_cache import value_cache
from jupyter_metainit.saving import save

aten = torch.ops.aten


def _uncomputable() -> torch.Tensor:
    """A deferred tensor whose values cannot be computed any more: it was made from a large
    real tensor (kept by reference, with a digest) that was written since."""
    source = torch.ones(600, 600)  # over 1 MiB: referenced, not copied
    with meta_init():
        t = source * 2
    source.add_(1)
    return t


_QUERIES = {
    "is_pinned": lambda t: t.is_pinned(),
    "is_same_size": lambda t: t.is_same_size(t),
    "is_set_to": lambda t: t.is_set_to(t),
    "is_contiguous": lambda t: aten.is_contiguous.default(t),
    "is_non_overlapping_and_dense": lambda t: aten.is_non_overlapping_and_dense.default(t),
    "dense_dim": lambda t: t.dense_dim(),
    "sparse_dim": lambda t: t.sparse_dim(),
}
_EAGER = {"is_pinned": False, "is_same_size": True, "is_set_to": True, "is_contiguous": True,
          "is_non_overlapping_and_dense": True, "dense_dim": 2, "sparse_dim": 0}  # fmt: skip


@pytest.mark.parametrize("query", sorted(_QUERIES))
def test_a_metadata_query_answers_without_the_values(query):
    t = _uncomputable()
    assert _QUERIES[query](t) == _EAGER[query]
    assert is_deferred(t)


def test_is_pinned_computes_no_value():
    with meta_init():
        t = torch.randn(64, 64)
    value_cache.clear()
    assert t.is_pinned() is False
    assert len(value_cache) == 0  # a value read would have kept what it computed


def test_is_set_to_tells_views_of_one_storage_apart_by_geometry():
    with meta_init():
        w = torch.randn(4, 4)
    assert w.view(16).view(4, 4).is_set_to(w)
    assert not w.t().is_set_to(w)
    assert not w.is_set_to(torch.zeros(4, 4))


def test_a_deferred_tensor_made_with_pinned_memory_says_so():
    with meta_init():
        pinned = torch.empty(4, pin_memory=True)
        plain = torch.empty(4)
    assert pinned.is_pinned() and pinned[1:].is_pinned()
    assert not plain.is_pinned() and not (pinned + 1).is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_materialize_gives_pinned_memory_where_the_recording_says_pinned():
    from jupyter_metainit import materialize

    with meta_init():
        made = torch.empty(4, pin_memory=True).normal_()  # its creating op is dead: allocated
    assert made.is_pinned()
    materialize(made)
    assert made.is_pinned()


def test_a_dcp_save_reads_no_values_besides_the_ones_it_writes(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    torch.manual_seed(0)
    with meta_init():
        model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 4))
    value_cache.clear()
    save(model, tmp_path / "ours", format="dcp")
    assert len(value_cache) == 0  # planning computed nothing: every tensor generated once


def test_a_dcp_save_of_uncomputable_values_names_the_cause_not_is_pinned(tmp_path):
    pytest.importorskip("torch.distributed.checkpoint")
    with pytest.raises(MaterializationError, match="written after it was recorded") as caught:
        save({"t": _uncomputable()}, tmp_path / "ours", format="dcp")
    assert "is_pinned" not in str(caught.value)
