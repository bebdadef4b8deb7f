import itertools
import random

import pytest

from ethpipe.planner.balance import balance_samples, makespan_s
from ethpipe.planner.timing import PipelineTiming, split_sizes


def _timing(rng: random.Random) -> PipelineTiming:
    b = rng.randint(1, 4)
    depth = rng.randint(1, 3)
    per_sample = [rng.uniform(0.5, 2.0) for _ in range(depth)]
    fixed = [rng.uniform(0.0, 0.5) for _ in range(depth)]

    def rows(x: int):
        t = [f + x * p for f, p in zip(fixed, per_sample)]
        return sum(t), max(t), tuple(0.0 for _ in t)

    return PipelineTiming(b, rows)


def test_time_matches_general_formula_and_is_monotone() -> None:
    rng = random.Random(1)
    for _ in range(50):
        t = _timing(rng)
        times = [t.time_s(n) for n in range(1, 30)]
        assert all(a <= b + 1e-12 for a, b in zip(times, times[1:]))
        for n in range(1, 30):
            assert t.time_s(n) == pytest.approx(t.time_of_sizes_s(split_sizes(n, t.micro_batch)))
            assert t.max_samples_within(t.time_s(n), 100) >= n


@pytest.mark.parametrize("seed", range(150))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    timings = [_timing(rng) for _ in range(rng.randint(1, 3))]
    counts = [rng.randint(1, 2) for _ in timings]
    flat = [t for t, c in zip(timings, counts) for _ in range(c)]
    total = rng.randint(len(flat), 12)
    samples = balance_samples(timings, counts, total)
    assert [len(r) for r in samples] == counts and sum(map(sum, samples)) == total
    assert min(min(r) for r in samples) >= 1
    best = min(max(t.time_s(n) for t, n in zip(flat, split))
               for split in itertools.product(range(1, total + 1), repeat=len(flat)) if sum(split) == total)
    assert makespan_s(timings, samples) == pytest.approx(best, rel=1e-9)


def test_batch_smaller_than_pipelines_is_a_clear_error() -> None:
    t = _timing(random.Random(0))
    with pytest.raises(ValueError, match="global batch 2 is smaller than the 3 pipelines"):
        balance_samples([t], [3], 2)


def test_faster_pipeline_gets_more_samples() -> None:
    fast = PipelineTiming(1, lambda x: (x * 1.0, x * 1.0, (0.0,)))
    slow = PipelineTiming(1, lambda x: (x * 3.0, x * 3.0, (0.0,)))
    assert balance_samples([fast, slow], [1, 1], 40) == [[30], [10]]
