"""Peak memory of every stage of a plan as the runtime runs it, and the stages that do not fit.

One place for what the simulator reports, the benchmarks compare and ``ethpipe train`` re-checks when a
run's precision differs from the one the plan was made for.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from ethpipe.cost.model import CostModel
from ethpipe.plan import Pipeline, Plan, Stage
from ethpipe.schedule import (
    Action, max_in_flight, max_in_flight_layers, max_pending_weights, max_stashed_inputs, stage_actions,
)


class StageMemory(Protocol):
    def stage_memory_bytes(self, stage: Stage, micro_batch: int, in_flight: float, *, first: bool, last: bool,
                           pending_weights: int = 0, stashed_inputs: int | None = None,
                           live_heads: int | None = None) -> int:
        ...


@dataclass(frozen=True)
class Held:
    """What a stage's action list keeps at its peak: activations (in micro-batches of the whole stage), the
    micro-batches waiting for their W, the received inputs stashed for the backward, and (a last stage) the
    micro-batches whose head and loss graph is alive at once (0 elsewhere)."""

    in_flight: float
    pending_weights: int
    stashed_inputs: int
    live_heads: int = 0


def held_of(pipe: Pipeline, stage: int, actions: tuple[Action, ...] | None = None) -> Held:
    """``Held`` of stage ``stage`` under its pipeline's schedule (or ``actions``, a list of that schedule)."""
    if actions is None:
        st = pipe.stages[stage]
        return _held(pipe.schedule, pipe.depth, stage, pipe.num_microbatches, not st.recompute, st.chunk_layers)
    return _held_of_actions(actions, pipe.stages[stage].chunk_layers, stage == 0, stage == pipe.depth - 1)


def _held(schedule: str, depth: int, stage: int, num_microbatches: int, split: bool,
          chunk_layers: tuple[int, ...]) -> Held:
    """``Held`` of a stage of that shape: in closed form for the one-chunk schedules, from the (memoised) list
    for interleaved stages."""
    if len(chunk_layers) == 1 and schedule in ("1f1b", "zb-h1"):
        return _held_one_f_one_b(depth, stage, num_microbatches, split and schedule == "zb-h1" and stage > 0)
    return _held_memo(schedule, depth, stage, num_microbatches, split, chunk_layers)


@lru_cache(maxsize=65536)
def _held_memo(schedule: str, depth: int, stage: int, num_microbatches: int, split: bool,
               chunk_layers: tuple[int, ...]) -> Held:
    """Memoised: the estimator asks for every stage of every pipeline of every candidate plan."""
    actions = stage_actions(schedule, depth, stage, num_microbatches, split, len(chunk_layers))
    return _held_of_actions(actions, chunk_layers, stage == 0, stage == depth - 1)


def _held_one_f_one_b(depth: int, stage: int, m: int, split: bool) -> Held:
    """``Held`` of a 1F1B or zb-h1 list (``schedule.one_f_one_b`` / ``zb_h1``) in closed form: the planner asks
    for thousands of shapes, and building each list took a tenth of a large cluster's planning time. 1F1B: the
    warm-up's ``depth - stage - 1`` forwards and one more are alive. zb-h1's split stages keep each micro-batch
    alive until its W, which runs after ``B (j + stage)``: ``stage + 1`` wait for their W and ``depth`` are alive.
    Equal to the lists' count for every shape (tests/unit/test_schedule.py)."""
    in_flight = min(depth, m) if split else min(depth - stage, m)
    pending = min(stage + 1, m) if split else 0
    last = stage == depth - 1
    return Held(float(in_flight), pending, 0 if stage == 0 else in_flight, (pending if split else 1) if last else 0)


def _held_of_actions(actions: tuple[Action, ...], chunk_layers: tuple[int, ...], first: bool, last: bool) -> Held:
    in_flight = max_in_flight_layers(actions, chunk_layers)
    heads = max_in_flight(tuple(a for a in actions if a.chunk == len(chunk_layers) - 1)) if last else 0
    return Held(in_flight, max_pending_weights(actions), max_stashed_inputs(actions, first), heads)


def stage_bytes(cost: StageMemory, pipe: Pipeline, stage: int, micro_batch: int, held: Held) -> int:
    """``CostModel.stage_memory_bytes`` of one stage holding ``held``."""
    return cost.stage_memory_bytes(pipe.stages[stage], micro_batch, held.in_flight, first=stage == 0,
                                   last=stage == pipe.depth - 1, pending_weights=held.pending_weights,
                                   stashed_inputs=held.stashed_inputs, live_heads=held.live_heads)


@dataclass(frozen=True)
class Shortfall:
    """Stage ``stage`` of pipeline ``pipeline`` needs ``need_bytes`` on ``device``, which has ``usable_bytes``."""

    pipeline: int
    stage: int
    device: str
    need_bytes: int
    usable_bytes: int


def held_at_most(pipe: Pipeline, stage: int, schedule: str | None = None) -> Held:
    """``Held`` of a stage under ``schedule`` (default: its pipeline's) at ``depth`` micro-batches or more, the most
    any sample count reaches (a re-split of the batch, ``--rebalance``, cannot make it hold more)."""
    st = pipe.stages[stage]
    return _held(schedule or pipe.schedule, pipe.depth, stage, max(pipe.depth, pipe.num_microbatches),
                 not st.recompute, st.chunk_layers)


def fits(cost: CostModel, pipe: Pipeline, schedule: str) -> bool:
    """Whether ``pipe`` may run ``schedule`` (the planner's level 2 asks): every stage fits its device with the
    schedule's in-flight micro-batches at the pipeline's micro-batch size (``held_at_most``)."""
    b = max(pipe.micro_batch_sizes)
    for s, stage in enumerate(pipe.stages):
        if stage_bytes(cost, pipe, s, b, held_at_most(pipe, s, schedule)) > cost.usable_memory_bytes(stage.device):
            return False
    return True


def stage_peak_bytes(plan: Plan, cost: StageMemory, pipeline: int, stage: int) -> int:
    """Peak bytes on each rank of a stage: its state, its schedule's in-flight activations at the
    pipeline's largest micro-batch, and the boundary buffers (``CostModel.stage_memory_bytes``)."""
    pipe = plan.pipelines[pipeline]
    return stage_bytes(cost, pipe, stage, max(pipe.micro_batch_sizes), held_of(pipe, stage))


def memory_shortfalls(plan: Plan, cost: CostModel) -> list[Shortfall]:
    """Every stage whose peak exceeds its device's usable memory, in plan order."""
    out = []
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            need, usable = stage_peak_bytes(plan, cost, p, s), cost.usable_memory_bytes(stage.device)
            if need > usable:
                out.append(Shortfall(p, s, stage.device, need, usable))
    return out
