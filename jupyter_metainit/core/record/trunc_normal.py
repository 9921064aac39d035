"""``nn.init.trunc_normal_`` inside ``meta_init``: recorded as the ``normal_`` it equals.

When to use it: ``meta_init`` installs :func:`trunc_normal_` in place of ``torch.nn.init``'s for
the duration of a block. ViT, Swin and most vision code call it on every weight.

Why: PyTorch's ``trunc_normal_`` draws ``normal_`` values and then reads them (``mask.any()``) to
decide whether to redraw the ones outside ``[a, b]``. Recorded op by op, each call is a dozen
intercepted ops and an exact replay for the read: several times the eager cost. With the usual
bounds (``std=0.02``, ``a=-2``, ``b=2``) nothing is ever redrawn, and the result is exactly the
first ``normal_``, recorded as such: replay can split it across cores, skip it when overwritten,
and generate it shard by shard.

Whether anything is redrawn is known without a read when the bounds lie beyond any value
PyTorch's CPU ``normal_`` can return: it is Box-Muller on uniforms of at most 53 bits, so no
value is further than sqrt(2 · 53 · ln 2) ≈ 8.6 std from the mean. Bounds 100 std away, as in
ViT and Swin, cost no random work at build time. Closer bounds are read here, on scratch
memory, from the generator's exact state (the same random work as eager). If a value is out of
bounds, and for every case this does not cover, PyTorch's own function runs and is recorded op
by op, as before.

The equivalence is a property of PyTorch's implementation, so it is checked once per process on
real tensors (values and generator state, with and without redraws) before it is used.
"""

from __future__ import annotations

import math

import torch

from jupyter_metainit.core.record.state import tls
from jupyter_metainit.core.record.tensor import DeferredTensor
from jupyter_metainit.core.record.value_reader import value_reader
from jupyter_metainit.core.rng.streams import exact_state, settle
from jupyter_metainit.core.runtime.plain import plain

__all__ = ["trunc_normal_"]

_original = torch.nn.init.trunc_normal_
_verified: bool | None = None


def _bounds(dtype: torch.dtype, a: float, b: float) -> tuple[float, float]:
    # As PyTorch compares: the bounds rounded to the tensor's dtype. Real tensors, even inside a
    # block (recorded, each would be a deferred constant and a replay to read it).
    with plain():
        return torch.tensor(a, dtype=dtype).item(), torch.tensor(b, dtype=dtype).item()


# No value of PyTorch's CPU ``normal_`` is this many std from its mean (8.6 is the most; see the
# module docstring). The margin covers rounding to the tensor's dtype and a future uniform of
# 64 bits (9.4 std).
_UNREACHABLE_STDS = 12.0


def _bounds_unreachable(dtype: torch.dtype, mean: float, std: float, a: float, b: float) -> bool:
    # The mean within a million std: the kernel's float arithmetic on mean + z * std (errors of
    # about |mean| * 2**-24) then cannot eat the 3.4 std margin. The final rounding to the
    # tensor's dtype cannot cross a bound: the bounds are compared as values of that dtype.
    if not abs(mean) <= 1e6 * std:
        return False
    lo, hi = _bounds(dtype, a, b)
    return lo <= mean - _UNREACHABLE_STDS * std and mean + _UNREACHABLE_STDS * std <= hi


def _first_draw_mass(mean: float, std: float, a: float, b: float) -> float:
    def norm_cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    return norm_cdf((b - mean) / std) - norm_cdf((a - mean) / std)


def _equals_first_normal(values: torch.Tensor, mean: float, std: float, a: float, b: float) -> bool:
    """Whether ``trunc_normal_`` keeps ``values``, its first ``normal_(mean, std)`` draw."""
    lo, hi = _bounds(values.dtype, a, b)
    if values.numel() == 0:
        return True
    # One pass instead of PyTorch's ``((values < lo) | (values > hi)).any()``; aminmax gives
    # NaN if any value is NaN, and then PyTorch's own function decides.
    low, high = (float(v) for v in torch.aminmax(values))
    return lo <= low and high <= hi


def _implementation_verified() -> bool:
    """Checked once per process: when nothing is out of bounds, PyTorch's ``trunc_normal_``
    is exactly one ``normal_`` (values and generator state), and when something is, it is not."""
    global _verified
    if _verified is None:
        cases = [(torch.float32, (64, 3), 0.0, 0.02, -2.0, 2.0, s) for s in range(2)]
        cases += [(torch.bfloat16, (33,), 0.1, 0.02, -2.0, 2.0, 0)]
        cases += [(torch.float32, (8,), 0.0, 1.0, -2.0, 2.0, s) for s in range(16)]
        outcomes = set()
        with plain():
            for dtype, size, mean, std, a, b, seed in cases:
                g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
                real = _original(torch.empty(size, dtype=dtype), mean, std, a, b, generator=g1)
                first = torch.empty(size, dtype=dtype).normal_(mean, std, generator=g2)
                same = torch.equal(real, first) and torch.equal(g1.get_state(), g2.get_state())
                predicted = _equals_first_normal(first, mean, std, a, b)
                outcomes.add(predicted)
                if same != predicted:
                    _verified = False
                    return False
        _verified = outcomes == {True, False}
    return _verified


def trunc_normal_(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``torch.nn.init.trunc_normal_``, recorded as one ``normal_`` where that is exact."""
    gen = generator if generator is not None else torch.default_generator
    if not (
        tls.depth > 0
        and isinstance(tensor, DeferredTensor)
        and value_reader().real_view(tensor._rec, False) is None  # else eager's, on its memory
        and tensor.device.type == "cpu"
        and gen.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.dtype.is_floating_point
        and a - 2 * std <= mean <= b + 2 * std  # else PyTorch warns: let it
        and _first_draw_mass(mean, std, a, b) > 0.3  # PyTorch's normal_-then-redraw branch
        and _implementation_verified()
    ):
        return _original(tensor, mean, std, a, b, generator=generator)
    if _bounds_unreachable(tensor.dtype, mean, std, a, b):
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator)
    with plain():
        scratch_gen = torch.Generator()
        scratch_gen.set_state(exact_state(gen))
        scratch = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        scratch.normal_(mean, std, generator=scratch_gen)
        kept = _equals_first_normal(scratch, mean, std, a, b)
    if not kept:
        return _original(tensor, mean, std, a, b, generator=generator)
    with torch.no_grad():
        tensor.normal_(mean, std, generator=generator)
    last = tensor._rec.storage.writes[-1]
    if last.rng is not None and last.func is torch.ops.aten.normal_.default:
        settle(last.rng.segment, last.rng.index, scratch_gen.get_state())
    return tensor
