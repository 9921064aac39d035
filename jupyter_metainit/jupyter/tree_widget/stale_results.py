"""Which tensors a Values or Compare result is about, and results whose tensors changed since
they were measured: dropped.

A result describes the tensors as they were when it was measured. Once one of them is
materialized (``rng="fast"`` gives other values), freed, replaced or edited in place, the
columns, colours and charts would go on showing the old figures with nothing to say so. The
widget keeps a print of what each result measured (each tensor's identity, and for a real one
its device, version counter, which every in-place op bumps, and where its values lie, which
``p.data = other`` changes) and, after each cell and each change the core publishes, drops a
result whose print no longer holds, saying why.

A write through ``.data`` (``p.data.copy_(w)``, ``p.data.mul_(2)``) bumps no version counter and
moves nothing: a result of real tensors of up to ``DIGEST_BYTES`` in all also keeps a digest of
their bytes (CRC-32 on the CPU, about 1 GB/s a core, position-weighted sums on a device),
taken again after each cell. A larger result's in-place ``.data`` writes are not seen.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch

from jupyter_metainit.core import is_deferred, local_tensor

if TYPE_CHECKING:
    from jupyter_metainit.jupyter.tree_widget.host import WidgetHost

__all__ = ["DIGEST_BYTES", "drop_stale_results", "remember_measured", "scoped_state", "under"]

#: A result's real tensors up to this many bytes in all are also digested (about 0.1 s a check).
DIGEST_BYTES = 128 << 20
_CHUNK = 64 << 20
_DEVICE_CHUNK = 1 << 20

# The widget's traits holding results, and how the notice names each.
_RESULTS = {"values": "Values", "comparison": "Compare"}


def under(name: str, scope: list[str]) -> bool:
    """Whether tensor or module ``name`` lies inside one of the subtrees ``scope``."""
    return any(name.startswith(s + ".") for s in scope)


def scoped_state(module: torch.nn.Module, scope: list[str]) -> dict[str, torch.Tensor]:
    """The tensors a Values or Compare of ``scope`` (ticked subtrees; none: the whole model)
    is about, by ``state_dict`` name: the tensors themselves (no detach recorded per tensor)."""
    state = module.state_dict(keep_vars=True)
    return {k: v for k, v in state.items() if under(k, scope)} if scope else dict(state)


def _print(state: dict[str, torch.Tensor]) -> tuple:
    out: list[tuple] = []
    for name, t in state.items():
        local = local_tensor(t)
        if is_deferred(local):
            out.append((name, id(t), "deferred"))
        else:
            # ``p.data = w`` keeps the version counter; it moves the values (or reshapes them)
            where = (local.data_ptr(), local.dtype, tuple(local.shape), local.stride())
            out.append((name, id(t), str(local.device), local._version, where))
    return tuple(out)


def _real(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    tensors: dict[int, torch.Tensor] = {}
    for t in state.values():
        local = local_tensor(t)
        if not is_deferred(local):
            tensors.setdefault(id(local), local)  # a tied tensor once
    return list(tensors.values())


def _digest(t: torch.Tensor) -> tuple[int, ...]:
    """Every byte of ``t``'s elements' span: CRC-32 on the CPU, weighted sums on a device."""
    t = t.detach()
    span = t.contiguous() if not t.is_contiguous() else t
    raw = span.reshape(-1).view(torch.uint8) if span.numel() else span.new_empty(0).byte()
    if raw.device.type == "cpu":
        view = memoryview(raw.numpy())
        return tuple(zlib.crc32(view[i : i + _CHUNK]) for i in range(0, raw.numel(), _CHUNK))
    # On a device, small parts: each part's int64 copy and its weights are 16 times its bytes
    # of device memory, which a user's full GPU may not have to spare.
    weights = torch.arange(1, _DEVICE_CHUNK + 1, device=raw.device, dtype=torch.int64)
    sums = []
    for i in range(0, raw.numel(), _DEVICE_CHUNK):
        part = raw[i : i + _DEVICE_CHUNK].to(torch.int64)
        sums.append((part * weights[: part.numel()]).sum())
    return tuple(torch.stack(sums).tolist()) if sums else ()


def _digests(state: dict[str, torch.Tensor]) -> tuple | None:
    """The digests of the result's real tensors, or None past DIGEST_BYTES (not taken)."""
    tensors = _real(state)
    if sum(t.numel() * t.element_size() for t in tensors) > DIGEST_BYTES:
        return None
    with torch.no_grad():
        return tuple(_digest(t) for t in tensors)


def remember_measured(widget: WidgetHost, trait: str, scope: list[str]) -> None:
    """After ``trait`` (``"values"`` or ``"comparison"``) was set: what it measured."""
    state = scoped_state(widget.module, scope)
    widget._measured[trait] = (scope, _print(state), _digests(state))


def _changed(widget: WidgetHost, scope: list[str], measured: tuple, digests: tuple | None) -> bool:
    state = scoped_state(widget.module, scope)
    if _print(state) != measured:
        return True
    return digests is not None and _digests(state) != digests


def drop_stale_results(widget: WidgetHost) -> str:
    """Clear each result whose tensors changed since; the notice to show, or ``""``."""
    dropped = []
    for trait, (scope, measured, digests) in list(widget._measured.items()):
        if not _changed(widget, scope, measured, digests):
            continue
        del widget._measured[trait]
        setattr(widget, trait, {"id": int(getattr(widget, trait).get("id", 0)) + 1})
        dropped.append(_RESULTS[trait])
    if not dropped:
        return ""
    return (
        f"{' and '.join(dropped)} cleared: the model's tensors changed since they were measured "
        "(materialized, freed or edited). Measure again to see the new values."
    )
