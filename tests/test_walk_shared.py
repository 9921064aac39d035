"""The walker looks into a container several modules share (a ``transformers`` config) once per
walk, and finds what a walk of each module on its own finds."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from jupyter_metainit import meta_init
from jupyter_metainit.core.materialize.walk import own_tensors, unique_tensors


def _each_on_its_own(model: nn.Module) -> list[int]:
    seen: dict[int, None] = {}
    for m in model.modules():
        for own in own_tensors(m, attributes=True):
            seen.setdefault(id(own.tensor), None)
    return list(seen)


def test_a_shared_container_gives_its_tensors_once_in_walk_order():
    with meta_init():
        deep = torch.randn(3)
        shared = SimpleNamespace(t=torch.randn(2), inner={"k": [deep]})
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        a.cfg, b.cfg = shared, shared
        b.own = torch.randn(4)
        model = nn.Sequential(a, b)
    found = [id(t) for t in unique_tensors(model, attributes=True)]
    assert id(shared.t) in found and id(deep) in found and id(b.own) in found
    assert found == _each_on_its_own(model)


def test_a_container_first_reached_at_the_depth_bound_is_looked_into_again_higher_up():
    with meta_init():
        below = torch.randn(2)
        box = {"box": {"t": below}}  # entered at depth 8 from a: not looked into
        nested: object = box
        for _ in range(7):
            nested = [nested]
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        a.deep, b.box = nested, box
        model = nn.Sequential(a, b)
    found = [id(t) for t in unique_tensors(model, attributes=True)]
    assert id(below) in found
    assert found == _each_on_its_own(model)


def test_a_cycle_through_a_shared_container_ends():
    with meta_init():
        t = torch.randn(2)
        node: dict = {"t": t}
        node["self"] = node
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        a.node, b.node = node, [node]
        model = nn.Sequential(a, b)
    found = [id(x) for x in unique_tensors(model, attributes=True)]
    assert found == _each_on_its_own(model) and id(t) in found
