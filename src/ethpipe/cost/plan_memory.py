"""Peak memory of every stage of a plan as the runtime runs it, and the stages that do not fit.

One place for what the simulator reports, the benchmarks compare and ``ethpipe train`` re-checks when a
run's precision differs from the one the plan was made for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ethpipe.cost.model import CostModel
from ethpipe.plan import Plan, Stage
from ethpipe.schedule import actions_of, max_in_flight, max_pending_weights


class StageMemory(Protocol):
    def stage_memory_bytes(self, stage: Stage, micro_batch: int, in_flight: int, *, first: bool, last: bool,
                           pending_weights: int = 0) -> int:
        ...


@dataclass(frozen=True)
class Shortfall:
    """Stage ``stage`` of pipeline ``pipeline`` needs ``need_bytes`` on ``device``, which has ``usable_bytes``."""

    pipeline: int
    stage: int
    device: str
    need_bytes: int
    usable_bytes: int


def stage_peak_bytes(plan: Plan, cost: StageMemory, pipeline: int, stage: int) -> int:
    """Peak bytes on each rank of a stage: its state, its schedule's in-flight activations at the
    pipeline's largest micro-batch, and the boundary buffers (``CostModel.stage_memory_bytes``)."""
    pipe = plan.pipelines[pipeline]
    actions = actions_of(pipe, stage)
    return cost.stage_memory_bytes(pipe.stages[stage], max(pipe.micro_batch_sizes), max_in_flight(actions),
                                   first=stage == 0, last=stage == pipe.depth - 1,
                                   pending_weights=max_pending_weights(actions))


def memory_shortfalls(plan: Plan, cost: CostModel) -> list[Shortfall]:
    """Every stage whose peak exceeds its device's usable memory, in plan order."""
    out = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            need, usable = stage_peak_bytes(plan, cost, p, s), cost.usable_memory_bytes(stage.device)
            if need > usable:
                out.append(Shortfall(p, s, stage.device, need, usable))
    return out
