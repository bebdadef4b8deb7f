"""The interleaved family's pre-score finds its threshold by bisection over the kinks of a non-decreasing
piecewise-linear function; it must be exactly what scanning every kink in order finds."""

from __future__ import annotations

import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from ethpipe.planner.devices.hybrid import crossing_s, held_curve, prescore_s


class _Bounds:
    """What ``prescore_s`` reads from ``LowerBounds``: the model's layers and each stage type's options."""

    def __init__(self, num_layers: int, options: dict[tuple[str, int], tuple[tuple[float, int], ...]]) -> None:
        self.cost = SimpleNamespace(model=SimpleNamespace(num_layers=num_layers))
        self.options = options
        self.device_memo: dict = {}

    def position_options(self, device: str, tp: int, b: int, in_flight: int, recompute: str):  # noqa: ANN201
        return self.options[(device, tp)]


def _scan(bounds: _Bounds, stages: Counter, num_samples: float, recompute: str) -> float:
    """The definition: every kink in increasing order until the stages hold the model."""
    num_layers = bounds.cost.model.num_layers
    curve = held_curve(bounds, stages, recompute)  # type: ignore[arg-type]
    if curve is None:
        return math.inf
    held, kinks = curve
    lo = 0.0
    for hi in kinks:
        if held(hi) >= num_layers:
            return crossing_s(lo, hi, held(lo), held(hi), num_layers) * (num_samples + sum(stages.values()) - 1)
        lo = hi
    return math.inf


@pytest.mark.parametrize("seed", range(4))
def test_the_bisection_is_the_scan(seed: int) -> None:
    """Also with the kink table kept: one bounds object asked for the same types at other stage counts (as the
    pre-score is at every pipeline count) and in other orders still gives the scan's value for each."""
    rng = random.Random(seed)
    finite = 0
    for _ in range(100):
        types = [(f"gpu{i}", rng.choice([1, 2, 4])) for i in range(rng.randint(1, 4))]
        options = {t: tuple((rng.uniform(1e-4, 1e-2), rng.randint(0, 12)) for _ in range(rng.randint(1, 3)))
                   for t in types}
        bounds = _Bounds(rng.randint(2, 96), options)
        orders = set()
        for _ in range(4):
            order = rng.sample(types, len(types))
            orders.add(tuple(order))
            stages = Counter({t: rng.randint(1, 8) for t in order})
            want = _scan(bounds, stages, 64.0, "auto")
            assert prescore_s(bounds, stages, 64.0, "auto") == want  # type: ignore[arg-type]
            finite += math.isfinite(want)
        assert len(bounds.device_memo) == len(orders)  # one table per type order, whatever the counts
    assert 50 < finite < 400  # both outcomes are exercised
