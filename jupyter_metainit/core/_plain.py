"""Run real tensor code with every interception switched off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """No torch-function modes/subclasses, no dispatch modes, no autograd: real kernels only.

    Replay and internal bookkeeping use it so that an active ``meta_init`` (or a user's own mode,
    such as a FLOP counter) neither records nor counts our own work.
    """
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
        yield
