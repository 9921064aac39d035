"""Build the same model eagerly and under ``meta_init`` from one seed; compare them bit for bit.

The one helper for "eager twin" tests: ``build`` is a class, a function or any callable, called
with the arguments given after it, so every kind of build reads the same way::

    eager, deferred = eager_and_deferred(Net)                       # a class, no arguments
    eager, deferred = eager_and_deferred(nn.Linear, 4, 4, seed=3)   # a class and its arguments
    eager, deferred = eager_and_deferred(lambda: Net(n=6))          # a factory
    eager, deferred = eager_and_deferred(LlamaForCausalLM, config)  # a transformers config
    eager, deferred = eager_and_deferred(AutoModelForCausalLM.from_pretrained, path)
    eager, deferred = eager_and_deferred(Net, dtype=torch.bfloat16)  # meta_init(dtype=...)

``dtype`` and ``device`` are ``meta_init``'s: the eager twin is built under the same default
dtype (``torch.set_default_dtype``) and on the same device where it exists here, on the CPU
where it does not (a build for an absent GPU draws from the CPU's stream, as eager code on the
CPU does). :func:`deferred` is the deferred build alone, for tests that compare with something
else than an eager twin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from jupyter_metainit import meta_init
from jupyter_metainit.core import missing_device_reason, parse_device, parse_dtype

__all__ = ["assert_same", "deferred", "eager_and_deferred"]


def deferred(
    build: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | int | None = None,
    **kwargs: Any,
) -> Any:
    """``build(*args, **kwargs)`` under ``meta_init(device=device, dtype=dtype)``, from ``seed``."""
    torch.manual_seed(seed)
    with meta_init(device=device, dtype=dtype):
        return build(*args, **kwargs)


def eager_and_deferred(
    build: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | int | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``(eager, deferred)``: ``build(*args, **kwargs)`` eagerly, then deferred, each from
    ``seed``; the generator must be left where eager construction leaves it."""
    with _eager_defaults(dtype, device):
        torch.manual_seed(seed)
        eager = build(*args, **kwargs)
    after_eager = torch.get_rng_state()
    twin = deferred(build, *args, seed=seed, dtype=dtype, device=device, **kwargs)
    assert torch.equal(torch.get_rng_state(), after_eager), "RNG state differs after the build"
    return eager, twin


@contextlib.contextmanager
def _eager_defaults(dtype: torch.dtype | str | None, device: Any) -> Iterator[None]:
    """The default dtype and device an eager build has where ``meta_init`` would report them."""
    saved = torch.get_default_dtype()
    target = parse_device(device)
    if target is not None and missing_device_reason(target) is not None:
        target = torch.device("cpu")
    with torch.device(target) if target is not None else contextlib.nullcontext():
        if dtype is not None:
            torch.set_default_dtype(parse_dtype(dtype))
        try:
            yield
        finally:
            torch.set_default_dtype(saved)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    """Same state-dict keys, every entry ``torch.equal``."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
