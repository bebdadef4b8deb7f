import itertools
import math
import random

import numpy as np
import pytest

from ethpipe.cost.pipeline import stage_finish_s
from ethpipe.planner.layers.partition import StageOption, _greedy, bottleneck_of, flush_lower_bound_s, partition_layers


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _random_shape(rng: random.Random, min_layers: int, max_layers: int, max_depth: int, min_depth: int = 1):
    """(layers, depth, random stages): the cases the brute-force tests below draw."""
    layers = rng.randint(min_layers, max_layers)
    depth = rng.randint(min_depth, min(layers, max_depth))
    return layers, depth, _random_stages(rng, depth, layers)


def _random_stages(rng: random.Random, depth: int, layers: int):
    stages = []
    for _ in range(depth):
        per = rng.uniform(0.5, 3.0)
        opts = [StageOption(rng.uniform(0, 2.0), per, rng.randint(0, layers + 2), False)]
        if rng.random() < 0.5:
            opts.append(StageOption(opts[0].fixed_s, per * 1.33, rng.randint(0, layers), True))
        stages.append(opts)
    return stages


@pytest.mark.parametrize("seed", range(300))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers, depth, stages = _random_shape(rng, 1, 10, 5)
    best = min((b for c in _compositions(layers, depth) if (b := bottleneck_of(stages, c)) is not None),
               default=None)
    part = partition_layers(stages, layers)
    if best is None:
        assert part is None
        return
    assert part is not None and sum(part.num_layers) == layers and min(part.num_layers) >= 1
    assert part.bottleneck_s == pytest.approx(best, rel=1e-12)
    assert bottleneck_of(stages, part.num_layers) == pytest.approx(best, rel=1e-12)
    for opts, k, rc in zip(stages, part.num_layers, part.recompute):
        assert any(o.max_layers >= k and o.recompute == rc for o in opts)


def test_more_stages_than_layers_is_infeasible() -> None:
    assert partition_layers([[StageOption(0, 1, 10)]] * 3, 2) is None


def test_recompute_only_where_needed() -> None:
    opts = [[StageOption(0, 1.0, 2, False), StageOption(0, 1.3, 6, True)], [StageOption(0, 1.0, 6, False)]]
    part = partition_layers(opts, 6)
    assert part is not None and part.num_layers == (3, 3) and part.recompute == (True, False)


def _stage_times(stages, counts):
    return [min(o.time_s(k) for o in opts if o.max_layers >= k) for opts, k in zip(stages, counts)]


@pytest.mark.parametrize("seed", range(300))
def test_tie_break_matches_brute_force(seed: int) -> None:
    """Among the splits with the optimal bottleneck, the returned one has the least sum of squared stage times."""
    rng = random.Random(1000 + seed)
    layers, depth, stages = _random_shape(rng, 2, 11, 5, min_depth=2)
    if rng.random() < 0.5:  # identical stages: ties on the bottleneck are the rule, not the exception
        stages = [stages[0]] * depth
    feasible = [c for c in _compositions(layers, depth) if bottleneck_of(stages, c) is not None]
    part = partition_layers(stages, layers)
    if not feasible:
        assert part is None
        return
    best = min(bottleneck_of(stages, c) for c in feasible)
    optimal = [c for c in feasible if bottleneck_of(stages, c) <= best * (1 + 1e-12)]
    least = min(sum(t * t for t in _stage_times(stages, c)) for c in optimal)
    assert part is not None and part.bottleneck_s <= best * (1 + 1e-12)
    assert sum(t * t for t in _stage_times(stages, part.num_layers)) == pytest.approx(least, rel=1e-9)


def test_tie_break_fixes_the_lopsided_greedy() -> None:
    """13 equal layers on 4 equal stages: the greedy alone leaves (4, 4, 4, 1); the tie-break (4, 3, 3, 3)."""
    stages = [[StageOption(0.0, 1.0, 13)]] * 4
    assert _greedy(stages, 13, 4.0) == [4, 4, 4, 1]
    part = partition_layers(stages, 13)
    assert part is not None and part.bottleneck_s == 4.0
    assert sorted(part.num_layers, reverse=True) == [4, 3, 3, 3]


def _flush_of_split(stages, counts, num_micro_batches: int) -> float:
    """The estimator's flush of a split: each stage's time split 1:2 into forward and backward."""
    times = np.array(_stage_times(stages, counts))
    fwd = np.repeat(times[:, None] / 3, num_micro_batches, axis=1)
    return float(stage_finish_s(fwd, 2 * fwd)[0])


@pytest.mark.parametrize("seed", range(300))
def test_flush_lower_bound_never_exceeds_the_flush_of_the_split_level_2_makes(seed: int) -> None:
    rng = random.Random(5000 + seed)
    layers, _, stages = _random_shape(rng, 1, 14, 6)
    m = rng.randint(1, 9)
    part = partition_layers(stages, layers)
    bound, unfilled = flush_lower_bound_s(stages, layers, m), flush_lower_bound_s(stages, layers, m, fill=False)
    if part is None:
        assert math.isinf(bound) and math.isinf(unfilled)
        return
    flush = _flush_of_split(stages, part.num_layers, m)
    assert unfilled <= bound <= flush * (1 + 1e-12)
    assert bound >= m * part.bottleneck_s * (1 - 1e-12)  # at least the bottleneck stage's own work


def test_flush_lower_bound_is_exact_on_equal_stages() -> None:
    """8 layers on 4 equal stages, 6 micro-batches: (m + depth - 1) x 2 layers, the textbook 1F1B flush."""
    stages = [[StageOption(0.0, 1.0, 10)]] * 4
    part = partition_layers(stages, 8)
    assert part is not None and part.num_layers == (2, 2, 2, 2)
    assert flush_lower_bound_s(stages, 8, 6) == pytest.approx(_flush_of_split(stages, part.num_layers, 6)) == 18.0


def test_flush_lower_bound_when_a_fast_stage_could_hold_more_than_the_model() -> None:
    """Under the threshold (6 s: the slow stage's one layer) the fast stage holds 60 layers of a 4-layer model."""
    stages = [[StageOption(0.0, 0.1, 100)], [StageOption(5.0, 1.0, 100)]]
    part = partition_layers(stages, 4)
    assert part is not None and part.num_layers == (3, 1)
    assert flush_lower_bound_s(stages, 4, 3) <= _flush_of_split(stages, part.num_layers, 3) * (1 + 1e-12)
