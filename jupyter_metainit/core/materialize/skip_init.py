"""``skip_init``: a module with uninitialised (``torch.empty``) parameters and buffers."""

from __future__ import annotations

from typing import Any

import torch

from jupyter_metainit.core.errors import ArgumentTypeError
from jupyter_metainit.core.materialize.queries import iter_deferred
from jupyter_metainit.core.materialize.user_state import copy_user_attributes
from jupyter_metainit.core.record.context import meta_init
from jupyter_metainit.core.record.tensor import as_parameter
from jupyter_metainit.core.runtime.plain import plain
from jupyter_metainit.core.runtime.swap import swap_in_place


def skip_init(module_cls: type[torch.nn.Module], *args: Any, **kwargs: Any) -> torch.nn.Module:
    """Instantiate ``module_cls(*args, **kwargs)`` without initialising parameters or buffers.

    Use it when you will overwrite every value anyway (loading weights, a custom init): the
    constructor's initialisation is recorded and dropped instead of computed, so the module
    costs its memory and nothing more. Unlike ``torch.nn.utils.skip_init`` the module needs no
    ``device`` argument.

    Args:
        module_cls: a ``torch.nn.Module`` subclass.
        *args: the constructor's positional arguments.
        **kwargs: the constructor's keyword arguments, and ``device=``: where the empty
            tensors are allocated (default ``"cpu"``).

    Returns:
        The module, real, its parameters and buffers allocated with ``torch.empty`` (arbitrary
        values) on ``device``.

    Raises:
        ArgumentTypeError: ``module_cls`` is not an ``nn.Module`` subclass.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from jupyter_metainit import is_deferred, skip_init
        >>> layer = skip_init(nn.Linear, 1024, 1024)  # no kaiming_uniform_ computed
        >>> layer.weight.shape, is_deferred(layer)
        (torch.Size([1024, 1024]), False)
        >>> with torch.no_grad():
        ...     _ = layer.weight.copy_(torch.eye(1024))  # your values
    """
    if not (isinstance(module_cls, type) and issubclass(module_cls, torch.nn.Module)):
        raise ArgumentTypeError(
            f"skip_init(module_cls) takes a torch.nn.Module subclass (the class, not an "
            f"instance); got {module_cls!r}"
        )
    device = torch.device(kwargs.pop("device", "cpu"))
    with meta_init(device=device):
        module = module_cls(*args, **kwargs)
    for t in iter_deferred(module):
        with plain():
            empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        real: torch.Tensor
        real = as_parameter(t, empty, t._rg) if getattr(t, "_is_param", False) else empty
        copy_user_attributes(t, real)
        swap_in_place(t, real)
    return module
