"""Sparse tensors in deferred models: a sparse adjacency built in ``__init__`` comes out as
eager's, and a forward that reads a sparse buffer, or never does, runs in ``dry_run`` and
``place``."""

from __future__ import annotations

import warnings

import pytest
import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import dry_run, materialize, meta_init, place
from jupyter_metainit.core import DeferredTensor
from jupyter_metainit.core.errors import UnsupportedOperatorError

NODES, FEATURES = 12, 8


@pytest.fixture(autouse=True)
def _quiet_sparse_invariant_warning():
    # PyTorch warns once per process that sparse invariant checks are off, and that CSR is beta.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        yield


class GraphConv(nn.Module):
    """A two-layer GCN over a random graph: the symmetric normalized adjacency
    ``D^-1/2 (A + I) D^-1/2`` is built in ``__init__`` from index tensors and kept as a sparse
    buffer, which the forward multiplies with the features."""

    def __init__(self, layout: torch.layout = torch.sparse_coo) -> None:
        super().__init__()
        src = torch.randint(0, NODES, (30,))
        dst = torch.randint(0, NODES, (30,))
        loops = torch.arange(NODES)
        rows, cols = torch.cat([src, dst, loops]), torch.cat([dst, src, loops])
        weights = torch.rand(rows.numel())
        adj = torch.sparse_coo_tensor(torch.stack([rows, cols]), weights, (NODES, NODES))
        adj = adj.coalesce()
        norm = torch.sparse.sum(adj, 1).to_dense().rsqrt()
        i = adj.indices()
        adj = torch.sparse_coo_tensor(i, adj.values() * norm[i[0]] * norm[i[1]], adj.shape)
        adj = adj.coalesce()
        self.register_buffer("adj", adj.to_sparse_csr() if layout == torch.sparse_csr else adj)
        self.lin1 = nn.Linear(FEATURES, 16)
        self.lin2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(self.adj, self.lin1(x)))
        return self.adj @ self.lin2(h)


class WhisperLike(nn.Module):
    """Whisper keeps which cross-attention heads align with the audio as a non-persistent
    sparse buffer that its forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        heads = torch.tensor([[0, 1, 3], [2, 5, 1]])
        alignment = torch.sparse_coo_tensor(heads, torch.ones(3, dtype=torch.bool), (4, 6))
        self.register_buffer("alignment_heads", alignment, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).softmax(-1)


def _assert_same_sparse(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.layout == expected.layout
    assert torch.equal(got.to_dense(), expected.to_dense())
    if expected.layout == torch.sparse_coo:
        assert got.is_coalesced() == expected.is_coalesced()
        assert torch.equal(got.indices(), expected.indices())
        assert torch.equal(got.values(), expected.values())
    else:
        assert torch.equal(got.crow_indices(), expected.crow_indices())
        assert torch.equal(got.col_indices(), expected.col_indices())
        assert torch.equal(got.values(), expected.values())


def test_dry_run_of_a_model_with_a_sparse_buffer_its_forward_never_reads_runs():
    _, model = eager_and_deferred(WhisperLike)
    table = dry_run(model, torch.randn(2, 16))
    assert table.loc["proj", "output_shape"] == (2, 16)
    assert model.alignment_heads.layout == torch.sparse_coo  # left as it was


def test_place_of_a_model_with_a_sparse_buffer_its_forward_never_reads_fits():
    _, model = eager_and_deferred(WhisperLike)
    assert place(model, {"cpu": "1GiB"}, inputs=[(2, 16)]).fits


def test_sparse_coo_adjacency_built_in_init_materializes_as_eager():
    eager, model = eager_and_deferred(GraphConv)
    materialize(model)
    _assert_same_sparse(model.adj, eager.adj)
    for name, p in eager.named_parameters():
        assert torch.equal(model.get_parameter(name), p), name
    x = torch.randn(NODES, FEATURES)
    assert torch.equal(model(x), eager(x))


def test_sparse_csr_adjacency_built_in_init_materializes_as_eager():
    eager, model = eager_and_deferred(lambda: GraphConv(torch.sparse_csr))
    materialize(model)
    _assert_same_sparse(model.adj, eager.adj)
    x = torch.randn(NODES, FEATURES)
    assert torch.equal(model(x), eager(x))


def test_building_a_random_sparse_graph_leaves_the_generator_where_eager_does():
    torch.manual_seed(0)
    GraphConv()
    expected = torch.randn(4)
    torch.manual_seed(0)
    with meta_init():
        GraphConv()
    assert torch.equal(torch.randn(4), expected)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_dry_run_of_a_graph_model_reading_its_sparse_adjacency_gives_eager_shapes(layout):
    _, model = eager_and_deferred(lambda: GraphConv(layout))
    table = dry_run(model, (NODES, FEATURES))
    assert table.loc["", "output_shape"] == (NODES, 4)
    assert table.loc["lin1", "output_shape"] == (NODES, 16)
    assert isinstance(model.lin1.weight, DeferredTensor)  # still deferred


class _Precomputed(GraphConv):
    """Features propagated through the adjacency once, in ``__init__``: products of the real
    sparse adjacency and deferred dense tensors."""

    def __init__(self) -> None:
        super().__init__()
        features = torch.randn(NODES, FEATURES)
        self.register_buffer("smoothed", torch.sparse.mm(self.adj, features))
        self.register_buffer("two_hops", self.adj @ (self.adj @ features))
        self.register_buffer("degree_scaled", torch.mv(self.adj, torch.rand(NODES)))
        self.register_buffer("masked", self.adj * torch.rand(NODES, NODES))  # a sparse result


def test_dense_tensors_computed_in_init_from_a_sparse_adjacency_materialize_exactly():
    eager, model = eager_and_deferred(_Precomputed)
    assert isinstance(model.smoothed, DeferredTensor)
    assert model.smoothed.stride() == eager.smoothed.stride()
    materialize(model)
    for name in ("smoothed", "two_hops", "degree_scaled"):
        assert torch.equal(getattr(model, name), getattr(eager, name)), name
    _assert_same_sparse(model.masked, eager.masked)


def test_a_sparse_tensor_cast_or_moved_to_the_cpu_inside_meta_init_stays_real():
    with meta_init():
        adj = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2))
        moved = adj.to(device="cpu")
        cast = adj.to(torch.float64)
    assert type(moved) is torch.Tensor and moved.layout == torch.sparse_coo
    assert type(cast) is torch.Tensor and cast.dtype == torch.float64
    assert torch.equal(moved.to_dense(), torch.eye(2).flip(0))


def test_moving_a_sparse_tensor_to_a_gpu_inside_meta_init_says_to_move_it_after_materializing():
    with meta_init():
        adj = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (2, 2))
        with pytest.raises(UnsupportedOperatorError, match=r"stay real CPU.*after materializing"):
            adj.to(device="cuda:0")
