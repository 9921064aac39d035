"""Which kernel ``scaled_dot_product_attention`` runs on a device, and a dry run costed by it.

SDPA picks its kernel at run time. The math kernel holds the ``[batch, heads, queries, keys]``
scores and their softmax (and, in training, keeps them for backward); the fused kernels (flash,
memory-efficient, cuDNN; the CPU's flash kernel) hold neither. Which one runs depends on the
device and on each call: on the CPU, flash takes no dropout; on CUDA, flash takes no mask and
only half types, memory-efficient attention needs aligned head sizes, and both take bfloat16
only on compute capability 8.0 or newer. A dry run on deferred or meta tensors would otherwise
cost whatever its own stand-ins dispatch to (meta tensors always run math).

:class:`AttentionKernels` decides each call for every device a plan uses: a device that is
present is asked (``torch._fused_sdp_choice`` on small tensors like the call's); an absent GPU
is judged by SDPA's rules, and where they depend on the GPU's generation, or on a device this
module has no rules for, the larger (math) is costed and the reason kept for the plan's notes.
One kernel is costed for all the devices: the larger where they differ. transformers models
configured for flash or flex attention (which do not run on stand-ins) run SDPA instead,
costed as a fused kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from jupyter_metainit.core import plain

__all__ = ["FUSED", "KERNELS", "MATH", "AttentionKernels", "AttentionPolicy", "sdpa_kernel"]

FUSED, MATH = "fused", "math"
KERNELS = ("auto", FUSED, MATH)
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_FLASH_FOR_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# transformers' attention implementations that are fused kernels and cannot run on stand-ins.
_FUSED_IMPLEMENTATIONS = ("flash_attention", "flex_attention", "kernels-community/")


@dataclass(frozen=True)
class AttentionPolicy:
    """What a dry run costs attention for: the ``devices`` the work will run on, the dtype it
    computes in there (None: the model's own), and ``kernel``: ``"auto"`` (what each device
    runs), or ``"fused"`` / ``"math"`` for every call, as the caller says."""

    devices: tuple[str, ...] = ("cpu",)
    dtype: torch.dtype | None = None
    kernel: str = "auto"


@dataclass(frozen=True)
class _Call:
    """What SDPA's kernel choice reads of one call."""

    query: tuple  # (shape, stride, storage offset) of each tensor
    key: tuple
    value: tuple
    mask: tuple | None
    mask_dtype: torch.dtype | None
    dtype: torch.dtype
    dropout_p: float
    is_causal: bool
    enable_gqa: bool
    grad: bool


@dataclass
class _Decision:
    kernel: str
    certain: bool = True
    reason: str = ""


@dataclass
class _Tally:
    fused: int = 0
    math: int = 0
    # device -> why it was costed with the math kernel (the first reason seen)
    math_on: dict[str, str] = field(default_factory=dict)
    unsure_on: dict[str, str] = field(default_factory=dict)
    forced: str = ""  # "fused" or "math" when the caller chose the kernel


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _call(bound: dict[str, Any], dtype: torch.dtype | None) -> _Call:
    grad = torch.is_grad_enabled()
    with plain():  # metadata only, past the dry run's modes
        return _read_call(bound, dtype, grad)


def _read_call(bound: dict[str, Any], dtype: torch.dtype | None, grad: bool) -> _Call:
    q, k, v, mask = bound["query"], bound["key"], bound["value"], bound.get("attn_mask")
    compute = dtype or q.dtype
    mask_dtype = None
    if isinstance(mask, torch.Tensor):
        mask_dtype = mask.dtype if mask.dtype == torch.bool or dtype is None else compute
    return _Call(
        query=_layout(q),
        key=_layout(k),
        value=_layout(v),
        mask=_layout(mask) if isinstance(mask, torch.Tensor) else None,
        mask_dtype=mask_dtype,
        dtype=compute,
        dropout_p=float(bound.get("dropout_p") or 0.0),
        is_causal=bool(bound.get("is_causal")),
        enable_gqa=bool(bound.get("enable_gqa")),
        grad=grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)),
    )


def _probe(
    layout: tuple,
    batch: dict[int, int],
    seq: dict[int, int],
    dtype: torch.dtype,
    device: str,
    grad: bool,
) -> torch.Tensor:
    """A small tensor like one of the call's: the batch (first) and sequence (second to last)
    sizes shrunk by ``batch`` / ``seq``, heads and head size kept, and the last dimension's
    stride (1 or not) and the storage offset's alignment kept."""
    shape, stride, offset = layout
    small = list(shape)
    if len(small) >= 3:
        small[0] = batch.get(small[0], small[0])
    if len(small) >= 2:
        small[-2] = seq.get(small[-2], small[-2])
    step = 1 if not shape or stride[-1] == 1 else 2
    strides, numel = [], step
    for n in reversed(small):
        strides.append(numel)
        numel *= max(n, 1)
    base = torch.zeros(offset % 64 + numel, dtype=dtype, device=device)
    probe = base.as_strided(small, list(reversed(strides)), offset % 64)
    return probe.requires_grad_(grad and dtype.is_floating_point)


def _probe_choice(call: _Call, device: str) -> int:
    """``torch._fused_sdp_choice`` for tensors like the call's on ``device`` (present), run
    past every mode of the dry run (nothing recorded, tracked or counted)."""
    with plain(), torch.enable_grad() if call.grad else contextlib.nullcontext():
        return _choice(call, device)


def _choice(call: _Call, device: str) -> int:
    seq = {n: 2 + i for i, n in enumerate(sorted({call.query[0][-2], call.key[0][-2]} - {0, 1}))}
    batch = {n: 2 for n in (call.query[0][0], call.key[0][0]) if n > 1}
    q, k, v = (
        _probe(layout, batch, seq, call.dtype, device, call.grad)
        for layout in (call.query, call.key, call.value)
    )
    mask = None
    if call.mask is not None and call.mask_dtype is not None:
        shape = list(call.mask[0])
        for i in range(len(shape)):  # (batch, heads, queries, keys), broadcast from the right
            from_end = len(shape) - i
            if from_end <= 2:
                shape[i] = seq.get(shape[i], shape[i])
            elif from_end == 4:
                shape[i] = batch.get(shape[i], shape[i])
        mask = torch.zeros(shape, dtype=call.mask_dtype, device=device)
    on = torch.cuda.device(torch.device(device)) if device.startswith("cuda") else None
    with on or contextlib.nullcontext():
        return int(
            torch._fused_sdp_choice(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=call.dropout_p,
                is_causal=call.is_causal,
                enable_gqa=call.enable_gqa,
            )
        )


def _cpu(call: _Call) -> _Decision:
    try:
        backend = _probe_choice(call, "cpu")
    except Exception:  # inputs SDPA would refuse anyway: the larger, said
        return _Decision(MATH, certain=False, reason="SDPA could not be asked about these inputs")
    if backend > 0:
        return _Decision(FUSED)
    if call.dropout_p > 0:
        why = f"dropout {call.dropout_p:g} (the CPU's flash kernel takes none)"
    elif call.dtype not in _CPU_DTYPES:
        why = f"{str(call.dtype).removeprefix('torch.')} (the CPU's flash kernel takes none)"
    elif not torch.backends.cuda.flash_sdp_enabled():
        why = "flash attention switched off (torch.backends.cuda.enable_flash_sdp(False))"
    else:
        why = "these inputs (the CPU's flash kernel refuses them)"
    return _Decision(MATH, reason=why)


def _aligned(call: _Call, alignment: int) -> bool:
    head_q, head_k, head_v = call.query[0][-1], call.key[0][-1], call.value[0][-1]
    return (
        head_q == head_k
        and head_q > 0
        and head_v > 0
        and head_q % alignment == 0
        and (head_v % alignment == 0)
    )


def _dense_ok(call: _Call) -> bool:
    """Four dimensions, no empty sequence, unit stride in the head dimension, head counts
    that divide (grouped-query attention)."""
    layouts = (call.query, call.key, call.value)
    if any(len(shape) != 4 or 0 in shape or stride[-1] != 1 for shape, stride, _ in layouts):
        return False
    heads_q, heads_k, heads_v = (layout[0][1] for layout in layouts)
    same = heads_q == heads_k == heads_v
    return same or (heads_k == heads_v and heads_q % heads_k == 0 and call.enable_gqa)


def _absent_cuda(call: _Call) -> _Decision:
    """SDPA's CUDA rules for a GPU that is not here (its generation unknown)."""
    backends = torch.backends.cuda
    half = call.dtype in (torch.float16, torch.bfloat16)
    dtype = str(call.dtype).removeprefix("torch.")
    efficient = (
        backends.mem_efficient_sdp_enabled()
        and _dense_ok(call)
        and call.dtype in (torch.float16, torch.float32, torch.bfloat16)
    )
    q, k = call.query[0], call.key[0]
    flash = (
        backends.flash_sdp_enabled()
        and _dense_ok(call)
        and call.mask is None
        and q[-1] == k[-1] == call.value[0][-1] <= 256
        and not (call.is_causal and q[-2] != k[-2])
        and half
    )
    aligned = _aligned(call, 8 if half else 4)  # compute capability 8.0 and newer
    if efficient and aligned and call.dtype != torch.bfloat16:
        return _Decision(FUSED)  # memory-efficient attention runs on every GPU torch supports
    unsure = "which cannot be checked without the GPU"
    if (efficient and aligned) or flash:
        return _Decision(
            MATH,
            certain=False,
            reason=(
                f"SDPA's fused kernels take {dtype} only on GPUs of compute capability 8.0 or "
                f"newer (A100, L4, H100, RTX 30xx and later), {unsure}"
            ),
        )
    if efficient and call.dtype == torch.float32 and _aligned(call, 1):
        return _Decision(
            MATH,
            certain=False,
            reason=(
                f"memory-efficient attention takes head size {q[-1]} in float32 only on GPUs "
                f"older than compute capability 8.0 (V100, T4), {unsure}"
            ),
        )
    return _Decision(MATH, reason="no fused kernel takes these inputs (head size, mask, dtype)")


def sdpa_kernel(call: _Call, device: str) -> _Decision:
    """The kernel SDPA runs for ``call`` on ``device``: asked where the device is present,
    by SDPA's rules for an absent GPU, else unknown (the math kernel, not certain)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return _cpu(call)
    present = kind == "cuda" and torch.cuda.is_available()
    if not present and kind != "cuda":
        module = getattr(torch, kind, None)
        present = bool(module is not None and getattr(module, "is_available", lambda: False)())
    if present:
        try:
            backend = _probe_choice(call, device)
        except Exception:  # a device that cannot take the probe: judged as unknown below
            backend = -1
        if backend > 0:
            return _Decision(FUSED)
        if backend == 0:
            return _Decision(MATH, reason="SDPA chooses its math kernel there for these inputs")
    if kind == "cuda":
        return _absent_cuda(call)
    return _Decision(MATH, certain=False, reason=f"which SDPA kernel {kind} runs is not known here")


class AttentionKernels(TorchFunctionMode):
    """Runs every ``scaled_dot_product_attention`` of a dry run as the kernel ``policy``
    gives it: the math kernel (decomposed: its scores and softmax are seen) or a fused one
    (the CPU's flash kernel stands in: output and log-sum-exp, as every fused kernel keeps).
    ``tally`` counts the calls and keeps, per device, why math was costed there."""

    def __init__(self, policy: AttentionPolicy, forced: str = "") -> None:
        super().__init__()
        self.policy = policy
        self.tally = _Tally(forced=forced or (policy.kernel if policy.kernel != "auto" else ""))
        self._decided: dict[_Call, str] = {}

    def _kernel(self, bound: dict[str, Any]) -> str:
        if self.tally.forced:
            return self.tally.forced
        call = _call(bound, self.policy.dtype)
        kernel = self._decided.get(call)
        if kernel is None:
            kernel = FUSED
            for device in self.policy.devices:
                decision = sdpa_kernel(call, device)
                if decision.kernel == MATH:
                    kernel = MATH
                    target = self.tally.math_on if decision.certain else self.tally.unsure_on
                    target.setdefault(device, decision.reason)
            self._decided[call] = kernel
        return kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        bound = dict(zip(_NAMES, args, strict=False)) | kwargs
        kernel = self._kernel(bound)
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask, dropout = bound.get("attn_mask"), bound.get("dropout_p", 0.0)
        causal, scale = bound.get("is_causal", False), bound.get("scale")
        if kernel == FUSED and _FLASH_FOR_CPU is not None:
            self.tally.fused += 1
            if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
                # As SDPA does before a fused kernel: an additive mask of the query's dtype.
                mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
            # Grouped-query attention: the kernels read the shared key/value heads as they are.
            return _FLASH_FOR_CPU(q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]
        self.tally.math += 1
        return torch.ops.aten._scaled_dot_product_attention_math(
            q,
            k,
            v,
            mask,
            dropout,
            causal,
            None,
            scale=scale,
            enable_gqa=bool(bound.get("enable_gqa", False)),
        )[0]


def _attention_configs(model: nn.Module) -> Iterator[Any]:
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if isinstance(getattr(config, "_attn_implementation_internal", None), str):
            yield config


@contextlib.contextmanager
def transformers_attention(model: nn.Module) -> Iterator[str]:
    """Run a transformers model configured for a fused attention implementation that cannot
    run on stand-ins (``flash_attention_2``, ``flex_attention``, kernels from the Hub) with
    ``sdpa`` instead; yields ``"fused"`` then (the kernel to cost), else ``""``. Every
    configuration is restored afterwards."""
    swapped = []
    for config in _attention_configs(model):
        name = config._attn_implementation_internal
        if any(tag in name for tag in _FUSED_IMPLEMENTATIONS):
            swapped.append((config, name))
            config._attn_implementation_internal = "sdpa"  # the raw slot: no checks, no imports
    try:
        yield FUSED if swapped else ""
    finally:
        for config, name in swapped:
            config._attn_implementation_internal = name


def implementations(model: nn.Module) -> list[str]:
    """The attention implementations a transformers model's configurations name."""
    return sorted({c._attn_implementation_internal for c in _attention_configs(model)})


def tally_record(tally: _Tally) -> dict[str, Any]:
    """A dry run's record of how its attention was costed (plain values)."""
    return {
        "fused": tally.fused,
        "math": tally.math,
        "math_on": dict(tally.math_on),
        "unsure_on": dict(tally.unsure_on),
        "forced": tally.forced,
    }


def devices_of(model: nn.Module) -> tuple[str, ...]:
    """The device a model's tensors report (deferred tensors report where they will be made)."""
    for t in [*model.parameters(), *model.buffers()]:
        return (str(t.device),)
    return ("cpu",)


def _listed(devices: Sequence[str]) -> str:
    if len(devices) <= 3:
        return ", ".join(devices)
    return f"{devices[0]}, {devices[1]}, ..., {devices[-1]} ({len(devices)} devices)"


def _by_reason(by_device: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for device, reason in by_device.items():
        grouped.setdefault(reason, []).append(device)
    return grouped


def math_notes(record: dict[str, Any], devices: Sequence[str]) -> list[str]:
    """The plan's notes on how attention was costed, from a dry run's record: where the math
    kernel was costed because the kernel is not known, and where one device's math kernel was
    costed for devices that run a fused one."""
    notes: list[str] = []
    unsure, certain = record.get("unsure_on", {}), record.get("math_on", {})
    if not record.get("math") or record.get("forced"):
        return notes
    for reason, on in _by_reason(unsure).items():
        notes.append(
            f"attention on {_listed(on)} is costed with SDPA's math kernel, which holds the "
            f"[batch, heads, queries, keys] scores: {reason}; if it runs a fused kernel there, "
            "pass attention='fused' (less memory)"
        )
    fused_elsewhere = [d for d in devices if d not in certain and d not in unsure]
    for reason, on in _by_reason(certain).items():
        if fused_elsewhere:
            notes.append(
                f"attention is costed with SDPA's math kernel on every device because "
                f"{_listed(on)} {'runs' if len(on) == 1 else 'run'} it ({reason}); "
                f"{_listed(fused_elsewhere)} would run a fused kernel and need less"
            )
    return notes
