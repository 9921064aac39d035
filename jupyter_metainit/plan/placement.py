"""``place``: plan where each part of a model goes, from the model alone, allocating nothing.

Use it before materializing a model that needs several devices: it says which device each part
should go to for a workload (batch, sequence length, inference or training), the predicted
peak of every device, and whether it fits.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from jupyter_metainit.core import check_flag, format_bytes
from jupyter_metainit.core.errors import ArgumentError, ArgumentTypeError
from jupyter_metainit.estimates._arguments import require_module
from jupyter_metainit.estimates.fit import device_budget
from jupyter_metainit.estimates.forward.attention import KERNELS, AttentionPolicy, math_notes
from jupyter_metainit.plan.costs import part_costs, state_bytes_per_parameter
from jupyter_metainit.plan.fsdp import plan_fsdp
from jupyter_metainit.plan.names import check_pin, compact_device_map, resolve_pins
from jupyter_metainit.plan.partition import Costs, Load, device_loads, fill, partition
from jupyter_metainit.plan.parts import Part, describe, find_parts
from jupyter_metainit.plan.place_arguments import (
    check_workload,
    is_offload,
    parse_devices,
    split_inputs,
)
from jupyter_metainit.plan.precision import Convention, convention
from jupyter_metainit.plan.result import Placement
from jupyter_metainit.plan.workload import (
    Activity,
    activation_dtype,
    check_takes_token_ids,
    eval_mode_notes,
    measure,
)

__all__ = ["place"]

# Measurements kept per model and workload: re-planning (other devices, pins) reuses them.
_MEASURED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Activity]] = weakref.WeakKeyDictionary()


def _activity(
    model: nn.Module, parts: list[Part], training: bool, inputs: tuple, policy: AttentionPolicy
) -> Activity:
    # The parts (their names, in order), the workload and how attention is costed decide what
    # is measured.
    key = (
        training,
        repr(inputs),
        activation_dtype(model),
        tuple((p.name, p.group, p.own_only) for p in parts),
        policy,
    )
    per_model = _MEASURED.setdefault(model, {})
    if key not in per_model:
        per_model.clear()  # one workload kept per model: measurements are small, models many
        positional, keywords = split_inputs(inputs)
        measured = measure(
            model, parts, training=training, inputs=positional, kwargs=keywords, attention=policy
        )
        per_model[key] = measured
        return dataclasses.replace(measured, notes=list(measured.notes))
    return dataclasses.replace(per_model[key], seconds=0.0, notes=list(per_model[key].notes))


def _policy(devices: dict[str, int], conv: Convention, attention: Any) -> AttentionPolicy:
    """What attention is costed for: the plan's devices, at the precision's compute dtype."""
    if not isinstance(attention, str):
        raise ArgumentTypeError(
            f"attention must be one of {', '.join(map(repr, KERNELS))}, not {attention!r}"
        )
    if attention not in KERNELS:
        raise ArgumentError(
            f"attention={attention!r}: use 'auto' (the kernel each device runs; the math "
            "kernel where that is not known here), 'fused' (flash / memory-efficient / cuDNN "
            "attention on every device) or 'math' (SDPA's math kernel everywhere)"
        )
    return AttentionPolicy(devices=tuple(devices), dtype=conv.activations, kernel=attention)


def _tiers(devices: dict[str, int], pinned: dict[str, str]) -> list[list[str]]:
    """Devices to try, in turn: the accelerators alone, then with host memory (offload)."""
    fast = [d for d in devices if not is_offload(d)]
    if not fast or len(fast) == len(devices) or any(is_offload(d) for d in pinned.values()):
        return [list(devices)]
    return [fast, list(devices)]


def _plan(
    sequence: list[tuple[str, Costs]],
    devices: dict[str, int],
    tier: list[str],
    start: dict[str, Load],
) -> tuple[dict[str, str], float]:
    """Leader name -> device for the unpinned sequence on ``tier`` (balanced on the
    accelerators; host memory only takes what they cannot hold)."""
    costs = [c for _, c in sequence]
    fast = [d for d in tier if not is_offload(d)]
    slow = [d for d in tier if is_offload(d)]
    if fast and slow:
        cuts, end = fill(costs, [devices[d] for d in fast], [start[d] for d in fast], 1.0)
        rest, _ = partition(costs[end:], [devices[d] for d in slow], [start[d] for d in slow])
        cuts += [end + c for c in rest]
    else:
        cuts, _ = partition(costs, [devices[d] for d in tier], [start[d] for d in tier])
    where = {}
    for d, begin in enumerate(cuts):
        end = cuts[d + 1] if d + 1 < len(cuts) else len(costs)
        for name, _ in sequence[begin:end]:
            where[name] = tier[d]
    loads = device_loads(costs, cuts, [start[d] for d in tier])
    return where, max(load.peak / devices[d] for load, d in zip(loads, tier, strict=True))


def _start_loads(
    devices: dict[str, int], pinned: dict[str, str], grouped: dict[str, Costs], training: bool
) -> dict[str, Load]:
    start = {d: Load(training, foreach=not is_offload(d)) for d in devices}
    for name, device in pinned.items():
        start[device].add(grouped[name])
    for device, load in start.items():
        if load.peak > devices[device]:
            names = ", ".join(describe(n) for n, d in pinned.items() if d == device)
            raise ArgumentError(
                f"pinned {names} need {format_bytes(load.peak)} on {device}, which holds "
                f"{format_bytes(devices[device])}: pin fewer parts there, pin them to a larger "
                "device, or use a smaller precision="
            )
    return start


def _pipeline(
    model: nn.Module,
    parts: list[Part],
    activity: Activity,
    devices: dict[str, int],
    pinned: dict[str, str],
    own: dict[str, Costs],
    grouped: dict[str, Costs],
    training: bool,
) -> tuple[dict[str, str], dict[str, int]]:
    """Part name -> device for every part, and every device's predicted peak."""
    start = _start_loads(devices, pinned, grouped, training)
    leaders = {p.name for p in parts if p.leader is None}
    sequence = [(n, grouped[n]) for n in activity.order if n in leaders and n not in pinned]
    where: dict[str, str] = {}
    for tier in _tiers(devices, pinned):
        where, bottleneck = _plan(sequence, devices, tier, start)
        if bottleneck <= 1.0:
            break
    where.update(pinned)
    for part in parts:
        if part.leader is not None:
            where[part.name] = where[part.leader.name]
    # The peaks: every part with its own costs, in the order the step runs them (a tie
    # group's members apart, each where it runs).
    loads = {d: Load(training, foreach=not is_offload(d)) for d in devices}
    for name in activity.order:
        loads[where[name]].add(own[name])
    return where, {d: load.peak for d, load in loads.items()}


def _check_options(strategy: Any, world_size: Any, no_split: Any, optimizer: Any) -> None:
    if not isinstance(strategy, str):
        raise ArgumentTypeError(f"strategy takes 'pipeline' or 'fsdp', not {strategy!r}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
        raise ArgumentTypeError(f"world_size takes an int >= 1 or None, not {world_size!r}")
    if optimizer is not None and (
        isinstance(optimizer, bool) or not isinstance(optimizer, (str, int, float))
    ):
        raise ArgumentTypeError(
            "optimizer takes a name ('adamw', 'adam', 'sgd', ...), None or a number of state "
            f"bytes per trainable parameter, not {optimizer!r}"
        )
    state_bytes_per_parameter(optimizer, 4)  # an unknown name, a negative number: refused
    if strategy not in ("pipeline", "fsdp"):
        raise ArgumentError(
            f"strategy={strategy!r}: use 'pipeline' (layers in order over the "
            "devices) or 'fsdp' (every rank holds a shard, fully_shard units)"
        )
    if strategy == "pipeline" and world_size is not None:
        raise ArgumentError("world_size= is for strategy='fsdp'; a pipeline uses the devices given")
    if no_split is not None and (
        isinstance(no_split, str)
        or not isinstance(no_split, (list, tuple, set, frozenset))
        or not all(isinstance(n, str) for n in no_split)
    ):
        raise ArgumentTypeError(
            "no_split must be a list of module names or class names, e.g. "
            f"['LlamaDecoderLayer'] ([] splits every block), not {no_split!r}"
        )


def place(
    model: nn.Module,
    devices: Mapping[Any, Any] | str,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    training: bool = False,
    optimizer: str | float | None = "adamw",
    precision: Any = None,
    pin: Mapping[str, Any] | None = None,
    no_split: list[str] | None = None,
    strategy: str = "pipeline",
    world_size: int | None = None,
    inputs: Any = None,
    attention: str = "auto",
) -> Placement:
    """Plan which device each part of ``model`` goes to for a workload, allocating nothing.

    Use it before materializing (or loading) a model that needs several devices, to know where
    each part goes and whether it fits at this batch and sequence length, then
    ``materialize(model, placement=plan)`` or hand ``plan.device_map`` to accelerate. Works on
    deferred, partly real and real models; nothing is allocated or changed.

    What it models, per part: weights and buffers at ``precision`` (tied tensors once); the
    live activations while it runs, measured by a :func:`dry_run` of the workload (every
    tensor the forward makes, masks and positions included); the model's own cache (the
    tensors of the cache object its forward returns, each layer's once); for training, one
    forward and backward of the whole step on meta tensors (the values it reads answered by
    the dry run's): what autograd saves, what each part holds forward and going backward (the
    loss and the code between parts included), the gradients, the optimizer states and the
    optimizer step's temporaries. Parts are repeated
    blocks (never split; ``no_split=`` names the modules to keep whole instead), leaves, and
    the tensors a module holds itself next to its children (placed before them, named one by one
    in the device map); tied parts share a device. The parts, in the order the
    forward runs them, are cut into one contiguous range per device, minimising the most
    loaded device relative to its capacity (exactly, not first-fit). Host memory (``"cpu"``)
    is an offload: used only for what the accelerators cannot hold. ``pin={"lm_head":
    "cuda:0"}`` puts parts on a device and plans the rest around them. The same model and
    workload is measured once: re-planning with other devices or pins reuses it.

    Attention is costed by the kernel each device runs. SDPA's math kernel holds the
    ``[batch, heads, queries, keys]`` scores and their softmax (and keeps them for backward);
    the fused kernels (flash, memory-efficient, cuDNN, the CPU's flash) hold neither. The CPU
    and a GPU that is here are asked which one a call gets (the CPU's flash kernel takes no
    dropout); an absent GPU is judged by SDPA's rules (flash: half types, no mask;
    memory-efficient: aligned head sizes), and where they depend on its generation
    (bfloat16 needs compute capability 8.0) the math kernel is costed and ``plan.notes`` says
    so. One kernel is costed for every device: the larger where they differ (said in the
    notes too). ``attention="fused"`` or ``"math"`` costs every call so instead. transformers'
    ``attn_implementation`` is read from the model's config: ``"eager"`` is costed as it runs,
    ``"sdpa"`` as above, ``"flash_attention_2"`` and the other fused implementations (which
    need their GPU packages, not needed here) as a fused kernel.

    Not modelled: the allocator's caching and fragmentation, CUDA context and kernels'
    workspaces, communication buffers, activation checkpointing, the generation loop's own
    tensors beyond the cache at ``seq_len`` tokens (``seq_len`` is prompt + generated
    tokens), and for ``precision`` other than the model's own dtype the activations are
    scaled by the dtypes' sizes (autocast keeps some in fp32).

    Args:
        model: the model to place: deferred, partly real or real.
        devices: ``{"cuda:0": "80GiB", "cuda:1": "80GiB", "cpu": "256GiB"}`` (bytes, or sizes
            1024-based ``GiB`` or 1000-based ``GB``), in pipeline order, or ``"auto"`` (the
            visible GPUs' free memory, then the host's available memory).
        batch: samples per step.
        seq_len: tokens per sample: the workload is one forward of ``batch`` x ``seq_len``
            token ids, inference with the model's cache when its forward takes
            ``use_cache``.
        training: plan one training step instead: gradients, ``optimizer`` states, and
            ``labels`` where the forward takes them and ``inputs`` gives none, as
            transformers' heads take them: ``(batch,)`` class ids for a sequence, image,
            audio or video classifier or multiple choice (floats for a regression head,
            ``(batch, num_labels)`` floats for a multi-label one, per ``config.problem_type``),
            else token ids of ``decoder_input_ids``' (or ``input_ids``') shape; none where
            there are no token ids (the loss is then the model's output, if any). LayerDrop
            is costed with no layer dropped.
        optimizer: with ``training``: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``,
            ``"adafactor"``, ``None``, or bytes of state per parameter.
        precision: how weights, gradients, states and activations are stored: ``None`` (as
            the model holds them), ``"fp32"``, ``"bf16"``/``"fp16"`` (the model cast),
            ``"bf16-mixed"``/``"fp16-mixed"`` (autocast), ``"bf16-master"``/``"fp16-master"``
            (half weights with an fp32 master copy).
        pin: ``{"lm_head": "cuda:0"}``: put these parts on these devices and plan the rest
            around them.
        no_split: names of modules to keep whole as one part (repeated blocks are never
            split).
        strategy: ``"pipeline"`` (each part on one device) or ``"fsdp"`` (every repeated block
            a ``fully_shard`` unit, each rank's peak; ``devices`` then gives one rank's device
            and capacity, ``{"cuda": "80GiB"}``).
        world_size: with ``strategy="fsdp"``: the number of ranks (default: one per device
            given).
        inputs: the workload of a model that does not take token ids: the forward's inputs as
            shapes or tensors (``[(8, 3, 224, 224)]``); a dict gives keyword inputs
            (``{"input_ids": (8, 512), "decoder_input_ids": (8, 128)}``). A shape becomes a
            deferred tensor whose dtype the argument's name says (a positional one is named
            by the forward's parameter at its place), as transformers names them: int64 for
            ids, labels and attention masks (``input_ids``, ``token_type_ids``,
            ``position_ids``, ``labels``, ``attention_mask``, ``pixel_mask``; masks hold
            ones), the model's floating dtype (its first floating parameter's) for
            ``pixel_values``, ``input_features``, ``input_values``, ``inputs_embeds``,
            ``encoder_hidden_states``, ``head_mask`` and other ``*_values`` / ``*_features``
            / ``*_embeds`` / ``*_states``, bool for ``bool_*``; any other name
            (``x``, ``input``) is token ids when the model starts with an ``nn.Embedding``,
            else floats. For another dtype give a tensor instead of the shape: a deferred
            (made under ``meta_init``), meta or real one, of which only the shape and dtype
            are used (``torch.empty(8, 512, dtype=torch.float16, device="meta")``).
        attention: how scaled-dot-product attention is costed: ``"auto"`` (the kernel each
            planned device would run: the math kernel, which holds the [batch, heads, q, k]
            scores, on the CPU and wherever a fused kernel's conditions fail), or one kernel
            for every device (see ``plan.notes`` for what was assumed).

    Returns:
        A :class:`~jupyter_metainit.plan.Placement`: ``device_map``, the predicted ``peak``
        per device against its ``capacity``, ``fits``, and when it does not fit ``over`` and
        ``advice`` (what would make it fit: a precision, more devices, offloading, FSDP).

    Raises:
        ArgumentTypeError: an argument has a type it does not take (``pin=3``).
        ArgumentError: a capacity that is not a size, a device named twice, ``batch=0``, a
            workload missing (neither ``seq_len`` nor ``inputs``), an unknown ``precision`` or
            ``optimizer``, a pinned name that is not a part of the model.
        Exception: what the model's forward raises for the workload (measured by a dry run),
            as in eager.

    Examples:
        >>> from torch import nn
        >>> from jupyter_metainit import meta_init, place
        >>> with meta_init():
        ...     model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
        >>> plan = place(model, {"cuda:0": "6MiB", "cuda:1": "6MiB"}, inputs=[(8, 1024)])
        >>> plan  # no GPU is needed to plan for two
        Placement (pipeline, inference, inputs (8, 1024), precision as built): fits
            cuda:0 [...] 4.10 MiB of 6.00 MiB ( 68%), 2 parts
            cuda:1 [...] 4.10 MiB of 6.00 MiB ( 68%), 1 parts
          first part per device: cuda:0: 0, cuda:1: 2
        >>> plan.device_map
        {'0': 'cuda:0', '1': 'cuda:0', '2': 'cuda:1'}
        >>> place(model, {"cuda:0": "6MiB", "cuda:1": "6MiB"}, inputs=[(8, 1024)],
        ...       training=True).fits  # AdamW states and gradients too: 20 MiB a device
        False
    """
    started = time.perf_counter()
    require_module(model, "place")
    _check_options(strategy, world_size, no_split, optimizer)
    check_flag(training, "training")
    check_pin(pin)
    parsed = parse_devices(devices)
    conv = convention(precision)
    policy = _policy(parsed, conv, attention)
    workload_inputs = check_workload(batch, seq_len, inputs, training)
    if inputs is None:
        check_takes_token_ids(model)
    inputs = workload_inputs
    parts = find_parts(model, no_split=no_split, pinned=(pin or {}).keys())
    pinned = resolve_pins(pin, parts, model, parsed)
    activity = _activity(model, parts, training, inputs, policy)
    activity.notes += math_notes(activity.attention, list(parsed))
    if not training:
        activity.notes += eval_mode_notes(model)
    own, grouped = part_costs(model, parts, activity, conv, optimizer=optimizer, training=training)
    workload = f"batch {batch}" + (f", seq_len {seq_len}" if seq_len is not None else "")
    if inputs != ((batch, seq_len),):
        workload = "inputs " + ", ".join(
            f"{i[0]}={_shape_label(i[1])}"
            if isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str)
            else str(i)
            for i in inputs
        )
    if strategy == "fsdp":
        from_fsdp = plan_fsdp(model, parts, activity, parsed, own, conv, world_size, training)
        from_fsdp.workload = workload
        from_fsdp.seconds = time.perf_counter() - started
        return from_fsdp
    where, peak = _pipeline(model, parts, activity, parsed, pinned, own, grouped, training)
    result = Placement(
        device_map=compact_device_map(model, parts, where),
        peak=peak,
        capacity=parsed,
        parts=[
            (p.label, p.kind, where[p.name], own[p.name])
            for p in sorted(parts, key=lambda p: activity.order.index(p.name))
        ],
        training=training,
        workload=workload,
        precision=conv.name,
        notes=list(activity.notes),
        measure_seconds=activity.seconds,
    )
    if not result.fits:
        result.advice = _advice(
            model, parts, activity, parsed, pinned, conv, optimizer, training, own, grouped
        )
    result.seconds = time.perf_counter() - started
    return result


def _shape_label(value: Any) -> str:
    """A keyword input as the plan's workload names it: its shape."""
    return str(tuple(value.shape) if isinstance(value, torch.Tensor) else value)


def _alone(costs: Costs, training: bool) -> int:
    load = Load(training)
    load.add(costs)
    return load.peak


def _fewest_devices(
    sequence: list[tuple[str, Costs]], capacity: int, training: bool, at_least: int
) -> int | None:
    """The fewest devices of ``capacity`` holding the sequence (None: not even 256)."""

    def fits(k: int) -> bool:
        devices = {f"cuda:{i}": capacity for i in range(k)}
        start = {d: Load(training) for d in devices}
        return _plan(sequence, devices, list(devices), start)[1] <= 1.0

    lo, hi = at_least, 256
    if not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def _advice(
    model: nn.Module,
    parts: list[Part],
    activity: Activity,
    devices: dict[str, int],
    pinned: dict[str, str],
    conv: Convention,
    optimizer: str | float | None,
    training: bool,
    own: dict[str, Costs],
    grouped: dict[str, Costs],
) -> list[str]:
    """What would make a plan that does not fit fit: a smaller dtype, more devices, offload."""
    advice = []
    widest = max(
        (p.dtype.itemsize for p in model.parameters() if p.dtype.is_floating_point), default=2
    )
    if (conv.weights.itemsize if conv.weights else widest) > 2:
        half = convention("bf16")
        smaller_own, smaller = part_costs(
            model, parts, activity, half, optimizer=optimizer, training=training
        )
        try:
            _, peak = _pipeline(
                model, parts, activity, devices, pinned, smaller_own, smaller, training
            )
        except ValueError:
            peak = None
        if peak is not None and all(peak[d] <= devices[d] for d in devices):
            advice.append(
                f"precision='bf16' fits (largest device peak {format_bytes(max(peak.values()))})"
            )
    leaders = {p.name for p in parts if p.leader is None}
    sequence = [(n, grouped[n]) for n in activity.order if n in leaders]
    fast = [d for d in devices if not is_offload(d)] or list(devices)
    capacity = max(devices[d] for d in fast)
    count = _fewest_devices(sequence, capacity, training, len(fast) + 1)
    if count is None:
        biggest = max(sequence, key=lambda s: _alone(s[1], training))
        advice.append(
            f"no number of {format_bytes(capacity)} devices holds it as a pipeline "
            f"(part {describe(biggest[0])} alone is too large): use strategy='fsdp'"
        )
    else:
        advice.append(f"{count} devices of {format_bytes(capacity)} fit it")
    if not any(is_offload(d) for d in devices):
        host = device_budget("cpu")
        with_host = {**devices, "cpu": host}
        try:
            _, peak = _pipeline(model, parts, activity, with_host, pinned, own, grouped, training)
        except ValueError:
            peak = None
        if peak is not None and all(peak[d] <= with_host[d] for d in with_host):
            advice.append(
                f"offloading to host memory fits: add the host, cpu, to the devices (it would "
                f"hold {format_bytes(peak['cpu'])} of its {format_bytes(host)} free; slower: "
                "those parts run from the host)"
            )
    return advice
