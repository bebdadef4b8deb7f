"""Online data rebalancing (docs/design.md §2.4): re-split the global batch from measured pipeline rates.

ETH balances with data, so a straggler (throttling, a noisy neighbour, an injected
``--emulate-slowdown``) is absorbed by moving *samples*, not weights: same groups, same
stages, same global batch in the same global order, only each pipeline's sample count (and
so its number of micro-batches) changes at a step boundary. Level 3 of the planner is
re-solved here as a small pure function on a time model fitted from measurements, because
the runtime must not import the planner.

Time model of pipeline p with stages s (1F1B, micro-batch size b_p, n_p samples)::

    T_p(n) = n * u_max + b_p * (sum_s u_s - u_max)        u_s = stage s's busy time per sample

(``(m - 1)`` bottleneck slots plus one fill/drain pass). Every rank feeds the same
all-gathered numbers to the same pure functions, so every rank takes the same decision.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ethpipe.errors import UserError
from ethpipe.plan import Pipeline, Plan


@dataclass(frozen=True)
class RebalanceConfig:
    """``--rebalance every=K[,threshold=F][,window=W]``: decide every K steps from the last W."""

    every: int
    threshold: float = 0.05  # re-split only if it shortens the predicted makespan by more than this fraction
    window: int = 0  # steps of measurements the rates are the median of (0: = every)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise UserError(f"--rebalance every must be >= 1, got {self.every}")
        if not 0.0 <= self.threshold < 1.0:
            raise UserError(f"--rebalance threshold must be in [0, 1), got {self.threshold}")
        if self.window < 0:
            raise UserError(f"--rebalance window must be >= 1 (or 0 for = every), got {self.window}")

    @property
    def window_steps(self) -> int:
        return self.window or self.every


def parse_rebalance(text: str) -> RebalanceConfig:
    """``every=K[,threshold=F][,window=W]`` -> RebalanceConfig (one-line UserError otherwise)."""
    usage = f"--rebalance '{text}' must look like every=K[,threshold=0.05][,window=K], e.g. every=5"
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("every", "threshold", "window") or key in fields:
            raise UserError(usage)
        fields[key] = value.strip()
    if "every" not in fields:
        raise UserError(usage)
    try:
        every, window = int(fields["every"]), int(fields.get("window", "0"))
        threshold = float(fields.get("threshold", "0.05"))
    except ValueError:
        raise UserError(usage) from None
    if not math.isfinite(threshold):
        raise UserError(usage)
    return RebalanceConfig(every, threshold, window)


@dataclass(frozen=True)
class PipelineModel:
    """Fitted ``T(n) = fixed_s + per_sample_s * n`` of one pipeline."""

    per_sample_s: float  # bottleneck stage's busy time per sample
    fixed_s: float  # fill/drain: one micro-batch through the non-bottleneck stages

    def time_s(self, num_samples: int) -> float:
        return self.fixed_s + self.per_sample_s * num_samples


def fit_models(plan: Plan, stage_rates_s: Sequence[Sequence[float]]) -> tuple[PipelineModel, ...]:
    """Per pipeline, from each stage's measured busy seconds per sample (pipeline by pipeline).
    ``plan`` is the launched plan: its micro-batch sizes are the ones every split keeps."""
    out = []
    for pipe, rates in zip(plan.pipelines, stage_rates_s, strict=True):
        assert len(rates) == pipe.depth and all(r >= 0 for r in rates)
        u_max = max(rates)
        out.append(PipelineModel(max(u_max, 1e-12), max(pipe.micro_batch_sizes) * (sum(rates) - u_max)))
    return tuple(out)


def water_fill(models: Sequence[PipelineModel], total: int, min_samples: int = 1) -> tuple[int, ...]:
    """Integer samples per pipeline summing to ``total`` that minimise ``max_p T_p(n_p)``.

    Water-filling: every pipeline starts at ``min_samples``; each further sample goes to the
    pipeline that would finish it earliest (ties: lowest index). Greedy is optimal here because
    each T_p is increasing in n, and it is O(total log P).
    """
    if total < min_samples * len(models):
        raise UserError(f"global batch {total} cannot give {min_samples} sample(s) to each of {len(models)} pipelines")
    counts = [min_samples] * len(models)
    heap = [(m.time_s(min_samples + 1), p) for p, m in enumerate(models)]
    heapq.heapify(heap)
    for _ in range(total - min_samples * len(models)):
        _, p = heapq.heappop(heap)
        counts[p] += 1
        heapq.heappush(heap, (models[p].time_s(counts[p] + 1), p))
    return tuple(counts)


def makespan_s(models: Sequence[PipelineModel], counts: Sequence[int]) -> float:
    return max(m.time_s(n) for m, n in zip(models, counts, strict=True))


def micro_batch_sizes(num_samples: int, micro_batch_size: int) -> tuple[int, ...]:
    """Full micro-batches of the pipeline's size, the remainder as a smaller last one."""
    assert num_samples >= 1 and micro_batch_size >= 1
    full, rest = divmod(num_samples, micro_batch_size)
    return (micro_batch_size,) * full + ((rest,) if rest else ())


def with_split(plan: Plan, counts: Sequence[int]) -> Plan:
    """The launched ``plan`` with each pipeline's samples set to ``counts``; each pipeline keeps its
    micro-batch size (so activation memory per micro-batch is what the planner checked)."""
    assert len(counts) == len(plan.pipelines) and sum(counts) == plan.global_batch_size
    pipes = tuple(p if p.num_chunks > 1 and n == p.num_samples  # interleaved: kept (``decide``)
                  else Pipeline(p.stages, micro_batch_sizes(n, max(p.micro_batch_sizes)), p.schedule)
                  for p, n in zip(plan.pipelines, counts))
    return dataclasses.replace(plan, pipelines=pipes)


def split_of(plan: Plan) -> tuple[int, ...]:
    return tuple(p.num_samples for p in plan.pipelines)


@dataclass(frozen=True)
class Decision:
    """What one rebalancing check found (logged in the metrics line of the step it follows)."""

    old_split: tuple[int, ...]
    new_split: tuple[int, ...]
    stage_rates_s: tuple[tuple[float, ...], ...]  # measured busy s per sample, per pipeline per stage
    predicted_old_s: float
    predicted_new_s: float
    applied: bool

    @property
    def gain(self) -> float:
        """Fraction of the predicted makespan the new split saves (the imbalance being fixed)."""
        return 1.0 - self.predicted_new_s / self.predicted_old_s if self.predicted_old_s > 0 else 0.0

    def to_record(self) -> dict[str, Any]:
        return {"old_split": list(self.old_split), "new_split": list(self.new_split), "applied": self.applied,
                "gain": self.gain, "predicted_old_s": self.predicted_old_s, "predicted_new_s": self.predicted_new_s,
                "per_sample_s": [list(r) for r in self.stage_rates_s]}


def decide(base: Plan, current: Plan, stage_rates_s: Sequence[Sequence[float]], threshold: float) -> Decision:
    """Re-solve level 3 from measured rates; apply only if it saves more than ``threshold``.
    ``base`` is the launched plan (micro-batch sizes), ``current`` the split now running."""
    models = fit_models(base, stage_rates_s)
    old = split_of(current)
    # An interleaved pipeline keeps its samples (its micro-batch count is constrained: schedule.interleaved_fits).
    free = [p for p, pipe in enumerate(base.pipelines) if pipe.num_chunks == 1]
    new_list = list(old)
    if free:
        kept = sum(n for p, n in enumerate(old) if p not in free)
        for p, n in zip(free, water_fill([models[p] for p in free], base.global_batch_size - kept)):
            new_list[p] = n
    new = tuple(new_list)
    t_old, t_new = makespan_s(models, old), makespan_s(models, new)
    gain = 1.0 - t_new / t_old if t_old > 0 else 0.0
    rates = tuple(tuple(float(r) for r in row) for row in stage_rates_s)
    return Decision(old, new, rates, t_old, t_new, applied=new != old and gain > threshold)


class RateWindow:
    """The last ``window`` steps' busy seconds per sample of every rank (identical on every rank)."""

    def __init__(self, window: int) -> None:
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, plan: Plan, rank_busy_s: Sequence[float]) -> None:
        """One step's busy time of each rank under ``plan``'s split, as time per sample."""
        per_sample = [0.0] * plan.world_size
        for pipe in plan.pipelines:
            for rank in pipe.ranks:
                per_sample[rank] = rank_busy_s[rank] / pipe.num_samples
        self._rows.append(tuple(per_sample))

    def clear(self) -> None:
        self._rows.clear()

    def stage_rates_s(self, plan: Plan) -> tuple[tuple[float, ...], ...]:
        """Median per rank over the window; a stage with tp ranks takes its slowest rank."""
        medians = [statistics.median(col) for col in zip(*self._rows)]
        return tuple(tuple(max(medians[r] for r in stage.ranks) for stage in pipe.stages) for pipe in plan.pipelines)


class Rebalancer:
    """Collects rates each step; every ``every`` steps decides (same inputs on every rank).

    ``plan`` is the split to run next: the launched plan until a decision changes it.
    """

    def __init__(self, base: Plan, config: RebalanceConfig) -> None:
        self.base = base
        self.plan = base
        self.config = config
        self.window = RateWindow(config.window_steps)

    def observe(self, step: int, rank_busy_s: Sequence[float]) -> Decision | None:
        """Record step ``step`` (run under ``self.plan``); a Decision at a check step, else None."""
        self.window.add(self.plan, rank_busy_s)
        if (step + 1) % self.config.every or len(self.window) < min(self.config.window_steps, self.config.every):
            return None
        decision = decide(self.base, self.plan, self.window.stage_rates_s(self.plan), self.config.threshold)
        if decision.applied:
            self.plan = with_split(self.base, decision.new_split)
            self.window.clear()  # per-sample rates depend a little on micro-batch counts: measure afresh
        return decision
