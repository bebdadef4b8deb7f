"""The interleaved schedule's communication, replayed under NCCL's semantics (``ethpipe.comm.replay``).

Each stage holds v model chunks, so the ring wraps: the last stage's chunk c output is stage 0's chunk
c + 1 input, and on two stages one pair of ranks carries activations one way and gradients the other in
the same batches. With Megatron-LM's steady-state batching (``comm.program.p2p_units``: an F and the B
after it share one batch) every shape ``interleaved_fits`` allows completes, up to depth 8 x 4 chunks x 24
micro-batches, alone and beside other pipelines with TP fan-in/fan-out, tied embeddings and the block
sync; the rule is needed: one batch per action deadlocks, and so do the ragged counts it refuses.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import ethpipe.comm.program as program
from ethpipe.comm.program import p2p_batches, plan_peers, step_program
from ethpipe.plan import Plan
from ethpipe.schedule import interleaved, interleaved_fits, interleaved_order

from _comm_plans import SPEC, even_pipeline, interleaved_pipeline, make_plan, replay_plan

SHAPES = [(d, v, m) for d, v, m in itertools.product(range(2, 9), range(2, 5), range(1, 25))
          if d * v <= 32 and interleaved_fits(d, m)]


def _plan(depth: int, v: int, m: int) -> Plan:
    return make_plan([interleaved_pipeline(depth, [1] * m, v, num_layers=32)], spec=dataclasses.replace(SPEC, num_layers=32))


@pytest.mark.parametrize("streams", ["group", "device"])
def test_every_allowed_shape_completes(streams: str) -> None:
    assert len(SHAPES) == 204
    for depth, v, m in SHAPES:
        plan = _plan(depth, v, m)
        for lazy in (False, True):
            outcome = replay_plan(plan, streams=streams, lazy_init=lazy, warmup=lazy)
            assert outcome.completed and not outcome.errors, (depth, v, m, lazy, outcome.describe())


def test_one_batch_per_action_and_ragged_counts_deadlock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the steady-state units, the wrap-around waits in a cycle on most shapes; with them, counts
    that are neither at most the depth nor a multiple of it still do (so ``interleaved`` refuses them)."""
    stuck = [s for s in [(3, 2, 6), (4, 2, 8), (4, 3, 12), (2, 2, 4)] if not replay_plan(_plan(*s)).completed]
    assert stuck == []
    with monkeypatch.context() as m:
        m.setattr(program, "p2p_units", lambda actions: tuple(range(len(actions))))
        assert not any(replay_plan(_plan(*s)).completed for s in [(3, 2, 6), (4, 2, 8), (4, 3, 12)])
    ragged = [(3, 2, 4), (3, 2, 7), (4, 2, 5), (4, 2, 6), (5, 3, 7), (2, 2, 3)]
    with monkeypatch.context() as m:
        m.setattr("ethpipe.schedule.interleaved", lambda s, st, n, v: interleaved_order(s, st, n, v))
        assert not any(replay_plan(_plan(*s)).completed for s in ragged)
    for depth, v, n in ragged:
        with pytest.raises(ValueError, match=f"at most {depth} micro-batches or a multiple of {depth}"):
            interleaved(depth, 0, n, v)


MIXED = [
    # ragged micro-batch sizes, TP fan-out 1 -> 2 -> 4 and fan-in 4 -> 1, beside a 1F1B pipeline
    [interleaved_pipeline(4, [3, 1, 2, 2, 1, 1, 2, 1], tps=[1, 2, 4, 1]), even_pipeline(2, [2] * 5)],
    # three chunks on three stages (uneven layers), fewer micro-batches than stages, and a two-stage ring
    [interleaved_pipeline(3, [2, 1], num_chunks=3), interleaved_pipeline(2, [1] * 6, tps=[2, 1]),
     even_pipeline(1, [3, 1])],
]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_beside_other_pipelines_with_tp_and_the_block_sync(case: int, tied: bool) -> None:
    """An interleaved stage's sync is posted after its last sends (the hooks armed at its last backward,
    chunk 0's, never see the later chunks finish); with --no-overlap-grad-sync everywhere it completes even
    with one FIFO per device."""
    plan = make_plan(MIXED[case], spec=dataclasses.replace(SPEC, tie_embeddings=tied))
    assert {p.num_chunks for p in plan.pipelines} >= {1, 2}
    for lazy in (False, True):
        outcome = replay_plan(plan, lazy_init=lazy, warmup=lazy)
        assert outcome.completed and not outcome.errors, (lazy, outcome.describe())
        assert replay_plan(plan, streams="device", lazy_init=lazy, warmup=lazy, overlap_sync=False).completed
    assert replay_plan(plan, sharded=True, lazy_init=True, warmup=True).completed


def test_every_chunk_boundary_is_received_once_and_tagged_by_chunk() -> None:
    for depth, v, m in [(3, 2, 6), (2, 3, 4), (4, 2, 4), (5, 4, 10)]:
        plan = _plan(depth, v, m)
        for rank in range(depth):
            actions = interleaved(depth, rank, m, v)
            ops = [o for b in p2p_batches(actions, plan_peers(plan, rank)) for o in b]
            for kind in ("send", "recv"):  # each (payload, micro-batch, chunk) once; none at the model's ends
                mine = [(o.payload, o.microbatch, o.chunk) for o in ops if o.kind == kind]
                assert len(mine) == len(set(mine))
                acts_end, grads_end = (0, depth - 1) if kind == "recv" else (depth - 1, 0)
                assert sum(p == "act" for p, _, _ in mine) == m * v - m * (rank == acts_end)
                assert sum(p == "grad" for p, _, _ in mine) == m * v - m * (rank == grads_end)
        program_ops = [i for i in step_program(plan, 0, []) if hasattr(i, "ops")]
        assert any(o.tag.endswith(f".{v - 1}") for p in program_ops for o in p.ops)
