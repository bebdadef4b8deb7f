"""Pipeline schedules as plain data (DeepSpeed-style): a per-stage list of actions.

The runtime executes these lists and the simulator replays them, so there is one source of
truth for the 1F1B order. Communication is implied by the actions: ``F`` on a non-first
stage first receives that micro-batch's activation from the previous stage and, on a
non-last stage, sends its output on; ``B`` mirrors that with gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    kind: Literal["F", "B"]
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> tuple[Action, ...]:
    """1F1B (PipeDream-Flush) for one stage; works for any micro-batch count, also < num_stages.

    Warm-up runs ``min(num_stages - stage - 1, m)`` forwards, then alternates one forward and
    one backward, then drains the remaining backwards. Stage s therefore holds at most
    ``num_stages - s`` micro-batches of activations at once.
    """
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if num_microbatches < 1:
        raise ValueError("a pipeline needs at least one micro-batch")
    warmup = min(num_stages - stage - 1, num_microbatches)
    actions = [Action("F", i) for i in range(warmup)]
    next_f, next_b = warmup, 0
    while next_f < num_microbatches:
        actions.append(Action("F", next_f))
        actions.append(Action("B", next_b))
        next_f += 1
        next_b += 1
    actions.extend(Action("B", i) for i in range(next_b, num_microbatches))
    return tuple(actions)


def pipeline_schedule(num_stages: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """All stages' action lists for one pipeline."""
    return tuple(one_f_one_b(num_stages, s, num_microbatches) for s in range(num_stages))


def max_in_flight(actions: tuple[Action, ...]) -> int:
    """Peak number of micro-batches whose activations a stage holds (for memory checks)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak
