"""Closed-form 1F1B timing (cost/pipeline.py) against the simulator's exact replay."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ethpipe.cost.pipeline import equal_sizes_makespans, lines_that_can_lead, stage_finish_s, steady_lines
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.sim import simulate

from _sim_fakes import FreeSyncTiming


class _Table(FreeSyncTiming):
    """Timing model whose stage times come from explicit (fwd, bwd) per stage and size."""

    def __init__(self, fwd: dict, bwd: dict) -> None:
        self.fwd, self.bwd = fwd, bwd

    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        s = stage.ranks[0]
        return self.fwd[(s, micro_batch)], self.bwd[(s, micro_batch)]



def _simulated_flush(fwd: np.ndarray, bwd: np.ndarray, sizes: list[int]) -> list[float]:
    depth = fwd.shape[0]
    stages = tuple(Stage((s,), "x", (s, s + 1)) for s in range(depth))
    pipe = Pipeline(stages, tuple(sizes))
    plan = Plan(method="eth", model="tiny", global_batch_size=sum(sizes), seq_len=16, pipelines=(pipe,),
                blocks=compute_blocks([pipe]))
    table = {(s, x): j for j, x in enumerate(sizes) for s in range(depth)}
    model = _Table({k: fwd[k[0], v] for k, v in table.items()}, {k: bwd[k[0], v] for k, v in table.items()})
    return [r.flush_s for r in simulate(plan, model).ranks]


def _case(rng: random.Random, balanced: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
    depth, m, b = rng.randint(1, 6), rng.randint(1, 10), rng.randint(1, 4)
    sizes = [b] * (m - 1) + [rng.randint(1, b)]
    per = [rng.uniform(0.9, 1.1) if balanced else rng.uniform(0.3, 3.0) for _ in range(depth)]
    ratio = rng.uniform(1.5, 3.0)
    fwd = np.array([[per[i] * x for x in sizes] for i in range(depth)])
    return fwd, ratio * fwd, sizes


@pytest.mark.parametrize("balanced", [True, False])
def test_lower_bound_of_simulation_and_close(balanced: bool) -> None:
    rng = random.Random(7)
    errors = []
    for _ in range(60):
        fwd, bwd, sizes = _case(rng, balanced)
        exact = np.array(_simulated_flush(fwd, bwd, sizes))
        closed = stage_finish_s(fwd, bwd)
        assert np.all(closed <= exact + 1e-9)
        errors.append((exact[0] - closed[0]) / exact[0])
    assert max(errors) < (0.01 if balanced else 0.06)


def test_hand_computed_front_bottleneck() -> None:
    # test_sim_engine's unequal stages: the cooldown hides stage 1's round trip (S + (m-1)M would say 21).
    fwd, bwd = np.array([[3.0, 3.0], [1.0, 1.0]]), np.array([[6.0, 6.0], [2.0, 2.0]])
    assert list(stage_finish_s(fwd, bwd)) == [18.0, 9.0]


def test_fast_table_agrees_and_is_linear_when_steady() -> None:
    rng = random.Random(3)
    for _ in range(40):
        fwd, bwd, sizes = _case(rng, True)
        if len(sizes) < 2:
            continue
        m = len(sizes)
        fast = equal_sizes_makespans(fwd[:, 0], bwd[:, 0], fwd[None, :, -1], bwd[None, :, -1], np.array([m]))[0, 0]
        assert fast <= stage_finish_s(fwd, bwd)[0] * (1 + 1e-9)
        if m >= fwd.shape[0] + 2:
            c, slope = steady_lines(fwd[:, 0], bwd[:, 0], fwd[None, :, -1], bwd[None, :, -1])
            assert np.max(c[0] + m * slope) == pytest.approx(fast)


def test_the_steady_lines_left_out_never_hold_the_max_bit_for_bit() -> None:
    """``lines_that_can_lead`` drops lines from T(n)'s extension; the max over the rest must equal the max over all
    with ``==`` for every m of the range: on 1F1B's own steady lines of random pipelines (ties included: equal
    stages give equal lines), and on random lines crossing inside the range. It must also drop something, or
    it buys nothing. Fails if the lines are compared at the range's first end only."""
    rng = np.random.default_rng(7)
    dropped = 0
    for trial in range(300):
        depth, rows = int(rng.integers(1, 33)), int(rng.integers(1, 5))
        if trial % 2:
            f = rng.uniform(0.5, 2.0, depth) if trial % 3 else np.full(depth, 1.0)
            b = f * rng.uniform(1.5, 3.0, depth)
            scale = np.arange(1, rows + 1)[:, None] / rows
            c, slope = steady_lines(f, b, f[None, :] * scale, b[None, :] * scale)
        else:
            c, slope = rng.uniform(-50, 50, (rows, 2 * depth)), rng.uniform(0.0, 3.0, 2 * depth)
        lo = float(rng.integers(1, 40))
        m = np.arange(lo, lo + float(rng.integers(1, 4000)))
        keep = lines_that_can_lead(c, slope, m[0], m[-1])
        dropped += slope.size - keep.size
        every = np.max(c[None, :, :] + m[:, None, None] * slope[None, None, :], axis=-1)
        kept = np.max(c[None, :, keep] + m[:, None, None] * slope[None, None, keep], axis=-1)
        assert np.array_equal(every, kept), trial
    assert dropped > 0
