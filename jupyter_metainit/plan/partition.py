"""Cut a sequence of parts into one contiguous range per device, minimising the bottleneck.

The bottleneck is the most loaded device relative to its capacity (peak / capacity). A
device's peak only grows when a part is added to it, so whether a bottleneck ``r`` is
reachable is decided exactly by filling the devices in order, each as far as ``r`` allows;
bisection over ``r`` then finds the least reachable bottleneck (to a relative 1e-12). This is
the exact answer of the min-max contiguous partition, in O(parts x 60), not a greedy first-fit
at the devices' full capacity. :func:`partition_by_dp` is the textbook dynamic programme over
all cuts, kept as the tests' reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Costs", "Load", "device_loads", "fill", "partition", "partition_by_dp"]


@dataclass(frozen=True)
class Costs:
    """What one part adds to a device. Inference: ``weights + cache`` stay, ``transient``
    is the largest working set while it runs. Training also: ``grads``, ``states`` (optimizer
    states and master weights), ``saved`` (activations kept for backward) and ``backward``
    (the most its backward holds: what it saved, its output's gradient, temporaries, its
    weights' gradients)."""

    weights: int = 0
    cache: int = 0
    transient: int = 0
    grads: int = 0
    states: int = 0
    saved: int = 0
    step_all: int = 0  # the optimizer step's temporaries for all its parameters at once
    step_one: int = 0  # ... for its largest parameter (an update one tensor at a time)
    backward: int = 0


class Load:
    """A device's predicted peak as parts are added in pipeline order.

    Inference: weights + the largest of (the caches of the device's earlier parts + a part's
    transient) and all its caches. Training, per step: weights and optimizer states stay;
    forward through part k the device holds the activations its earlier parts saved and k's
    working set; going backward through part k it holds the activations saved by its parts
    before k, the gradients of its parts after k, and what k's backward holds:
    ``max_k (saved[<k] + grads[>k] + backward[k])``; the optimizer step holds every gradient
    plus the update's temporaries (``foreach``: for all parameters at once, as torch's
    optimizers do on accelerators; else for one tensor at a time, as on the CPU).
    """

    _SUMS = (
        "weights",
        "cache",
        "transient",
        "grads",
        "states",
        "saved",
        "forward",
        "behind",
        "step_all",
        "step_one",
    )
    __slots__ = ("foreach", "training", *_SUMS)

    def __init__(self, training: bool, foreach: bool = True) -> None:
        self.training = training
        self.foreach = foreach
        self.weights = self.cache = self.transient = 0
        self.grads = self.states = self.saved = 0
        self.step_all = self.step_one = 0
        self.forward = 0  # max_k (saved[<k] + transient[k])
        self.behind = 0  # max_k (saved[<k] - grads[<=k] + backward[k])

    def add(self, c: Costs) -> None:
        self.weights += c.weights
        # While it runs, the caches of this device's earlier parts stay (its own cache is in
        # its transient: made during its forward).
        self.transient = max(self.transient, self.cache + c.transient)
        self.cache += c.cache
        if self.training:
            self.forward = max(self.forward, self.saved + c.transient)
            self.behind = max(self.behind, self.saved - self.grads - c.grads + c.backward)
            self.saved += c.saved
            self.grads += c.grads
            self.states += c.states
            self.step_all += c.step_all
            self.step_one = max(self.step_one, c.step_one)

    def copy(self) -> Load:
        new = Load(self.training, self.foreach)
        for name in Load._SUMS:
            setattr(new, name, getattr(self, name))
        return new

    @property
    def peak(self) -> int:
        if not self.training:
            return self.weights + max(self.cache, self.transient)
        step = self.step_all if self.foreach else self.step_one
        working = max(self.forward, self.grads + self.behind, self.grads + step)
        return self.weights + self.states + working


def _fill(
    costs: Sequence[Costs], capacities: Sequence[int], start: Sequence[Load], ratio: float
) -> list[int] | None:
    """Cuts (the first part of each device) filling each device up to ``ratio`` of its
    capacity, or ``None`` when the parts do not all fit that way."""
    if any(load.peak > ratio * cap for load, cap in zip(start, capacities, strict=True)):
        return None
    cuts, end = fill(costs, capacities, start, ratio)
    return cuts if end == len(costs) else None


def fill(
    costs: Sequence[Costs], capacities: Sequence[int], start: Sequence[Load], ratio: float
) -> tuple[list[int], int]:
    """Fill each device in order up to ``ratio`` of its capacity: the cuts, and how many parts
    found room."""
    cuts = []
    i = 0
    for d, capacity in enumerate(capacities):
        cuts.append(i)
        load = start[d].copy()
        limit = ratio * capacity
        while i < len(costs) and load.peak <= limit:
            load.add(costs[i])
            if load.peak > limit:
                break
            i += 1
    return cuts, i


def device_loads(costs: Sequence[Costs], cuts: Sequence[int], start: Sequence[Load]) -> list[Load]:
    """Each device's load for the given cuts."""
    loads = []
    for d, begin in enumerate(cuts):
        end = cuts[d + 1] if d + 1 < len(cuts) else len(costs)
        load = start[d].copy()
        for c in costs[begin:end]:
            load.add(c)
        loads.append(load)
    return loads


def partition(
    costs: Sequence[Costs], capacities: Sequence[int], start: Sequence[Load]
) -> tuple[list[int], float]:
    """Cuts minimising ``max(peak / capacity)`` and that bottleneck. ``start``: each device's
    load before the sequence (pinned parts)."""
    full = device_loads(costs, [0] + [len(costs)] * (len(capacities) - 1), start)
    # One device holding everything is an upper bound: from there bisect down.
    hi = max(load.peak / cap for load, cap in zip(full, capacities, strict=True))
    lo = max(load.peak / cap for load, cap in zip(start, capacities, strict=True))
    best = _fill(costs, capacities, start, hi) or [0] + [len(costs)] * (len(capacities) - 1)
    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        cuts = _fill(costs, capacities, start, mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    loads = device_loads(costs, best, start)
    return best, max(load.peak / cap for load, cap in zip(loads, capacities, strict=True))


def partition_by_dp(
    costs: Sequence[Costs], capacities: Sequence[int], start: Sequence[Load]
) -> float:
    """The least bottleneck over every way of cutting (O(devices x parts^2)): the reference."""
    n, inf = len(costs), float("inf")
    # best[d][i]: least bottleneck placing parts[:i] on devices[:d]
    best = [[inf] * (n + 1) for _ in range(len(capacities) + 1)]
    best[0][0] = 0.0
    for d, capacity in enumerate(capacities):
        for i in range(n + 1):
            if best[d][i] == inf:
                continue
            load = start[d].copy()
            for j in range(i, n + 1):
                if j > i:
                    load.add(costs[j - 1])
                value = max(best[d][i], load.peak / capacity)
                best[d + 1][j] = min(best[d + 1][j], value)
    return best[len(capacities)][n]
