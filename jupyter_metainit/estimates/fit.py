"""Which parts of a model fit a device's memory, at the dtype you would materialize them in."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from jupyter_metainit.core import available_memory, meta_init, parse_path, parse_size
from jupyter_metainit.core.errors import ArgumentError
from jupyter_metainit.estimates._arguments import check_budget, check_device, require_module
from jupyter_metainit.estimates.memory import memory_table

__all__ = ["fits"]


def parse_bytes(budget: int | float | str) -> int:
    """``"24GiB"`` -> 25769803776, ``"80GB"`` -> 80000000000, numbers are bytes (the core's
    one size grammar, ``parse_size``)."""
    return parse_size(budget, "budget")


def device_budget(device: str | torch.device) -> int:
    """Free memory of ``device`` in bytes: CUDA free memory, or the host's available memory."""
    dev = check_device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArgumentError(
                f"no CUDA device here to measure {dev}; pass budget= (e.g. '80GiB')"
            )
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    if dev.type == "cpu":
        available = available_memory()
        if available is None:
            raise ArgumentError("cannot read the available host memory; pass budget=")
        return available
    raise ArgumentError(f"cannot measure free memory of {dev}; pass budget=")


# What a hub name never looks like: a local path (hub names are "org/name").
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".gguf", ".h5")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # huggingface_hub's repo ids


def _looks_local(path: str) -> bool:
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") > 1
        or "\\" in path
        or path.lower().endswith(_FILE_SUFFIXES)
    )


def _model_from_path(path: str) -> nn.Module:
    """An empty (deferred) model from a local directory or hub name with a transformers config."""
    local = Path(parse_path(path, "fits()"))
    if local.is_file():
        raise ArgumentError(
            f"fits({path!r}): that is a file; pass the model's directory (the one with its "
            "config.json), a hub name such as 'meta-llama/Llama-3.1-8B', or the model object"
        )
    if not local.exists() and _looks_local(path):
        raise FileNotFoundError(
            f"fits({path!r}): no such file or directory; pass an existing model directory "
            "(with a config.json), a hub name such as 'meta-llama/Llama-3.1-8B', or the model "
            "object"
        )
    if not local.exists() and not _HUB_NAME.fullmatch(path):  # never asked of the hub
        raise ArgumentError(
            f"fits({path!r}): no directory {path!r} here, and a hub name is 'org/name'; pass "
            "an existing model directory (with a config.json), a hub name such as "
            "'meta-llama/Llama-3.1-8B' (older names are under an org now: 'gpt2' is "
            "'openai-community/gpt2'), or the model object"
        )
    import transformers  # optional: only hub names and model folders need it

    config = transformers.AutoConfig.from_pretrained(path)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with meta_init():
        if cls is None:
            return transformers.AutoModel.from_config(config)
        return cls(config)


def fits(
    module_or_path: nn.Module | str,
    device: str | torch.device | int = "cuda:0",
    budget: int | float | str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    depth: int | None = None,
) -> pd.DataFrame:
    """Say which subtrees of a model fit a memory budget.

    Use it before materializing, to choose what can go on a GPU (or into host memory): one
    row per module says whether its weights and buffers fit and by how much. Weights only:
    add activations from :func:`dry_run` (``peak_forward_bytes``) when the module will also
    run there, or plan a whole workload over several devices with
    :func:`~jupyter_metainit.place`.

    Args:
        module_or_path: a model (deferred, partial or real) or a local directory / hub name
            (``"org/name"``) with a transformers config (an empty model is built from it, as
            ``accelerate estimate-memory`` does).
        device: the device whose free memory is the budget when ``budget`` is ``None``
            (CUDA free memory, or available host memory for ``"cpu"``): a device, its name,
            or a GPU index.
        budget: bytes, or a size such as ``"24GiB"`` (2**30 bytes a GiB) or ``"80GB"``
            (10**9); ``None`` measures ``device``.
        dtype: the dtype you will materialize in (``torch.bfloat16``, ``"int8"`` ...);
            floating tensors are counted at that size.
        depth: keep only rows down to this depth.

    Returns:
        A pandas DataFrame, one row per module (tree order): ``type``, ``depth``,
        ``children``, ``total_bytes`` (weights + buffers at ``dtype``), ``fits`` (bool) and
        ``headroom_bytes`` (budget - size, negative when it does not fit). ``attrs`` hold the
        budget, device and dtype.

    Raises:
        ArgumentError: ``budget`` is not a size, ``device`` is not a device, or no budget
            was given for a device that is not here to measure.
        ArgumentTypeError: ``module_or_path`` is neither a module nor a string.
        FileNotFoundError: ``module_or_path`` is a word that is neither a directory here nor
            a hub name (refused at once, before any download).

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import fits, meta_init
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
        >>> fits(model, "cuda:0", "20MiB")  # each Linear fits 20 MiB, the whole does not
                      type  depth  children  total_bytes   fits  headroom_bytes
        module
                Sequential      0         3     33574912  False       -12603392
        0           Linear      1         0     16793600   True         4177920
        1             ReLU      1         0            0   True        20971520
        2           Linear      1         0     16781312   True         4190208
    """
    module = _model_from_path(module_or_path) if isinstance(module_or_path, str) else module_or_path
    require_module(module, "fits", also=" or a model directory / hub name")
    device = check_device(device)
    limit = check_budget(parse_bytes(budget), budget) if budget is not None else None
    if limit is None:
        limit = device_budget(device)
    table = memory_table(module, depth=depth, dtype=dtype)
    result = pd.DataFrame(
        {
            "type": table["type"],
            "depth": table["depth"],
            "children": table["children"],
            "total_bytes": table["total_bytes"],
            "fits": table["total_bytes"] <= limit,
            "headroom_bytes": limit - table["total_bytes"],
        }
    )
    result.attrs.update(
        {"budget_bytes": limit, "device": str(device), "dtype": table.attrs.get("dtype")}
    )
    return result
