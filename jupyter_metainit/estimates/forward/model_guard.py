"""Leaving a model exactly as it was around a dry run's forward pass.

:class:`ModelGuard` swaps every tensor for a stand-in during the run (writes never reach the
model), then restores attributes, tensors, modes and random generator states; lazy modules
built inside ``meta_init`` keep the shapes the run gave them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from jupyter_metainit.estimates.forward.nested import generators_in

__all__ = ["ModelGuard", "inferred_in_meta_init"]


_PLAIN_DICTS = (dict, OrderedDict)


def inferred_in_meta_init(t: Any) -> bool:
    """An uninitialized lazy tensor made inside ``meta_init``: a dry run may give it its shape.

    ``core._lazy`` marks those with the device their deferred replacement reports.
    """
    return isinstance(t, torch.Tensor) and is_lazy(t) and "_jmi_device" in t.__dict__


def _stand_in(t: torch.Tensor, on_meta: bool) -> torch.Tensor:
    """A tensor like ``t`` that the run may read and write instead of ``t``.

    Inside ``meta_init`` a deferred clone: its values are ``t``'s if the forward needs them,
    and a write lands on the clone only. On the meta path an empty meta tensor.
    """
    if is_lazy(t):
        # A fresh uninitialized tensor of the same kind: shape inference fills it in place.
        return type(t)(requires_grad=t.requires_grad, device=t.device, dtype=t.dtype)
    with torch.no_grad():
        if on_meta:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        else:
            new = t.clone()  # under no_grad: no graph, nothing to detach from
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    elif t.requires_grad:
        new.requires_grad_(True)
    # What code reads off the tensor object in forward (`weight.quant_state`, a user's tag);
    # underscore names are bookkeeping, the core's own included, and stay with ``t``.
    for name, value in getattr(t, "__dict__", {}).items():
        if not name.startswith("_"):
            setattr(new, name, value)
    return new


class ModelGuard:
    """Leaves a model as it was found around a forward run for an estimate.

    Every tensor the model holds (parameters, buffers, tensor attributes, tied ones once) is
    swapped for a stand-in while the forward runs, so in-place writes (BatchNorm's running
    stats, counters, caches) never reach the model's tensors, real or deferred (a write on a
    deferred tensor would be recorded and change what it materializes to). Afterwards every
    module gets back its attributes, tensors and train/eval mode, and the random generators
    (CPU, CUDA, generators kept on modules or passed in) their states: Dropout in the run
    draws nothing the user sees. Lazy modules built inside ``meta_init`` keep their inferred
    (deferred) parameters: giving them a shape is what a dry run is for. Any other lazy module
    (a real model's) runs on fresh uninitialized stand-ins and stays lazy, class included.
    """

    def __init__(self, root: nn.Module, inputs: Any = ()) -> None:
        self.modules = list(root.modules())
        self.training = [m.training for m in self.modules]
        self.classes = [type(m) for m in self.modules]
        self.lazy = [
            any(
                inferred_in_meta_init(t)
                for t in (*m._parameters.values(), *m._buffers.values())
                if t is not None
            )
            for m in self.modules
        ]
        self.attributes = [dict(m.__dict__) for m in self.modules]
        # Contents of every dict a module holds (hook tables included: shape inference
        # removes a lazy module's hooks from them in place; RemovableHandles point at them).
        self.dict_contents = [
            {name: dict(v) for name, v in m.__dict__.items() if type(v) in _PLAIN_DICTS}
            for m in self.modules
        ]
        self.parameters = [dict(m._parameters) for m in self.modules]
        self.buffers = [dict(m._buffers) for m in self.modules]
        self.transient = [set(m._non_persistent_buffers_set) for m in self.modules]
        generators = {id(torch.default_generator): torch.default_generator}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for g in torch.cuda.default_generators:
                generators[id(g)] = g
        for m in self.modules:
            for v in m.__dict__.values():
                if isinstance(v, torch.Generator):
                    generators[id(v)] = v
        for g in generators_in(inputs):  # `dry_run(model, x, generator=g)`
            generators[id(g)] = g
        self.generators = list(generators.values())
        # `torch.get_rng_state` inside a block first settles draws recorded so far (see
        # core._context); the generator's own get_state is the same after that.
        torch.get_rng_state()
        self.rng_states = [g.get_state() for g in self.generators]

    def swap_in_stand_ins(self, on_meta: bool) -> None:
        made: dict[int, torch.Tensor] = {}

        def stand_in(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or inferred_in_meta_init(t):
                return t
            if id(t) not in made:
                made[id(t)] = _stand_in(t, on_meta)
            return made[id(t)]

        for m in self.modules:
            for slots in (m._parameters, m._buffers):
                for name, t in slots.items():
                    slots[name] = stand_in(t)
            for name, v in list(m.__dict__.items()):
                if isinstance(v, torch.Tensor):
                    m.__dict__[name] = stand_in(v)
                elif type(v) in (list, tuple) and any(isinstance(x, torch.Tensor) for x in v):
                    m.__dict__[name] = type(v)(stand_in(x) for x in v)

    def restore(self) -> None:
        for i, m in enumerate(self.modules):
            if self.lazy[i]:
                # Keep what shape inference made of the lazy slots (and the class it became).
                for slots, saved in (
                    (m._parameters, self.parameters[i]),
                    (m._buffers, self.buffers[i]),
                ):
                    for name, t in saved.items():
                        if t is not None and not is_lazy(t):
                            slots[name] = t
            else:
                m.__class__ = self.classes[i]  # shape inference turns LazyLinear into Linear
                m.__dict__.clear()
                m.__dict__.update(self.attributes[i])
                for name, saved in self.dict_contents[i].items():
                    slots = m.__dict__[name]
                    slots.clear()
                    slots.update(saved)
                m._non_persistent_buffers_set.clear()
                m._non_persistent_buffers_set.update(self.transient[i])
            m.training = self.training[i]
        for g, state in zip(self.generators, self.rng_states, strict=True):
            g.set_state(state)
