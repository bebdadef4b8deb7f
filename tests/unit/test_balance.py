import itertools
import random

import numpy as np
import pytest

from ethpipe.planner.samples.balance import balance_samples, makespan_s
from ethpipe.planner.layers.timing import PipelineTiming


def _timing(rng: random.Random, granularity: bool = False) -> PipelineTiming:
    b = rng.randint(1, 4)
    depth = rng.randint(1, 3)
    per_sample = np.array([rng.uniform(0.5, 2.0) for _ in range(depth)])
    fixed = np.array([rng.uniform(0.0, 0.2) for _ in range(depth)])
    return PipelineTiming(b, lambda x: (fixed + x * per_sample, fixed + 2 * x * per_sample), b if granularity else 1)


def test_time_is_monotone_and_inverse_is_exact() -> None:
    rng = random.Random(1)
    for _ in range(50):
        t = _timing(rng)
        times = [t.time_s(n) for n in range(1, 40)]
        assert all(a <= b + 1e-12 for a, b in zip(times, times[1:]))
        for n in range(1, 40):
            assert t.time_s(n) >= t.finish_s(n)[0] * (1 - 0.1)  # the fast bound stays close to the estimator's
            limit = t.time_s(n)
            assert t.max_samples_within(limit, 100) == max(k for k in range(1, 101) if t.time_s(k) <= limit)


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


def test_whole_micro_batches_only() -> None:
    b = 4
    fast = PipelineTiming(b, lambda x: (np.array([1.0 * x]), np.array([2.0 * x])), b)
    slow = PipelineTiming(b, lambda x: (np.array([3.0 * x]), np.array([6.0 * x])), b)
    samples = balance_samples([fast, slow], [1, 2], 64)
    assert all(n % b == 0 for row in samples for n in row) and sum(map(sum, samples)) == 64
    assert samples[0][0] > samples[1][0]


def test_batch_smaller_than_pipelines_is_a_clear_error() -> None:
    t = _timing(random.Random(0))
    with pytest.raises(ValueError, match="global batch 2 is smaller than the 3 pipelines"):
        balance_samples([t], [3], 2)


def test_faster_pipeline_gets_more_samples() -> None:
    fast = PipelineTiming(1, lambda x: (np.array([x * 0.5]), np.array([x * 0.5])))
    slow = PipelineTiming(1, lambda x: (np.array([x * 1.5]), np.array([x * 1.5])))
    assert balance_samples([fast, slow], [1, 1], 40) == [[30], [10]]


def test_whole_micro_batches_that_cannot_make_the_batch_are_infeasible() -> None:
    # Found by tests/unit/test_bounds.py: one pipeline of 2-sample micro-batches and a batch of 3 was
    # "balanced" to 2 samples, and the planner priced a plan that drops a sample.
    from ethpipe.errors import Infeasible

    timing = PipelineTiming(2, lambda x: (np.array([0.1 * x]), np.array([0.2 * x])), 2)
    with pytest.raises(Infeasible, match="not a whole number of micro-batches of 2 samples"):
        balance_samples([timing], [1], 3)
    with pytest.raises(Infeasible, match="micro-batches of 2 samples"):
        balance_samples([timing], [2], 5)
    assert balance_samples([timing], [2], 6) in ([[4, 2]], [[2, 4]])


def _deep_timing(rng: random.Random) -> PipelineTiming:
    """Unequal stages (fixed and per-sample parts, backward not a multiple of forward), depth up to 8."""
    b, depth = rng.randint(1, 4), rng.randint(1, 8)
    fixed_f, fixed_b = (np.array([rng.uniform(0.0, 0.3) for _ in range(depth)]) for _ in range(2))
    per_f, per_b = (np.array([rng.uniform(0.2, 3.0) for _ in range(depth)]) for _ in range(2))
    return PipelineTiming(b, lambda x: (fixed_f + x * per_f, fixed_b + x * per_b))


def test_time_never_exceeds_the_flush_it_bounds() -> None:
    """``evaluate_groups`` gives up on a balance whose T(n) passes its cutoff by more than 1e-9, because T(n) is at
    most the flush (``finish_s(n)[0]``) up to rounding (some of its paths, ``cost/pipeline.py``): hold it to 1e-12."""
    rng = random.Random(7)
    for _ in range(200):
        t = _deep_timing(rng)
        for n in list(range(1, 30)) + [rng.randint(30, 300) for _ in range(5)]:
            assert t.time_s(n) <= float(t.finish_s(n)[0]) * (1 + 1e-12), n


@pytest.mark.parametrize("seed", range(60))
def test_giving_up_at_a_time_is_exactly_the_splits_that_cannot_fit_it(seed: int) -> None:
    """``give_up_at_s``: None iff no split keeps every T(n) within it (brute force), else the same split as
    without the question."""
    rng = random.Random(seed)
    timings = [_timing(rng) for _ in range(rng.randint(1, 3))]
    counts = [rng.randint(1, 2) for _ in timings]
    flat = [t for t, c in zip(timings, counts) for _ in range(c)]
    total = rng.randint(len(flat), 12)
    best = min(max(t.time_s(n) for t, n in zip(flat, split))
               for split in itertools.product(range(1, total + 1), repeat=len(flat)) if sum(split) == total)
    plain = balance_samples(timings, counts, total)
    for limit in (best * 0.5, best * (1 - 1e-9), best, best * (1 + 1e-9), best * 2):
        got = balance_samples(timings, counts, total, give_up_at_s=limit)
        assert (got is None) == (limit < best), (limit, best)
        assert got is None or got == plain


def test_inverse_on_a_fresh_table_is_the_inverse_on_a_full_one() -> None:
    """``max_samples_within`` / ``samples_below`` extend T only as far as the limit needs: the same answers as on a
    table already extended to ``upper``, asked in any order."""
    rng = random.Random(3)
    for _ in range(40):
        seed = rng.random()
        lazy, full = (_deep_timing(random.Random(seed)) for _ in range(2))
        upper = rng.randint(50, 2000)
        full.time_s(upper)
        for limit in sorted((rng.uniform(0.0, full.time_s(upper) * 1.2) for _ in range(6)), key=lambda _: rng.random()):
            assert lazy.max_samples_within(limit, upper) == full.max_samples_within(limit, upper)
            assert lazy.samples_below(limit, upper) == full.samples_below(limit, upper)
        assert lazy.time_s(upper) == full.time_s(upper)
