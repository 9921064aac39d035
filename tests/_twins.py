"""Build a model eagerly and deferred from the same seed, and compare them bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jupyter_metainit import meta_init


def eager_and_deferred(ctor: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    eager = ctor()
    torch.manual_seed(seed)
    with meta_init():
        deferred = ctor()
    return eager, deferred


def assert_same(a: nn.Module, b: nn.Module) -> None:
    """Same state-dict keys, every entry ``torch.equal``."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
