"""Pipeline schedules as plain data (DeepSpeed-style): a per-stage list of actions.

The runtime executes these lists, the simulator replays them and ``comm.program`` derives every
rank's communication from them, so there is one source of truth for each schedule's order.
Communication is implied by the actions: ``F`` on a non-first stage first receives that
micro-batch's activation from the previous stage and, on a non-last stage, sends its output on;
``B`` mirrors that with gradients. ``W`` (weight gradients) neither sends nor receives.

A ``B`` is the whole backward unless the stage's list also holds a ``W`` for its micro-batch; then
``B`` computes the input gradient only (what the previous stage waits for) and ``W`` the weight
gradients later (``runtime/split_backward.py``). Schedules:

* ``1f1b`` (PipeDream-Flush): warm-up forwards, then one forward / one backward, then the drain.
* ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, the handcrafted H1): 1F1B's
  order with the backward split; stage ``s`` defers its first ``s`` weight passes, so the input
  gradients race down the pipeline without waiting for weight GEMMs and the late stages fill their
  drain bubble with the deferred ``W``s. Every stage then holds at most ``depth`` micro-batches
  (1F1B's stage 0 peak); stage 0 has nothing to defer, so it runs whole backwards. So does a stage that
  recomputes its activations (``split=False``): ``torch.utils.checkpoint`` recomputes the forward once per
  autograd call, and a W is one call per weight GEMM (``runtime/split_backward.py``). Its list is then
  1F1B's; the order of every stage's sends and receives is 1F1B's in either case (``W`` has none; the
  batch before a W is waited later: ``comm.program.deferred_batches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ethpipe.plan import Pipeline

ActionKind = Literal["F", "B", "W"]
SCHEDULES = ("1f1b", "zb-h1")
DEFAULT_SCHEDULE = "1f1b"


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def _check(num_stages: int, stage: int, num_microbatches: int) -> None:
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    if num_microbatches < 1:
        raise ValueError("a pipeline needs at least one micro-batch")


def one_f_one_b(num_stages: int, stage: int, num_microbatches: int) -> tuple[Action, ...]:
    """1F1B (PipeDream-Flush) for one stage; works for any micro-batch count, also < num_stages.

    Warm-up runs ``min(num_stages - stage - 1, m)`` forwards, then alternates one forward and
    one backward, then drains the remaining backwards. Stage s therefore holds at most
    ``num_stages - s`` micro-batches of activations at once.
    """
    return _one_f_one_b(num_stages, stage, num_microbatches, deferred=None)


def zb_h1(num_stages: int, stage: int, num_microbatches: int, split: bool = True) -> tuple[Action, ...]:
    """ZB-H1 for one stage: 1F1B's F/B order, ``W j`` after ``B (j + stage)`` (the rest at the end);
    ``split=False``: the stage runs whole backwards (1F1B's list)."""
    return _one_f_one_b(num_stages, stage, num_microbatches, deferred=stage if stage > 0 and split else None)


def _one_f_one_b(num_stages: int, stage: int, m: int, deferred: int | None) -> tuple[Action, ...]:
    """1F1B's order; with ``deferred`` = d, each ``B k`` is input-only and followed by ``W (k - d)``."""
    _check(num_stages, stage, m)
    warmup = min(num_stages - stage - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    next_w = 0

    def backward(k: int) -> None:
        nonlocal next_w
        actions.append(Action("B", k))
        while deferred is not None and next_w <= k - deferred:
            actions.append(Action("W", next_w))
            next_w += 1

    for j in range(warmup, m):
        actions.append(Action("F", j))
        backward(j - warmup)
    for k in range(m - warmup, m):
        backward(k)
    if deferred is not None:
        actions.extend(Action("W", k) for k in range(next_w, m))
    return tuple(actions)


def check_schedule(name: str, where: str = "schedule") -> str:
    if name not in SCHEDULES:
        raise ValueError(f"{where} must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return name


def stage_actions(schedule: str, num_stages: int, stage: int, num_microbatches: int,
                  split: bool = True) -> tuple[Action, ...]:
    """One stage's action list under ``schedule`` (one of ``SCHEDULES``); ``split=False``: never split its
    backward (a recomputing stage)."""
    if check_schedule(schedule) == "1f1b":
        return one_f_one_b(num_stages, stage, num_microbatches)
    return zb_h1(num_stages, stage, num_microbatches, split)


def pipeline_schedule(num_stages: int, num_microbatches: int, schedule: str = DEFAULT_SCHEDULE,
                      unsplit: Sequence[bool] = ()) -> tuple[tuple[Action, ...], ...]:
    """All stages' action lists for one pipeline; ``unsplit[s]``: stage s never splits (it recomputes)."""
    return tuple(stage_actions(schedule, num_stages, s, num_microbatches, not (unsplit and unsplit[s]))
                 for s in range(num_stages))


def actions_of(pipe: Pipeline, stage: int, split: bool = True) -> tuple[Action, ...]:
    """Stage ``stage``'s list in a plan's pipeline (its schedule; recomputing stages unsplit); ``split=False``:
    whole backwards whatever the schedule (a run that recomputes or compiles every stage: a compiled block is
    one autograd node, whose weight pass would run the whole backward again). The sends and receives, so
    every other rank's list, do not depend on it."""
    return stage_actions(pipe.schedule, pipe.depth, stage, pipe.num_microbatches,
                         split and not pipe.stages[stage].recompute)


def pipeline_actions(pipe: Pipeline) -> tuple[tuple[Action, ...], ...]:
    return tuple(actions_of(pipe, s) for s in range(pipe.depth))


def split_microbatches(actions: tuple[Action, ...]) -> frozenset[int]:
    """Micro-batches whose ``B`` is input-only: those with a ``W`` in the list."""
    return frozenset(a.microbatch for a in actions if a.kind == "W")


def last_weight_grad_index(actions: tuple[Action, ...]) -> int:
    """Index of the action after which the stage's weight gradients are final (its last ``W``, or its last
    whole ``B``): where the block gradient sync's hooks arm."""
    split = split_microbatches(actions)
    return max(k for k, a in enumerate(actions)
               if a.kind == "W" or (a.kind == "B" and a.microbatch not in split))


def max_pending_weights(actions: tuple[Action, ...]) -> int:
    """Peak number of micro-batches between their B and their W (each holds its split nodes' output gradients
    until the W: ``CostModel.held_grad_bytes``)."""
    pending = peak = 0
    split = split_microbatches(actions)
    for a in actions:
        if a.kind == "B" and a.microbatch in split:
            pending += 1
        elif a.kind == "W":
            pending -= 1
        peak = max(peak, pending)
    return peak


def max_in_flight(actions: tuple[Action, ...]) -> int:
    """Peak number of micro-batches whose activations a stage holds (for memory checks): from its ``F`` to
    its last backward action (``W`` where split: the autograd graph stays alive for the weight pass)."""
    split = split_microbatches(actions)
    live = peak = 0
    for a in actions:
        if a.kind == "F":
            live += 1
        elif a.kind == "W" or a.microbatch not in split:
            live -= 1
        peak = max(peak, live)
    return peak
