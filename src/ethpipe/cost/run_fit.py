"""Learn the user's devices from a training run: per device type, how its measured compute compares with the model.

`ethpipe train` records every rank's forward and backward time per step (``rank_fwd_s`` / ``rank_bwd_s``, device
time on GPUs) and the micro-batch sizes each pipeline ran (``micro_batch_sizes``). Each (step, rank) is one
stage-level observation: the stage's measured time against the sum, over its micro-batches, of the model's time
for that stage (its layers' kernels, embedding and head included, recomputation priced: ``stage_compute_s``).
Stages of different layer counts and micro-batch sizes all inform the same per-type constants.

What is fitted is a scale per device type and pass (``DeviceScale``): measured compute = scale x the model's
(the TP all-reduces inside a tensor-parallel stage's passes are priced on the link and taken out of both sides,
as ``CostModel`` applies the scale to compute only). Stage times
cannot tell one kernel's efficiency from another's (a stage runs the same kernel mix at every depth, and a
run has one or two micro-batch sizes), so a per-kernel refit from them would move constants its data do not
pin; the scale corrects exactly what the run shows: how fast this type runs this model here. The median of
the per-observation ratios is used: a first step's warm-up, a garbage collection or a paused rank do not move it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ethpipe.cost.hardware import Calibration, DeviceScale
from ethpipe.cost.model import CostModel
from ethpipe.errors import UserError
from ethpipe.plan import Plan

SKIP_STEPS = 1  # the first step pays allocation, autotuning and compilation
RUN_FIELDS = ("rank_fwd_s", "rank_bwd_s", "micro_batch_sizes")


@dataclass(frozen=True)
class StageObservation:
    """One rank's forward and backward time in one step, and what the model predicted for them."""

    step: int
    rank: int
    device: str
    pipeline: int
    stage: int
    num_layers: int
    micro_batch_sizes: tuple[int, ...]
    fwd_s: float
    bwd_s: float
    predicted_fwd_s: float
    predicted_bwd_s: float
    comm_fwd_s: float = 0.0  # of the predicted: the TP all-reduces inside the passes (priced on the link, not fitted)
    comm_bwd_s: float = 0.0

    def compute_ratios(self) -> tuple[float, float]:
        """Measured over predicted compute of the forward and the backward (the TP all-reduces taken out of both)."""
        return ((self.fwd_s - self.comm_fwd_s) / (self.predicted_fwd_s - self.comm_fwd_s),
                (self.bwd_s - self.comm_bwd_s) / (self.predicted_bwd_s - self.comm_bwd_s))


def check_records(records: Sequence[Mapping[str, Any]], where: str) -> None:
    if not records:
        raise UserError(f"{where} holds no step records: give the --metrics file of an `ethpipe train` run")
    for record in records:
        missing = [f for f in ("step", *RUN_FIELDS) if f not in record]
        if missing:
            raise UserError(f"{where} has a line without field '{missing[0]}' (step {record.get('step', '?')}): it "
                            "was written by an older ethpipe; re-run the training with this one")


def stage_observations(plan: Plan, records: Iterable[Mapping[str, Any]], cost: CostModel,
                       skip_steps: int = SKIP_STEPS) -> list[StageObservation]:
    """Every (step, rank) of ``records`` after the first ``skip_steps`` steps, priced by ``cost``."""
    records = list(records)
    first_step = min((int(r["step"]) for r in records), default=0)
    out = []
    memo: dict[tuple[int, int, int], tuple[float, float, float, float]] = {}
    for rec in records:
        if int(rec["step"]) < first_step + skip_steps:
            continue
        sizes_by_pipe = rec["micro_batch_sizes"]
        if len(rec["rank_fwd_s"]) != plan.world_size or len(sizes_by_pipe) != len(plan.pipelines):
            raise UserError(f"step {rec['step']} of the metrics has {len(rec['rank_fwd_s'])} ranks and "
                            f"{len(sizes_by_pipe)} pipelines, the plan {plan.world_size} and {len(plan.pipelines)}: "
                            "give the --plan the run trained with")
        for rank in range(plan.world_size):
            pos = plan.position_of(rank)
            pipe = plan.pipelines[pos.pipeline]
            stage = pipe.stages[pos.stage]
            sizes = tuple(int(b) for b in sizes_by_pipe[pos.pipeline])
            totals = [0.0, 0.0, 0.0, 0.0]  # predicted fwd, bwd, and their TP all-reduces
            for b in sizes:
                key = (pos.pipeline, pos.stage, b)
                if key not in memo:
                    ends = {"first": pos.stage == 0, "last": pos.stage == pipe.depth - 1}
                    memo[key] = (*cost.stage_compute_s(stage, b, **ends), *cost.stage_tp_comm_s(stage, b, **ends))
                totals = [t + x for t, x in zip(totals, memo[key])]
            out.append(StageObservation(int(rec["step"]), rank, stage.device, pos.pipeline, pos.stage,
                                        stage.num_layers, sizes, float(rec["rank_fwd_s"][rank]),
                                        float(rec["rank_bwd_s"][rank]), *totals))
    return out


def fit_device_scales(observations: Sequence[StageObservation], source: str = "") -> dict[str, DeviceScale]:
    """Per device type: the median measured / predicted ratio of its forward and of its backward passes."""
    by_type: dict[str, list[tuple[float, float]]] = {}
    for o in observations:
        if min(o.predicted_fwd_s - o.comm_fwd_s, o.predicted_bwd_s - o.comm_bwd_s) > 0:
            ratios = o.compute_ratios()
            if min(ratios) > 0:  # a pass faster than its own all-reduces: a timer glitch, not a measurement
                by_type.setdefault(o.device, []).append(ratios)
    return {t: DeviceScale(statistics.median(f for f, _ in rs), statistics.median(b for _, b in rs), source, len(rs))
            for t, rs in sorted(by_type.items())}


def fitted_calibration(base: Calibration, scales: Mapping[str, DeviceScale], source: str) -> Calibration:
    """``base`` with the run's device scales; a type already scaled in ``base`` compounds (the run was priced
    with the old scale, so the new ratio is relative to it)."""
    devices = dict(base.devices)
    for t, new in scales.items():
        old = devices.get(t)
        devices[t] = new if old is None else DeviceScale(
            old.fwd_scale * new.fwd_scale, old.bwd_scale * new.bwd_scale, new.source,
            old.num_observations + new.num_observations)
    return replace(base, source=source or base.source, devices=devices)


def stage_errors(observations: Sequence[StageObservation], scales: Mapping[str, DeviceScale] | None = None
                 ) -> list[dict[str, Any]]:
    """Per (pipeline, stage): median measured and predicted forward / backward seconds per step, and the
    prediction's relative error, before the fit (``scales`` None) or after it."""
    groups: dict[tuple[int, int], list[StageObservation]] = {}
    for o in observations:
        groups.setdefault((o.pipeline, o.stage), []).append(o)
    rows = []
    for (p, s), obs in sorted(groups.items()):
        scale = (scales or {}).get(obs[0].device)
        fs, bs = (scale.fwd_scale, scale.bwd_scale) if scale is not None else (1.0, 1.0)
        measured = statistics.median(o.fwd_s + o.bwd_s for o in obs)
        predicted = statistics.median((o.predicted_fwd_s - o.comm_fwd_s) * fs + o.comm_fwd_s
                                      + (o.predicted_bwd_s - o.comm_bwd_s) * bs + o.comm_bwd_s for o in obs)
        rows.append({"pipeline": p, "stage": s, "device": obs[0].device, "num_layers": obs[0].num_layers,
                     "measured_s": measured, "predicted_s": predicted, "error": (predicted - measured) / measured})
    return rows
