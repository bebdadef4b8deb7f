"""Pipeline schedules as plain data (DeepSpeed-style): a per-stage list of actions.

The runtime executes these lists, the simulator replays them and ``comm.program`` derives every
rank's communication from them, so there is one source of truth for each schedule's order.
Communication is implied by the actions: ``F`` on a non-first stage first receives that
micro-batch's activation from the previous stage and, on a non-last stage, sends its output on;
``B`` mirrors that with gradients. ``W`` (weight gradients) neither sends nor receives.

A ``B`` is the whole backward unless the stage's list also holds a ``W`` for its micro-batch; then
``B`` computes the input gradient only (what the previous stage waits for) and ``W`` the weight
gradients later (``runtime/pipeline/split_backward.py``). Schedules:

* ``1f1b`` (PipeDream-Flush): warm-up forwards, then one forward / one backward, then the drain.
* ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, the handcrafted H1): 1F1B's
  order with the backward split; stage ``s`` defers its first ``s`` weight passes, so the input
  gradients race down the pipeline without waiting for weight GEMMs and the late stages fill their
  drain bubble with the deferred ``W``s. Every stage then holds at most ``depth`` micro-batches
  (1F1B's stage 0 peak); stage 0 has nothing to defer, so it runs whole backwards. So does a stage that
  recomputes its activations (``split=False``): ``torch.utils.checkpoint`` recomputes the forward once per
  autograd call, and a W is one call per weight GEMM (``runtime/pipeline/split_backward.py``). Its list is then
  1F1B's; the order of every stage's sends and receives is 1F1B's in either case (``W`` has none; the
  batch before a W is waited later: ``comm.program.deferred_batches``).
* ``interleaved`` (Narayanan et al., SC'21; Megatron-LM's interleaved 1F1B): each rank holds ``v`` model
  chunks (virtual stages: chunk c of stage s is virtual stage ``c * depth + s``, so the last stage's chunk
  c feeds stage 0's chunk c + 1), and runs 1F1B over the ``m * v`` (micro-batch, chunk) pairs in
  Megatron's order: groups of ``depth`` micro-batches, each through chunk 0, then chunk 1, ...; backwards
  in the same order with the chunks reversed; warm-up ``2 (depth - s - 1) + (v - 1) depth`` (every
  forward first when m <= depth). The micro-batch count is at most the depth or a multiple of it
  (``interleaved_fits``). A chunk is ``1/v`` of the stage, so fill and drain shrink to about ``1/v`` of 1F1B's,
  at ``v`` times the boundary messages and a somewhat larger activation peak (``max_in_flight_layers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ethpipe.plan_parts import Pipeline

ActionKind = Literal["F", "B", "W"]
SCHEDULES = ("1f1b", "zb-h1", "interleaved")
DEFAULT_SCHEDULE = "1f1b"
SPLIT_SCHEDULES = ("zb-h1",)  # those that split backwards into B and W (priced with W seconds)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int
    chunk: int = 0  # the model chunk (virtual stage) it runs: interleaved schedules only

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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


def interleaved_fits(num_stages: int, num_microbatches: int) -> bool:
    """Whether an interleaved pipeline of this depth can run this many micro-batches: at most one per stage
    (every forward before any backward), or a multiple of the depth (Megatron-LM's rule). Other counts
    leave a ragged last group whose wrap-around messages wait in a cycle under NCCL's unbuffered sends
    (``comm.replay``; tests/unit/test_interleaved_comm.py)."""
    return num_microbatches <= num_stages or num_microbatches % num_stages == 0


def interleaved(num_stages: int, stage: int, num_microbatches: int, num_chunks: int) -> tuple[Action, ...]:
    """Megatron's interleaved 1F1B for one stage holding ``num_chunks`` model chunks (module docstring)."""
    _check(num_stages, stage, num_microbatches)
    if num_chunks < 2 or num_stages < 2:
        raise ValueError("an interleaved schedule needs at least 2 stages and 2 model chunks per stage")
    if not interleaved_fits(num_stages, num_microbatches):
        lower = num_microbatches // num_stages * num_stages
        raise ValueError(f"an interleaved pipeline of {num_stages} stages runs at most {num_stages} micro-batches "
                         f"or a multiple of {num_stages}, not {num_microbatches}: use {lower} or "
                         f"{lower + num_stages}, or schedule '1f1b'")
    return interleaved_order(num_stages, stage, num_microbatches, num_chunks)


def interleaved_order(num_stages: int, stage: int, m: int, v: int) -> tuple[Action, ...]:
    """The list itself, for any count (the tests show why the ragged ones are refused)."""
    order = [(j, c) for lo in range(0, m, num_stages) for c in range(v) for j in range(lo, min(lo + num_stages, m))]
    total = len(order)
    # One group (m <= depth): every forward first, as Megatron does when m == depth.
    warmup = total if m <= num_stages else min(2 * (num_stages - stage - 1) + (v - 1) * num_stages, total)
    fwd = [Action("F", j, c) for j, c in order]
    bwd = [Action("B", j, v - 1 - c) for j, c in order]
    actions = fwd[:warmup]
    for k in range(total - warmup):
        actions += [fwd[warmup + k], bwd[k]]
    return tuple(actions + bwd[total - warmup:])


def is_action_name(name: str) -> bool:
    """Whether a span or event name is an action (``F3``, ``B3``, ``W3``, an interleaved chunk's ``F3.1``)."""
    mb, dot, chunk = name[1:].partition(".")
    return name[:1] in ("F", "B", "W") and mb.isdigit() and (chunk.isdigit() if dot else True)


def input_source(kind: str, stage: int, chunk: int, num_stages: int, num_chunks: int = 1) -> tuple[int, int]:
    """(stage, chunk) whose output an action of ``kind`` on (stage, chunk) waits for; stage -1: none. F waits for
    the previous virtual stage, B for the next (interleaved: the ring wraps from the last stage's chunk c - 1 to
    stage 0's chunk c); W for nothing."""
    if kind == "F":
        return (stage - 1, chunk) if stage > 0 else (num_stages - 1, chunk - 1) if chunk > 0 else (-1, 0)
    if kind == "B":
        return ((stage + 1, chunk) if stage + 1 < num_stages else (0, chunk + 1) if chunk + 1 < num_chunks
                else (-1, 0))
    return -1, 0


def output_dest(kind: str, stage: int, chunk: int, num_stages: int, num_chunks: int = 1) -> tuple[int, int]:
    """(stage, chunk) that waits for the output of ``kind`` on (stage, chunk); the inverse of ``input_source``."""
    if kind == "F":
        return input_source("B", stage, chunk, num_stages, num_chunks)
    if kind == "B":
        return input_source("F", stage, chunk, num_stages, num_chunks)
    return -1, 0


def check_schedule(name: str, where: str = "schedule") -> str:
    if name not in SCHEDULES:
        raise ValueError(f"{where} must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return name


def stage_actions(schedule: str, num_stages: int, stage: int, num_microbatches: int,
                  split: bool = True, num_chunks: int = 1) -> tuple[Action, ...]:
    """One stage's action list under ``schedule`` (one of ``SCHEDULES``); ``split=False``: never split its
    backward (a recomputing stage); ``num_chunks``: model chunks per stage (``interleaved`` only, >= 2)."""
    check_schedule(schedule)
    if (schedule == "interleaved") != (num_chunks > 1):
        raise ValueError(f"schedule {schedule!r} with {num_chunks} model chunks per stage: only 'interleaved' "
                         "runs several chunks, and it needs at least 2")
    if schedule == "1f1b":
        return one_f_one_b(num_stages, stage, num_microbatches)
    if schedule == "interleaved":
        return interleaved(num_stages, stage, num_microbatches, num_chunks)
    return zb_h1(num_stages, stage, num_microbatches, split)


def pipeline_schedule(num_stages: int, num_microbatches: int, schedule: str = DEFAULT_SCHEDULE,
                      unsplit: Sequence[bool] = (), num_chunks: int = 1) -> tuple[tuple[Action, ...], ...]:
    """All stages' action lists for one pipeline; ``unsplit[s]``: stage s never splits (it recomputes)."""
    return tuple(stage_actions(schedule, num_stages, s, num_microbatches, not (unsplit and unsplit[s]), num_chunks)
                 for s in range(num_stages))


def actions_of(pipe: Pipeline, stage: int, split: bool = True) -> tuple[Action, ...]:
    """Stage ``stage``'s list in a plan's pipeline (its schedule; recomputing stages unsplit); ``split=False``:
    whole backwards whatever the schedule (a run that recomputes or compiles every stage: a compiled block is
    one autograd node, whose weight pass would run the whole backward again). The sends and receives, so
    every other rank's list, do not depend on it."""
    return stage_actions(pipe.schedule, pipe.depth, stage, pipe.num_microbatches,
                         split and not pipe.stages[stage].recompute, pipe.num_chunks)


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


def _peak_live(actions: tuple[Action, ...], weights: Sequence[float] | None = None) -> float:
    """Peak sum over live (micro-batch, chunk) pairs of ``weights[chunk]`` (default 1): live from its ``F`` to
    its last backward action (``W`` where split: the autograd graph stays alive for the weight pass)."""
    split = split_microbatches(actions)
    live = peak = 0.0
    for a in actions:
        weight = 1.0 if weights is None else weights[a.chunk]
        if a.kind == "F":
            live += weight
        elif a.kind == "W" or a.microbatch not in split:
            live -= weight
        peak = max(peak, live)
    return peak


def max_in_flight(actions: tuple[Action, ...]) -> int:
    """Peak number of (micro-batch, chunk) pairs whose activations a stage holds (for memory checks)."""
    return int(_peak_live(actions))


def max_stashed_inputs(actions: tuple[Action, ...], first: bool) -> int:
    """Peak received stage inputs a stage keeps for their backward: one per live (micro-batch, chunk) as in
    ``max_in_flight`` (a split micro-batch's graph, which holds its input, lives until its W), except the
    model's own input (a first stage's chunk 0, which receives nothing)."""
    return max_in_flight(tuple(a for a in actions if not (first and a.chunk == 0)))


def max_in_flight_layers(actions: tuple[Action, ...], chunk_layers: Sequence[int]) -> float:
    """Peak activations a stage holds, in micro-batches of the whole stage: each live (micro-batch, chunk)
    counts its chunk's share of the stage's layers (``chunk_layers[c]``). Equals ``max_in_flight`` with one
    chunk; what the memory model multiplies a whole stage's per-micro-batch activations by."""
    total = sum(chunk_layers)
    return _peak_live(actions, [n / total for n in chunk_layers])
