"""Build a model eagerly and deferred from the same seed, and compare them bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jupyter_metainit import meta_init


def eager_and_deferred(ctor: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """Both builds from ``seed``; the generator must be left where eager construction leaves it."""
    torch.manual_seed(seed)
    eager = ctor()
    after_eager = torch.get_rng_state()
    torch.manual_seed(seed)
    with meta_init():
        deferred = ctor()
    assert torch.equal(torch.get_rng_state(), after_eager), "RNG state differs after the build"
    return eager, deferred


def assert_same(a: nn.Module, b: nn.Module) -> None:
    """Same state-dict keys, every entry ``torch.equal``."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
