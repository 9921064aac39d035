"""Ops on a deferred view of memory an earlier ``materialize`` made real run on that memory, as
in eager code (``record.dispatch.value_reads.realized_inputs``): their results are computed from the
memory's values at the time of the op, an in-place op writes the memory, and an op mixing such
a view with other deferred inputs keeps the view's values of that moment."""

from __future__ import annotations

import torch
from _twins import eager_and_deferred
from torch import nn

from jupyter_metainit import is_deferred, materialize, meta_init


class _Views(nn.Module):
    """A parameter, a buffer that is a view of it, and a view of it that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.register_buffer("w_view", self.w.data[2:4])
        self.w_t = self.w.t()  # a plain attribute: a view computed from the parameter
        self.other = nn.Parameter(torch.randn(2, 4))


def _edited() -> tuple[nn.Module, nn.Module]:
    """Eager and deferred twins; the deferred ``w`` materialized, then both edited in place."""
    eager, deferred = eager_and_deferred(_Views, seed=4)
    materialize(deferred.w)
    with torch.no_grad():
        deferred.w.mul_(2)
        eager.w.mul_(2)
    return eager, deferred


def test_op_on_the_view_uses_the_edited_memory() -> None:
    eager, deferred = _edited()
    y = deferred.w_view * 2
    materialize(y)
    assert torch.equal(y, eager.w_view * 2)


def test_op_on_the_view_gives_a_real_tensor_as_eagerly() -> None:
    _eager, deferred = _edited()
    y = deferred.w_view + 1
    assert not is_deferred(y)
    assert is_deferred(deferred.w_view)  # the view itself stays as it was


def test_item_after_an_op_on_the_view() -> None:
    eager, deferred = _edited()
    assert deferred.w_view.sum().item() == eager.w_view.sum().item()


def test_in_place_op_on_the_view_writes_the_memory() -> None:
    eager, deferred = _edited()
    deferred.w_view.add_(1)
    eager.w_view.add_(1)
    assert torch.equal(deferred.w, eager.w)  # the real parameter got the write
    materialize(deferred)
    assert torch.equal(deferred.w_view, eager.w_view)
    assert torch.equal(deferred.w, eager.w)
    assert deferred.w_view.untyped_storage().data_ptr() == deferred.w.untyped_storage().data_ptr()


def test_in_place_op_returns_the_view_itself() -> None:
    _eager, deferred = _edited()
    view = deferred.w_view
    assert view.mul_(3) is view


def test_edit_after_the_op_does_not_leak_into_its_result() -> None:
    eager, deferred = _edited()
    y, y_eager = deferred.w_view * 2, eager.w_view * 2
    with torch.no_grad():
        deferred.w.add_(5)
        eager.w.add_(5)
    materialize(y)
    assert torch.equal(y, y_eager)


def test_mixed_op_keeps_the_view_values_at_op_time() -> None:
    eager, deferred = _edited()
    z, z_eager = deferred.w_view * deferred.other, eager.w_view * eager.other
    assert is_deferred(z)  # ``other`` is still deferred
    with torch.no_grad():
        deferred.w.add_(5)
        eager.w.add_(5)
    materialize([deferred.other, z])
    assert torch.equal(z, z_eager)


def test_mixed_in_place_op_writes_the_memory() -> None:
    eager, deferred = _edited()
    with torch.no_grad():
        deferred.w_view.add_(deferred.other)
        eager.w_view.add_(eager.other)
    assert torch.equal(deferred.w, eager.w)
    materialize(deferred)
    assert torch.equal(deferred.w_view, eager.w_view)


def test_mixed_op_requires_grad_as_eagerly() -> None:
    eager, deferred = _edited()
    z = deferred.w_t[:, :2] * deferred.other.t()
    z_eager = eager.w_t[:, :2] * eager.other.t()
    assert z.requires_grad == z_eager.requires_grad
    materialize([deferred.other, z])
    assert torch.equal(z.detach(), z_eager.detach())


def test_op_on_a_view_requiring_grad_reaches_the_parameter() -> None:
    eager, deferred = _edited()
    y, y_eager = deferred.w_t * 3, eager.w_t * 3
    assert y.requires_grad and y.grad_fn is not None
    assert torch.equal(y.detach(), y_eager.detach())
    y.sum().backward()
    y_eager.sum().backward()
    assert torch.equal(deferred.w.grad, eager.w.grad)


def test_in_place_view_op_changes_the_deferred_view() -> None:
    eager, deferred = _edited()
    deferred.w_view.t_()
    eager.w_view.t_()
    assert deferred.w_view.shape == eager.w_view.shape
    materialize(deferred)
    assert torch.equal(deferred.w_view, eager.w_view)


def test_no_realized_memory_records_as_before() -> None:
    _eager, deferred = eager_and_deferred(_Views, seed=4)
    assert is_deferred(deferred.w_view * 2)


def test_whole_call_on_the_view_uses_the_edited_memory() -> None:
    eager, deferred = _edited()
    assert torch.equal(torch.linalg.norm(deferred.w_view), torch.linalg.norm(eager.w_view))


def test_init_function_in_meta_init_writes_the_memory() -> None:
    eager, deferred = _edited()
    torch.manual_seed(7)
    with torch.no_grad():
        nn.init.trunc_normal_(eager.w_view, std=0.02)
    torch.manual_seed(7)
    with meta_init(), torch.no_grad():
        nn.init.trunc_normal_(deferred.w_view, std=0.02)
    assert torch.equal(deferred.w, eager.w)
    materialize(deferred)
    assert torch.equal(deferred.w_view, eager.w_view)


def test_new_tensor_in_meta_init_is_recorded_from_the_values_at_op_time() -> None:
    eager, deferred = _edited()
    with meta_init():
        y = deferred.w_view * 2
    y_eager = eager.w_view * 2
    assert is_deferred(y)  # a new tensor inside meta_init, as from a real input
    with torch.no_grad():
        deferred.w.add_(5)
    materialize(y)
    assert torch.equal(y, y_eager)


class _SharedParameter(nn.Module):
    """Two parameters over one memory: eager autograd keeps them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.p = nn.Parameter(self.w.data)


def test_op_on_a_deferred_parameter_over_real_memory_keeps_its_values_and_grad() -> None:
    eager, deferred = eager_and_deferred(_SharedParameter, seed=4)
    materialize(deferred.w)
    with torch.no_grad():
        deferred.w.mul_(2)
        eager.w.mul_(2)
    y, y_eager = deferred.p * 2, eager.p * 2
    assert y.requires_grad and y_eager.requires_grad
    with torch.no_grad():
        deferred.w.add_(5)
    materialize(y)
    assert torch.equal(y.detach(), y_eager.detach())
    assert deferred.w.grad is None  # nothing of ``p``'s graph reaches ``w``


def _two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))


def test_a_fast_block_cast_then_freed_comes_back_with_eagers_values_when_exact() -> None:
    # freeing keeps a record of the cast: of the recording, not of the fast values in memory
    from jupyter_metainit import dematerialize
    from jupyter_metainit.core import tensor_values

    eager, deferred = eager_and_deferred(_two_linears, seed=0)
    materialize(deferred[0], rng="fast", keep_cache=True)
    materialize(deferred, rng="fast", dtype=torch.bfloat16, keep_cache=True)
    dematerialize(deferred)
    materialize(deferred, rng="exact", keep_cache=True)
    for got, want in zip(deferred.parameters(), eager.parameters(), strict=True):
        assert tensor_values(got) == "exact" and torch.equal(got, want.to(torch.bfloat16))
