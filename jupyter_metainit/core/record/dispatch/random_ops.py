"""A random op's place in its generator's stream, decided while recording.

:func:`place_random` hands the op to ``rng.streams`` (which keeps every generator's stream
positions) with a spec of its draws; an op whose draw count depends on the values it reads
runs now on the exact values of its inputs (:func:`_real_random_call`), so the stream after it
is exact whatever is materialized later.
"""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.record.dispatch.value_reads import values_of
from jupyter_metainit.core.record.graph import RngUse
from jupyter_metainit.core.record.ops import OpInfo, bind_arguments
from jupyter_metainit.core.record.state import tls
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.rng.draws import draws_depend_on_values, known_draws
from jupyter_metainit.core.rng.scratch import default_generator_for
from jupyter_metainit.core.rng.segments import BurnSpec
from jupyter_metainit.core.rng.streams import record_random
from jupyter_metainit.core.runtime.plain import iter_args, map_args, plain


def place_random(
    func: Any,
    meta_args: tuple,
    meta_kwargs: dict,
    has_generator: bool,
    generator: torch.Generator | None,
    nbytes: int,
    device: torch.device,
    real_call: tuple[tuple, dict, OpInfo] | None = None,
) -> tuple[RngUse, Any]:
    """The place of a new random op in its generator's stream (see ``record_random``),
    and the op's real outputs when its draw count depends on values (else None).

    ``device``: where the op's output is recorded; without an explicit generator the op draws
    from that device's default generator, as eagerly (``default_generator_for``).

    ``real_call``: the op's arguments and info, for an op whose draws may depend on the values
    it reads (``draws_depend_on_values``): its inputs are computed now and it runs from
    the exact generator state, so the stream after it is exact whatever is materialized later.
    """
    spec = BurnSpec(func, _spec_args(meta_args), _spec_kwargs(meta_kwargs), has_generator, nbytes)
    if generator is None:
        generator = default_generator_for(device)
    gen = generator if generator is not None else torch.default_generator
    run = None
    if (
        real_call is not None
        and draws_depend_on_values(func)
        and known_draws(spec, gen.device) is None
    ):
        run = _real_random_call(func, *real_call, gen.device)
    segment, index, outputs = record_random(generator, spec, flush_now=tls.depth == 0, run=run)
    return RngUse(segment, index), outputs


def _real_random_call(
    func: Any, args: tuple, kwargs: dict, info: OpInfo, device: torch.device
) -> Any:
    """``func`` on the real values of its inputs (computed now, on ``device``), as a function
    of the generator it draws from. Arguments it writes get copies: nothing real is changed."""
    deferred = [x for x in iter_args(args, kwargs) if isinstance(x, DeferredTensor)]
    values = values_of(deferred, func)
    by_id = {id(d): v.to(device) for d, v in zip(deferred, values, strict=True)}
    bound = bind_arguments(func, args, kwargs)
    written = {id(x) for i in info.mutated for x in iter_args((bound[i],), {})}

    def real_of(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            v = by_id[id(x)]
            return v.clone() if id(x) in written else v
        if isinstance(x, torch.device):
            return device
        return x

    a, k = map_args(real_of, args, kwargs)
    gi = info.arg_index("generator") if info.has_generator else None

    def run(gen: torch.Generator | None) -> Any:
        call_args, call_kwargs = list(a), dict(k)
        if gi is not None and gi < len(call_args):
            call_args[gi] = gen
        elif gi is not None:
            call_kwargs["generator"] = gen
        with plain():
            return func(*call_args, **call_kwargs)

    return run


def _spec_arg(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (torch.Generator, torch.device)):
        return None
    if isinstance(x, (list, tuple)):
        return type(x)(_spec_arg(v) for v in x)
    return x


def _spec_args(args: tuple) -> tuple:
    return tuple(_spec_arg(a) for a in args)


def _spec_kwargs(kwargs: dict) -> dict:
    return {k: _spec_arg(v) for k, v in kwargs.items() if k not in ("generator", "device")}
