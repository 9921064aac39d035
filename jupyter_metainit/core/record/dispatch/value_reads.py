"""Value reads while recording: ops that need the exact values of deferred tensors now.

``.item()``, ``bool(t)``, writing into a real tensor, ops with no meta kernel or a
data-dependent output shape, sparse and nested results: these run for real, on the CPU, on the
exact values of their deferred inputs, which the installed
:class:`~jupyter_metainit.core.record.value_reader.ValueReader` computes (by replay). The deferred
inputs stay deferred.

A deferred view of memory an earlier ``materialize`` made real (``realized``: a buffer
``w.data[2:4]`` after ``materialize(model.w)``) stands for that memory while nothing was recorded
on its storage since: an op on such views and real tensors only runs now on the memory
(:func:`run_on_real_memory`, as eagerly: a real result, an in-place op writes the memory); mixed
with other deferred inputs, each such view the op only reads becomes a constant of its values now
(:func:`realized_as_constants`; eager code computes at the time of the op, so later edits of the
memory must not reach the result).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import DispatchKey

from jupyter_metainit.core.errors import MetaInitError, UnsupportedOperatorError
from jupyter_metainit.core.record.dispatch.inputs import (
    call_site,
    device_of,
    meta_like,
    wrap_constant,
)
from jupyter_metainit.core.record.ops import OpInfo, Where
from jupyter_metainit.core.record.tensor import DeferredTensor, grad_leaves
from jupyter_metainit.core.record.value_reader import value_reader
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain


def run_on_values(func: Any, args: tuple, kwargs: dict) -> Any:
    """Ops that need data (``.item()``, ``bool(t)``, writing into a real tensor): compute the
    deferred inputs' exact values by replay, on the CPU, leaving them deferred."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = values_of(deferred, func)
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}
    a, k = map_args(lambda x: by_id.get(id(x), x), args, kwargs)
    with plain():
        return func(*a, **k)


def run_on_values_and_record_writes(
    func: Any, args: tuple, kwargs: dict, written: list[torch.Tensor]
) -> Any:
    """An op that writes real and deferred tensors together (``_foreach_add_([real,
    deferred], 1)``): it runs now on the deferred inputs' exact values, so the real tensors get
    their writes, and each written deferred tensor gets the values it came out with as a
    recorded ``copy_``."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = values_of(deferred, func)
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}
    a, k = map_args(lambda x: by_id.get(id(x), x), args, kwargs)
    with plain():
        out = func(*a, **k)
    for t in written:
        if isinstance(t, DeferredTensor):
            t.copy_(by_id[id(t)])
    # An output that is a written input is the deferred tensor itself, as eagerly.
    back = {id(v): d for d, v in zip(deferred, values, strict=True)}
    if isinstance(out, torch.Tensor):
        return back.get(id(out), out)
    if isinstance(out, (tuple, list)):
        return type(out)(back.get(id(o), o) for o in out)
    return out


def values_of(deferred: list[DeferredTensor], func: Any) -> list[torch.Tensor]:
    try:
        return value_reader().values([d._rec for d in deferred])
    except MetaInitError as e:
        raise UnsupportedOperatorError(
            f"{func} needs the values of its deferred inputs, and they cannot be computed: {e}; "
            f"called at {call_site()}"
        ) from e


def read_value(t: DeferredTensor) -> torch.Tensor:
    """The exact current values of a deferred tensor, as a new real CPU tensor."""
    return value_reader().values([t._rec])[0]


class NotStridedResult(Exception):
    """Carries the real result of an op whose output cannot be deferred (see below)."""

    def __init__(self, result: Any) -> None:
        self.result = result


def not_strided(out: Any) -> bool:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(
        isinstance(o, torch.Tensor) and (o.layout != torch.strided or o.is_nested) for o in outs
    )


def computed_not_strided(
    func: Any, args: tuple, kwargs: dict, device: torch.device, where: Where, real: Any = None
) -> Any:
    """Sparse and nested results (``torch.sparse_coo_tensor``, ``.to_sparse()``,
    ``torch.nested.nested_tensor``) have no deferred form: they are computed now, from the exact
    values of their deferred inputs, and returned as real CPU tensors (not deferred: materialize
    has nothing to do for them). On another device, a clear error."""
    layout = "nested" if kwargs.get("layout") is torch.jagged else "sparse or nested"
    if device.type != "cpu":
        raise UnsupportedOperatorError(
            f"{func} makes a {layout} tensor, which cannot be deferred, and it would be on "
            f"{device} (called at {where}); build it outside meta_init, or on the CPU "
            "(device='cpu') and move it after materializing"
        )
    if real is not None:
        return real
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = values_of(deferred, func)
    by_id = {id(d): v for d, v in zip(deferred, values, strict=True)}

    def real_of(x: Any) -> Any:
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return by_id.get(id(x), x)

    a, k = map_args(real_of, args, kwargs)
    with plain():
        return func(*a, **k)


VALUES_FOR_ERRORS = 64 << 20  # bytes of deferred inputs worth computing to check an error


def deferred_input_bytes(flat: list) -> int:
    storages = {id(x._rec.storage): x._rec.storage for x in flat if isinstance(x, DeferredTensor)}
    return sum(s.nbytes for s in storages.values())


def outputs_from_values(
    func: Any, info: OpInfo, args: tuple, kwargs: dict, where: Where
) -> tuple[Any, list[Any]]:
    """Outputs' metadata for an op with no meta kernel (or a data-dependent output shape):
    run it on the deferred inputs' exact values, on the CPU. Returns (meta outputs, values)."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    try:
        inputs = values_of(deferred, func)
    except UnsupportedOperatorError as e:
        raise UnsupportedOperatorError(
            f"{func} cannot run on deferred tensors (it has no meta kernel, and its inputs' "
            f"values cannot be computed); called at {where}. Build this part outside meta_init, "
            "or guard it with `if is_meta_init():`."
        ) from e
    by_id = {id(d): v for d, v in zip(deferred, inputs, strict=True)}

    def real_of(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            return by_id[id(x)]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    a, k = map_args(real_of, args, kwargs)
    if info.is_random:
        if not info.has_generator:
            raise UnsupportedOperatorError(
                f"{func} is random and has no meta kernel; it cannot be deferred (called at "
                f"{where})"
            )
        k = {**k, "generator": torch.Generator()}  # for the output's shape only: values unused
    with plain():
        real = func(*a, **k)
    reals = real if isinstance(real, (tuple, list)) else (real,)
    if not_strided(real):
        device = device_of(args, kwargs)
        raise NotStridedResult(computed_not_strided(func, args, kwargs, device, where, real))
    metas = []
    for i, r in enumerate(reals):
        alias = info.return_alias[i] if i < len(info.return_alias) else None
        if isinstance(r, torch.Tensor) and alias is not None:
            src = _bound_value(info, args, kwargs, alias)
            if isinstance(src, DeferredTensor) and tuple(r.shape) != tuple(src.shape):
                raise UnsupportedOperatorError(
                    f"{func} changes the shape of a deferred tensor in place ({tuple(src.shape)} "
                    f"-> {tuple(r.shape)}), called at {where}; use the out-of-place form"
                )
            metas.append(src._meta if isinstance(src, DeferredTensor) else meta_like(r))
        elif isinstance(r, torch.Tensor):
            metas.append(meta_like(r))
        else:
            metas.append(r)
    out = type(real)(metas) if isinstance(real, (tuple, list)) else metas[0]
    return out, [None] * len(reals) if info.is_random else list(reals)


def _bound_value(info: OpInfo, args: tuple, kwargs: dict, index: int) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(info.arg_names[index])


# Keys ``__torch_dispatch__`` runs with excluded (it is below autograd): ops run for real on
# real memory need them back, as in eager code (autograd for views that require grad, the
# lazy conjugate/negative bits of a view).
_EAGER_KEYS = (
    DispatchKey.AutogradFunctionality, DispatchKey.ADInplaceOrView, DispatchKey.AutogradOther,
    DispatchKey.Conjugate, DispatchKey.Negative, DispatchKey.ZeroTensor,
)  # fmt: skip


def as_eager() -> Any:
    """A guard under which real kernels dispatch as they do in eager code (see above): for ops
    run now on real memory, and for a replay that builds an autograd graph (``replay.grads``)
    while a value read runs it from inside a dispatch handler."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _EAGER_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def realized_inputs(flat: list) -> dict[int, torch.Tensor] | None:
    """The real view each deferred input of memory made real stands for (by ``id``), or
    ``None`` when there is none: one question to the value reader per deferred input, answered
    without a look-up when no storage was made real (a second one for a view that requires
    grad, in grad mode)."""
    reader = value_reader()
    found: dict[int, torch.Tensor] | None = None
    for x in flat:
        if isinstance(x, DeferredTensor):
            real = reader.real_view(x._rec, False)
            if real is not None and x._rg and x._derived and torch.is_grad_enabled():
                with as_eager():  # a view autograd records, as eager's view requiring grad
                    real = reader.real_view(x._rec, True)
            if real is not None:
                if found is None:
                    found = {}
                found[id(x)] = real
    return found


def own_grad_leaf(x: Any) -> bool:
    """Whether eager autograd would reach, from ``x``, a leaf that is still deferred (``x`` is
    one, or a view of one: a parameter of its own over memory made real, ``nn.Parameter(
    w.data)``) rather than the real tensor over its memory, in grad mode. No real graph can
    reach a deferred leaf, so an op on ``x`` is recorded, its values kept as a constant."""
    if not (isinstance(x, DeferredTensor) and x._rg and torch.is_grad_enabled()):
        return False
    if not x._derived:
        return True
    ref = grad_leaves.get(x._rec.storage)
    return ref is not None and isinstance(ref(), DeferredTensor)


def run_on_real_memory(func: Any, args: tuple, kwargs: dict, real: dict[int, torch.Tensor]) -> Any:
    """``func`` run now, as eager code runs it, with each deferred input replaced by the real
    view it stands for (``real``, by ``id``; all of them are in it): a real result, with
    autograd as eager's; an in-place op writes the memory and returns the deferred input
    itself, as eagerly."""
    grad = torch.is_grad_enabled()
    a, k = map_args(
        lambda x: real.get(id(x), x) if isinstance(x, DeferredTensor) else x, args, kwargs
    )
    with plain(), as_eager():
        torch._C._set_grad_enabled(grad)
        out = func(*a, **k)
    back = {
        id(v): d
        for d in iter_args(args, kwargs)
        if isinstance(d, DeferredTensor)
        for v in (real[id(d)],)
    }
    if isinstance(out, torch.Tensor):
        return back.get(id(out), out)
    if isinstance(out, (tuple, list)):
        return type(out)(back.get(id(o), o) for o in out)
    return out


def realized_as_constants(
    args: tuple, kwargs: dict, real: dict[int, torch.Tensor], written: set[int]
) -> tuple[tuple, dict]:
    """The arguments of an op mixing views of real memory with other deferred inputs: each
    view the op writes becomes that memory (the op then runs now, as one writing a real tensor
    does); each one it only reads, a deferred constant of its values now (a copy: later edits
    of the memory do not change what eager code computed), requiring grad as the view does."""
    kept: dict[int, torch.Tensor] = {}

    def replace(x: Any) -> Any:
        if not isinstance(x, DeferredTensor) or id(x) not in real:
            return x
        if id(x) in written:
            return real[id(x)]
        made = kept.get(id(x))
        if made is None:
            view = real[id(x)]
            with plain(), as_eager():  # resolves the lazy conjugate/negative bits too
                copy = torch.empty_like(view, device="cpu").copy_(view)
            made = kept[id(x)] = wrap_constant(copy, x.device)
            made._rg, made._derived = x._rg, True  # not a leaf: no link to the real tensor
        return made

    return map_args(replace, args, kwargs)
