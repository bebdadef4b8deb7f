"""Pipeline time of every schedule (cost/schedule_time.py, planner/layers/timing.py) against the simulator.

The replay is exact by construction; what is checked is that it prices the very lists the simulator
replays (300 random shapes: depths 1-8, ragged micro-batches, unequal stages, W shares, recomputing
stages that never split), that zb-h1 on equal stages is the paper's ``m (F+B+W) + (p-1)(F+B-W)``, and
that the planner's T(n) for zb-h1 (replayed up to 2 depth + 2 micro-batches, then the steady state's
growth) stays within 3% of the simulator far beyond that (measured worst: printed on failure).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from ethpipe.cost.schedule_time import replay_counts_s, replay_finish_s, stage_finish_of
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.planner.layers.timing import PipelineTiming, split_sizes
from ethpipe.sim import simulate

from _sim_fakes import FreeSyncTiming


class _Table(FreeSyncTiming):
    """Per-stage (fwd, bwd, W) seconds per micro-batch sample, times the micro-batch size."""

    def __init__(self, per_sample: list[tuple[float, float, float]]) -> None:
        self.per_sample = per_sample

    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        f, b, _ = self.per_sample[stage.ranks[0]]
        return f * micro_batch, b * micro_batch

    def weight_grad_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> float:
        return 0.0 if stage.recompute else self.per_sample[stage.ranks[0]][2] * micro_batch



def _shape(rng: random.Random) -> tuple[list[tuple[float, float, float]], tuple[bool, ...]]:
    depth = rng.randint(1, 8)
    stages = []
    for _ in range(depth):
        f = rng.uniform(0.3, 3.0)
        b = f * rng.uniform(1.5, 3.0)
        stages.append((f, b, b * rng.uniform(0.2, 0.6)))
    return stages, tuple(rng.random() < 0.15 for _ in range(depth))


def _simulated(stages: list[tuple[float, float, float]], unsplit: tuple[bool, ...], sizes: tuple[int, ...],
               schedule: str) -> np.ndarray:
    depth = len(stages)
    pipe = Pipeline(tuple(Stage((s,), "x", (s, s + 1), 1, unsplit[s]) for s in range(depth)), sizes, schedule)
    plan = Plan(method="eth", model="tiny", global_batch_size=sum(sizes), seq_len=16, pipelines=(pipe,),
                blocks=compute_blocks([pipe]))
    return np.array([r.flush_s for r in simulate(plan, _Table(stages)).ranks])


def _matrices(stages: list[tuple[float, float, float]], unsplit: tuple[bool, ...],
              sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    x = np.array(sizes, dtype=float)[None, :]
    f, b, w = (np.array([st[k] for st in stages])[:, None] * x for k in range(3))
    return f, b, np.where(np.array(unsplit)[:, None], 0.0, w)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_replay_is_the_simulators_timeline_on_300_random_shapes(schedule: str) -> None:
    rng = random.Random(11)
    for _ in range(300):
        stages, unsplit = _shape(rng)
        m, b = rng.randint(1, 20), rng.randint(1, 4)
        sizes = tuple([b] * (m - 1) + [rng.randint(1, b)])
        f, bw, w = _matrices(stages, unsplit, sizes)
        exact = _simulated(stages, unsplit, sizes, schedule)
        got = replay_finish_s(schedule, f, bw, w if schedule != "1f1b" else None, unsplit)
        assert got == pytest.approx(exact, rel=1e-12, abs=1e-12), (stages, unsplit, sizes)
        if schedule == "1f1b":  # and the closed form stays the lower bound it was
            assert np.all(stage_finish_of("1f1b", f, bw) <= exact + 1e-9)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_tabulated_replay_is_the_count_by_count_replay_bit_for_bit(schedule: str) -> None:
    """``replay_counts_s`` (T(n)'s table in one replay) against ``replay_finish_s`` once per micro-batch count and
    last size, compared with ``==``: the planner's plans must not move with it. 150 random shapes up to 2 depth + 2
    micro-batches, W shares, recomputing stages, 1-4 last sizes."""
    rng = random.Random(17)
    for _ in range(150):
        stages, unsplit = _shape(rng)
        depth, b = len(stages), rng.randint(1, 4)
        counts = rng.randint(1, 2 * depth + 2)
        full = tuple(m[:, 0] for m in _matrices(stages, unsplit, (b,)))
        last = tuple(m.T for m in _matrices(stages, unsplit, tuple(range(1, b + 1))))
        got = replay_counts_s(schedule, full, last, counts, unsplit)
        for m in range(1, counts + 1):
            for x in range(1, b + 1):
                f, bw, w = _matrices(stages, unsplit, (b,) * (m - 1) + (x,))
                assert got[x - 1, m - 1] == replay_finish_s(schedule, f, bw, w, unsplit).max(), (stages, unsplit, m, x)


@pytest.mark.parametrize("depth,m,f,b,w", [(4, 8, 1.0, 1.0, 1.0), (4, 4, 1.0, 1.0, 1.0), (6, 12, 1.0, 1.2, 0.8),
                                            (8, 16, 1.0, 1.0, 1.0)])
def test_zb_h1_on_equal_stages_is_the_papers_bubble(depth: int, m: int, f: float, b: float, w: float) -> None:
    """Qi et al. (2024): ZB-H1's bubble is (p - 1)(F + B - W) where 1F1B's is (p - 1)(F + B + W) (B: input
    gradient only; derived there for F = B = W, and it holds near that, as here)."""
    fwd, bwd, moved = np.full((depth, m), f), np.full((depth, m), b + w), np.full((depth, m), w)
    assert replay_finish_s("zb-h1", fwd, bwd, moved).max() == pytest.approx(m * (f + b + w) + (depth - 1) * (f + b - w))
    assert replay_finish_s("1f1b", fwd, bwd).max() == pytest.approx((m + depth - 1) * (f + b + w))


def test_planner_zb_h1_time_within_3_percent_of_the_simulator() -> None:
    rng = random.Random(5)
    worst = 0.0
    for _ in range(60):
        stages, unsplit = _shape(rng)
        b = rng.randint(1, 3)

        def rows(x: int, st=stages, un=unsplit) -> tuple[np.ndarray, np.ndarray]:
            f, bw, _ = _matrices(st, un, (x,))
            return f[:, 0], bw[:, 0]

        def weights(x: int, st=stages, un=unsplit) -> tuple[np.ndarray]:
            return (_matrices(st, un, (x,))[2][:, 0],)

        timing = PipelineTiming(b, rows, 1, "zb-h1", weights, unsplit)
        depth = len(stages)
        for n in sorted({rng.randint(1, b * (4 * depth + 6)) for _ in range(6)}):
            exact = float(_simulated(stages, unsplit, split_sizes(n, b), "zb-h1").max())
            worst = max(worst, abs(timing.time_s(n) - exact) / exact)
            assert timing.finish_s(n) == pytest.approx(_simulated(stages, unsplit, split_sizes(n, b), "zb-h1"))
    print(f"worst relative error {worst:.4f}")
    assert worst < 0.03, worst


class _ChunkTable(_Table):
    """Per virtual stage (fwd, bwd) seconds per sample (virtual stage v holds layer v), and receives whose
    seconds depend on the direction (so the ring's wrap-around is priced on its own link)."""

    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        f, b, _ = self.per_sample[stage.layers[0]]
        return f * micro_batch, b * micro_batch

    def weight_grad_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> float:
        return 0.0

    def p2p_s(self, src_rank: int, dst_rank: int, micro_batch: int) -> float:
        return 0.05 * micro_batch * (1 + src_rank + 2 * (dst_rank < src_rank))


def test_the_interleaved_replay_is_the_simulators_timeline_on_300_random_shapes() -> None:
    """Chunks of any size (a virtual stage per layer here), allowed micro-batch counts up to 4 groups, ragged
    last micro-batches; receives in the rows as the estimator builds them (``planner.layers.timing``), and given
    apart too, so that the senders wait for them (the simulator's rendezvous, units of an F and a B included)."""
    rng = random.Random(23)
    table = _ChunkTable([])
    for _ in range(300):
        depth, v = rng.randint(2, 6), rng.randint(2, 3)
        counts = [n for n in range(1, 4 * depth + 1) if n <= depth or n % depth == 0]
        m, b = rng.choice(counts), rng.randint(1, 3)
        sizes = tuple([b] * (m - 1) + [rng.randint(1, b)])
        table.per_sample = [(f, f * rng.uniform(1.5, 3.0), 0.0) for f in (rng.uniform(0.3, 3.0) for _ in range(depth * v))]
        stages = tuple(Stage((s,), "x", (s, s + 1), 1, False, tuple((c * depth + s, c * depth + s + 1) for c in range(v)))
                       for s in range(depth))
        pipe = Pipeline(stages, sizes, "interleaved")
        plan = Plan(method="eth", model="tiny", global_batch_size=sum(sizes), seq_len=16, pipelines=(pipe,),
                    blocks=compute_blocks([pipe]))
        exact = np.array([r.flush_s for r in simulate(plan, table).ranks])
        x = np.array(sizes, dtype=float)
        rank = [vs % depth for vs in range(depth * v)]
        act = np.array([[table.p2p_s(rank[vs - 1], rank[vs], n) if vs else 0.0 for n in sizes]
                        for vs in range(depth * v)])
        grad = np.array([[table.p2p_s(rank[vs + 1], rank[vs], n) if vs + 1 < depth * v else 0.0 for n in sizes]
                         for vs in range(depth * v)])
        f = np.array([[table.per_sample[vs][0] * n for n in sizes] for vs in range(depth * v)]) + act
        bw = np.array([[table.per_sample[vs][1] * n for n in sizes] for vs in range(depth * v)]) + grad
        got = replay_finish_s("interleaved", f, bw, num_chunks=v, recv=(act, grad))
        assert x.size == m and got == pytest.approx(exact, rel=1e-12, abs=1e-12), (depth, v, sizes)
