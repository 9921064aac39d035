"""Gradients taken while recording (GradInit- and MetaInit-style code that calls
``torch.autograd.grad`` or ``backward`` in ``__init__``) materialize to eager's values."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init
from jupyter_metainit.core.errors import UnsupportedOperatorError


class GradInitNet(nn.Module):
    """GradInit-style: one loss on a seeded random batch, its gradients taken in ``__init__``,
    each weight rescaled by a tensor computed from its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
        loss = F.cross_entropy(self(x), y)
        grads = torch.autograd.grad(loss, list(self.parameters()))
        with torch.no_grad():
            for p, g in zip(self.parameters(), grads, strict=True):
                p.mul_(1.0 / (1.0 + g.norm()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.norm(self.fc1(x))))


def _gradient_quotient(loss: torch.Tensor, params: list, eps: float = 1e-5) -> torch.Tensor:
    """MetaInit's (Dauphin & Schoenholz, 2019) measure: second-order gradients."""
    grad = torch.autograd.grad(loss, params, retain_graph=True, create_graph=True)
    half_norm = sum((g**2).sum() / 2 for g in grad)
    prod = torch.autograd.grad(half_norm, params, retain_graph=True, create_graph=True)
    out = sum(
        ((g - p) / (g + eps * (2 * (g >= 0).float() - 1).detach()) - 1).abs().sum()
        for g, p in zip(grad, prod, strict=True)
    )
    return out / sum(p.data.nelement() for p in params)


class MetaInitNet(nn.Module):
    """MetaInit-style: a few steps that rescale each weight's norm by the sign of the gradient
    of the gradient quotient, read with ``.item()`` while recording."""

    def __init__(self, steps: int = 2, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 5)
        )
        params = [p for p in self.parameters() if p.dim() >= 2]
        memory = [0.0] * len(params)
        for _ in range(steps):
            x, y = torch.randn(16, 10), torch.randint(0, 5, (16,))
            quotient = _gradient_quotient(F.cross_entropy(self(x), y), list(self.parameters()))
            grads = torch.autograd.grad(quotient, params)
            for j, (p, g) in enumerate(zip(params, grads, strict=True)):
                norm = p.data.norm().item()
                step = torch.sign((p.data * g).sum() / norm)
                memory[j] = momentum * memory[j] - lr * step.item()
                p.data.mul_((norm + memory[j]) / norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class BackwardNet(nn.Module):
    """``loss.backward()`` twice (gradients accumulate) through a convolution, batch norm in
    training mode, an in-place ReLU and dropout, then one SGD step on the weights."""

    def __init__(self, clear: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)
        self.drop = nn.Dropout(0.2)
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
        for _ in range(2):
            F.cross_entropy(self(x), y).backward()
        with torch.no_grad():
            for p in self.parameters():
                p.sub_(0.1 * p.grad)
        if clear:
            self.zero_grad()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)), inplace=True)
        return self.fc(self.drop(h.flatten(1)))


def _assert_state_equal(got: nn.Module, expected: nn.Module) -> None:
    state = got.state_dict()
    for name, value in expected.state_dict().items():
        assert torch.equal(state[name], value), name


def test_gradinit_style_autograd_grad_in_init_materializes_as_eager():
    eager, model = eager_and_deferred(GradInitNet)
    assert is_deferred(model)
    materialize(model)
    _assert_state_equal(model, eager)
    assert all(p.is_leaf and p.requires_grad for p in model.parameters())


def test_metainit_style_second_order_gradients_in_init_materialize_as_eager():
    eager, model = eager_and_deferred(MetaInitNet)
    materialize(model)
    _assert_state_equal(model, eager)


def test_backward_in_init_through_batch_norm_dropout_and_an_inplace_relu_materializes_as_eager():
    eager, model = eager_and_deferred(BackwardNet)
    materialize(model)
    _assert_state_equal(model, eager)  # running statistics included
    assert all(p.grad is None for p in model.parameters())


def test_a_gradient_in_init_leaves_the_generator_where_eager_does():
    torch.manual_seed(0)
    BackwardNet()
    expected = torch.randn(4)
    torch.manual_seed(0)
    with meta_init():
        BackwardNet()
    assert torch.equal(torch.randn(4), expected)


def _gradients(defer: bool, create_graph: bool = False) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    with meta_init() if defer else contextlib.nullcontext():
        lin = nn.Linear(3, 2)
        loss = (torch.randn(4, 3) @ lin.weight.t() + lin.bias).tanh().pow(2).sum()
        return torch.autograd.grad(loss, [lin.weight, lin.bias], create_graph=create_graph)


def test_a_deferred_gradient_materializes_to_eager_gradient_with_its_layout():
    expected, got = _gradients(False), _gradients(True)
    assert all(is_deferred(g) and not g.requires_grad for g in got)
    materialize(list(got))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e) and g.stride() == e.stride()


def test_a_gradient_read_while_recording_has_eager_values():
    expected = [g.norm().item() for g in _gradients(False)]
    assert [g.norm().item() for g in _gradients(True)] == expected


def test_a_gradient_taken_with_create_graph_requires_grad_and_differentiates_again():
    def second_order(defer: bool) -> torch.Tensor:
        torch.manual_seed(1)
        with meta_init() if defer else contextlib.nullcontext():
            w = nn.Parameter(torch.randn(3, 3))
            loss = (torch.randn(5, 3) @ w.t()).pow(3).sum()
            (g,) = torch.autograd.grad(loss, [w], create_graph=True)
            assert g.requires_grad
            return torch.autograd.grad((g**2).sum(), [w])[0]

    got = second_order(True)
    assert torch.equal(materialize(got), second_order(False))


def test_a_gradient_with_respect_to_an_intermediate_and_a_parameter_is_eager_total_gradient():
    def grads(defer: bool) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(2)
        with meta_init() if defer else contextlib.nullcontext():
            lin = nn.Linear(4, 4)
            hidden = lin(torch.randn(3, 4))
            loss = (hidden.sin() * lin.weight.sum()).sum()
            return torch.autograd.grad(loss, [hidden, lin.weight])

    got = grads(True)
    materialize(list(got))
    assert all(torch.equal(g, e) for g, e in zip(got, grads(False), strict=True))


def test_the_deferred_gradients_backward_leaves_in_grad_materialize_to_eager_gradients():
    eager, model = eager_and_deferred(lambda: BackwardNet(clear=False))
    grads = [p.grad for p in model.parameters()]  # the objects themselves
    assert all(is_deferred(g) for g in grads)
    materialize(grads)
    for g, p in zip(grads, eager.parameters(), strict=True):
        assert torch.equal(g, p.grad)


def test_materializing_a_model_gives_each_parameter_the_grad_backward_left_in_init():
    eager, model = eager_and_deferred(lambda: BackwardNet(clear=False))
    grads = [p.grad for p in model.parameters()]
    materialize(model)
    _assert_state_equal(model, eager)
    for (name, p), e, g in zip(model.named_parameters(), eager.parameters(), grads, strict=True):
        assert p.grad is g and not is_deferred(g), name  # the same object, made real
        assert torch.equal(p.grad, e.grad), name


def test_materializing_one_parameter_gives_it_its_grad_cast_as_asked():
    eager, model = eager_and_deferred(lambda: BackwardNet(clear=False))
    materialize(model.fc.weight, dtype=torch.bfloat16)
    assert model.fc.weight.grad.dtype == torch.bfloat16
    assert torch.equal(model.fc.weight.grad, eager.fc.weight.grad.bfloat16())
    assert is_deferred(model.conv.weight.grad)  # not asked for: still deferred with its tensor


def test_an_input_used_only_through_detach_gets_no_gradient_as_eagerly():
    with meta_init():
        w = nn.Parameter(torch.randn(3))
        v = nn.Parameter(torch.randn(3))
        loss = (w * v.detach()).sum()
        assert torch.autograd.grad(loss, [w, v], allow_unused=True)[1] is None
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
            torch.autograd.grad(loss, [w, v])


def test_the_gradient_of_an_output_that_does_not_require_grad_raises_eager_error():
    with meta_init():
        w = nn.Parameter(torch.randn(3))
        loss = w.detach().sum()
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(loss, [w])


def test_a_gradient_with_respect_to_a_view_says_to_take_it_for_the_tensor_it_views():
    with meta_init():
        w = nn.Parameter(torch.randn(4, 3))
        rows = w[:2]
        loss = rows.sum()
        with pytest.raises(UnsupportedOperatorError, match=r"view of a larger tensor.*slice it"):
            torch.autograd.grad(loss, [rows])


def test_backward_on_a_deferred_model_after_meta_init_fills_grad_with_eager_values():
    def grads(defer: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        with meta_init() if defer else contextlib.nullcontext():
            m = nn.Linear(3, 1)
        m(torch.ones(2, 3)).sum().backward()  # outside the block: recorded all the same
        return [m.weight.grad, m.bias.grad]

    got = grads(True)
    materialize(got)
    assert all(torch.equal(g, e) for g, e in zip(got, grads(False), strict=True))


def test_a_gradient_through_a_sparse_embedding_says_to_build_it_dense_or_materialize_first():
    with meta_init():
        embedding = nn.Embedding(10, 3, sparse=True)
        loss = embedding(torch.tensor([1, 2, 2])).sum()
        with pytest.raises(UnsupportedOperatorError, match=r"sparse=True.*sparse=False"):
            loss.backward()
    assert embedding.weight.grad is None
