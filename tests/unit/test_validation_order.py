"""Validation's forward-only action lists (``runtime/pipeline/validation.eval_actions``) replayed under NCCL's semantics
(``ethpipe.comm.replay``: no buffering, a batch completes as a unit): 1F1B stages of any depth and micro-batch
count, every interleaved shape training allows, TP fan-in and fan-out, side by side, all complete; a plain
chunk-major order (every micro-batch of chunk 0, then chunk 1) does not: its wrap-around waits in a cycle."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from ethpipe.comm.program import communicators, forward_program
from ethpipe.comm.replay import replay
from ethpipe.plan import Plan
from ethpipe.runtime.pipeline.validation import eval_actions, eval_due
from ethpipe.schedule import Action, interleaved_fits

from _comm_plans import SPEC, even_pipeline, interleaved_pipeline, make_plan

WIDE = dataclasses.replace(SPEC, num_layers=32)


def _replay(plan: Plan, streams: str = "group", chunk_major: bool = False) -> object:
    programs = {}
    for rank in range(plan.world_size):
        pos = plan.position_of(rank)
        pipe = plan.pipelines[pos.pipeline]
        actions = (tuple(Action("F", mb, c) for c in range(pipe.num_chunks) for mb in range(pipe.num_microbatches))
                   if chunk_major else eval_actions(pipe, pos.stage))
        programs[rank] = forward_program(plan, rank, actions)
    return replay(programs, communicators(plan, lambda r: ()), streams=streams)  # type: ignore[arg-type]


@pytest.mark.parametrize("streams", ["group", "device"])
def test_every_forward_only_shape_completes(streams: str) -> None:
    for depth, m in itertools.product(range(1, 7), range(1, 9)):
        outcome = _replay(make_plan([even_pipeline(depth, [1] * m)]), streams)
        assert outcome.completed and not outcome.errors, (depth, m, outcome.describe())  # type: ignore[attr-defined]
    shapes = [(d, v, m) for d, v, m in itertools.product(range(2, 6), range(2, 4), range(1, 13)) if interleaved_fits(d, m)]
    assert len(shapes) == 50
    for depth, v, m in shapes:
        outcome = _replay(make_plan([interleaved_pipeline(depth, [1] * m, v, num_layers=32)], spec=WIDE), streams)
        assert outcome.completed and not outcome.errors, (depth, v, m, outcome.describe())  # type: ignore[attr-defined]
    mixed = make_plan([interleaved_pipeline(4, [3, 1, 2, 2, 1, 1, 2, 1], tps=[1, 2, 4, 1]),
                       even_pipeline(2, [2] * 3, tps=[2, 1]), even_pipeline(1, [4])])
    outcome = _replay(mixed, streams)
    assert outcome.completed and not outcome.errors, outcome.describe()  # type: ignore[attr-defined]


def test_a_chunk_major_order_deadlocks_on_the_wrap_around() -> None:
    plan = make_plan([interleaved_pipeline(2, [1] * 4, 2)])
    assert not _replay(plan, chunk_major=True).completed  # type: ignore[attr-defined]
    assert _replay(plan).completed  # type: ignore[attr-defined]


def test_the_order_and_when_it_runs() -> None:
    pipe = make_plan([interleaved_pipeline(2, [1] * 4, 2)]).pipelines[0]
    assert [(a.microbatch, a.chunk) for a in eval_actions(pipe, 1)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]  # Megatron's groups of depth micro-batches
    assert all(a.kind == "F" for a in eval_actions(pipe, 0))
    assert [s for s in range(10) if eval_due(s, 4, 10)] == [3, 7, 9]  # after steps 4 and 8, and the last
    assert not any(eval_due(s, 0, 10) for s in range(10))


def test_a_ranks_forward_only_program_does_not_grow_with_the_world() -> None:
    """Counted, not assumed: rank 0 of a plan of 2 and of 512 two-stage pipelines posts the same p2p batches and
    the same one world collective in an evaluation (the world's size is only that collective's membership)."""
    small = forward_program(make_plan([even_pipeline(2, [1] * 4)] * 2), 0,
                            eval_actions(make_plan([even_pipeline(2, [1] * 4)]).pipelines[0], 0))
    big_plan = make_plan([even_pipeline(2, [1] * 4)] * 512)
    assert big_plan.world_size == 1024
    big = forward_program(big_plan, 0, eval_actions(big_plan.pipelines[0], 0))
    assert big == small and sum(1 for item in big if hasattr(item, "group") and item.group == "world") == 1
