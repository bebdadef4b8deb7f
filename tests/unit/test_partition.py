import itertools
import random

import pytest

from ethpipe.planner.partition import StageOption, bottleneck_of, partition_layers


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _random_stages(rng: random.Random, depth: int, layers: int):
    stages = []
    for _ in range(depth):
        per = rng.uniform(0.5, 3.0)
        opts = [StageOption(rng.uniform(0, 2.0), per, rng.randint(0, layers), False)]
        if rng.random() < 0.5:
            opts.append(StageOption(opts[0].fixed_s, per * 1.33, rng.randint(0, layers), True))
        stages.append(opts)
    return stages


@pytest.mark.parametrize("seed", range(300))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers = rng.randint(1, 10)
    depth = rng.randint(1, min(layers, 5))
    stages = _random_stages(rng, depth, layers)
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
