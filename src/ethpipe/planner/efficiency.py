"""Balance efficiency, decomposed (docs/cost-model.md, "Efficiency factors").

``balance_efficiency = ideal / T`` is written as a telescoping product over a chain of times

    ideal <= ideal_active <= X(A) <= X(B) <= X(F') <= X(F) <= M <= T_nosync <= T

so every factor is a ratio of two neighbours, lies in (0, 1] and their product is exactly the
efficiency. ``X(.)`` is the capacity-weighted mean over pipelines (weight = the pipeline's
share of the cluster's achievable FLOP/s), so each factor reads as "the fraction of the
cluster's compute capacity lost to this cause". ``ideal`` counts every device of the cluster,
``ideal_active`` only those with a rank (the first factor, ``idle``, is the capacity of the
devices the plan leaves idle); per pipeline p:

* ``A_p`` capacity-weighted mean of its ranks' compute seconds, ``B_p`` its slowest stage's;
* ``F'_p`` its flush with compute only (no p2p receives), ``F_p`` its flush as priced.

``M`` = slowest flush, ``T_nosync`` = the iteration if gradient sync were free (the slowest flush, its last
sends included, then the step's stats all-gather and the slowest optimizer step: every optimizer step waits for
the gather), ``T`` = the iteration. Why a chain, not independent
ratios: independent ratios do not multiply to the efficiency, so they cannot say which cause
dominates.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ethpipe.cost.model import CostModel
from ethpipe.cost.schedule_time import stage_finish_of
from ethpipe.plan import Pipeline, Plan
from ethpipe.schedule import SPLIT_SCHEDULES
from ethpipe.planner.estimate import Estimate, estimate_plan, full_ideal_time_s, ideal_time_s

FACTORS = ("idle", "compute", "layer_granularity", "bubble", "p2p", "data_balance", "optimizer", "grad_sync")


def _compute_only_flush_s(plan: Plan, cost: CostModel, p: int, cache: dict) -> float:
    """Pipeline p's flush with every receive removed (stage compute only), by the same closed form."""
    pipe = plan.pipelines[p]
    key = (tuple((s.device, s.tp, s.chunk_layers if s.sublayers == 1 else s.layer_ranges, s.recompute)
                 for s in pipe.stages), pipe.micro_batch_sizes, pipe.schedule)
    if key not in cache:
        cache[key] = _flush_s(pipe, cost)
    return cache[key]


def _flush_s(pipe: Pipeline, cost: CostModel) -> float:
    """The pipeline's flush with free communication, per virtual stage when interleaved."""
    split, v = pipe.schedule in SPLIT_SCHEDULES, pipe.depth * pipe.num_chunks
    parts = [(vs, pipe.stages[vs % pipe.depth]) for vs in range(v)]
    parts = [(vs, st.chunk(vs // pipe.depth) if pipe.num_chunks > 1 else st) for vs, st in parts]
    per_size = {x: [cost.stage_compute_s(s, x, first=i == 0, last=i == v - 1)
                    + ((cost.weight_grad_s(s, x, first=i == 0, last=i == v - 1),) if split else ())
                    for i, s in parts]
                for x in set(pipe.micro_batch_sizes)}
    arrays = [np.array([[per_size[x][i][k] for x in pipe.micro_batch_sizes] for i in range(v)])
              for k in range(3 if split else 2)]
    return float(np.max(stage_finish_of(pipe.schedule, *arrays, unsplit=tuple(s.recompute for s in pipe.stages),
                                        num_chunks=pipe.num_chunks)))


def efficiency_factors(plan: Plan, cost: CostModel, est: Estimate | None = None, *,
                       flat_sync: bool = False, ideal_s: float | None = None) -> dict[str, float]:
    """The factors of ``FACTORS`` (each in (0, 1] on analytic cost models), product = ideal / iteration.
    ``ideal_s``: ``full_ideal_time_s`` if the caller has it (it rebuilds the full cluster for idle plans)."""
    est = est or estimate_plan(plan, cost, flat_sync=flat_sync)
    rate: Mapping[str, float] = {t: cost.achievable_flops(t) for t in cost.cluster.gpu_types}
    capacity = sum(rate[d.gpu.id] for d in cost.cluster.devices)
    cache: dict = {}
    x_a = x_b = x_fc = x_f = 0.0
    for p, pipe in enumerate(plan.pipelines):
        ranks = [(r, stage.device) for stage in pipe.stages for r in stage.ranks]
        pipe_rate = sum(rate[dev] for _, dev in ranks)
        weight = pipe_rate / capacity
        x_a += weight * sum(rate[dev] * est.busy_s[r] for r, dev in ranks) / pipe_rate
        x_b += weight * max(est.busy_s[r] for r, _ in ranks)
        x_fc += weight * _compute_only_flush_s(plan, cost, p, cache)
        x_f += weight * est.pipeline_times_s[p]
    full = ideal_s if ideal_s is not None else full_ideal_time_s(cost, plan.global_batch_size)
    chain = (full, ideal_time_s(cost, plan.global_batch_size), x_a, x_b, x_fc, x_f, est.makespan_s, est.no_sync_iteration_s,
             est.iteration_time_s)
    return {name: lo / hi for name, lo, hi in zip(FACTORS, chain, chain[1:])}


def format_factors(factors: Mapping[str, float]) -> str:
    """One line for `ethpipe plan`: the factors, largest loss first."""
    ordered = sorted(factors.items(), key=lambda kv: kv[1])
    return "  ".join(f"{name.replace('_', ' ')} {value:.3f}" for name, value in ordered)
