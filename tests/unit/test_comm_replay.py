"""Every rank's communication of a training step, replayed under NCCL's semantics, never deadlocks.

NCCL does not buffer large sends and runs a communicator's ops in issue order, so an order that gloo
(which buffers) runs fine can hang on GPUs. ``ethpipe.comm.replay`` executes the sequences the runtime
posts (``ethpipe.comm.program``) under those semantics. The old executor's order (blocking recv, isend
after) is shown to deadlock on every shape with two stages and two micro-batches or more, so the
replay can fail; the new order completes on every shape up to depth 8 x 16 micro-batches, with ragged
micro-batches, TP fan-in/fan-out, several pipelines of different cuts with the block gradient sync,
and tied embeddings, under per-communicator FIFO and under one FIFO per device, for every schedule
(``ethpipe.schedule.SCHEDULES``: zb-h1's W passes post nothing of their own, the batch before a run of them
also posts the next unit's receives; its sync fires at the last W). The
interleaved schedule's chunks and ring wrap-around: test_interleaved_comm.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from ethpipe.comm.program import (
    Peers, action_recvs, action_sends, deferred_batches, p2p_batches, plan_peers, step_program,
)
from ethpipe.comm.replay import Op, Post, Wait, replay
from ethpipe.runtime.config import one_queue_variable, overlap_is_safe
from ethpipe.runtime.sync.zero import ShardedBuckets
from ethpipe.schedule import SCHEDULES, one_f_one_b, zb_h1

from _comm_plans import (
    SPEC, even_pipeline, make_plan, old_executor_program, pair_groups, replay_plan, stage_buckets,
)

SHAPES = list(itertools.product(range(1, 9), range(1, 17)))  # depth x micro-batches
FLAT = [s for s in SCHEDULES if s != "interleaved"]  # one model chunk per stage


@pytest.mark.parametrize("schedule", FLAT)
@pytest.mark.parametrize("streams", ["group", "device"])
def test_every_shape_of_every_schedule_up_to_depth_8_by_16_completes(streams: str, schedule: str) -> None:
    for depth, m in SHAPES:
        plan = make_plan([even_pipeline(depth, [1] * m)], schedule=schedule)
        for lazy in (False, True):
            outcome = replay_plan(plan, streams=streams, lazy_init=lazy, warmup=lazy)
            assert outcome.completed and not outcome.errors, (depth, m, lazy, outcome.describe())


def test_the_old_executor_order_deadlocks_on_every_shape_with_two_stages_and_two_micro_batches() -> None:
    deadlocked = 0
    for depth, m in SHAPES:
        plan = make_plan([even_pipeline(depth, [1] * m)])
        programs = {r: old_executor_program(plan, r) for r in range(plan.world_size)}
        outcome = replay(programs, pair_groups(plan.world_size))
        if depth >= 2 and m >= 2:
            assert not outcome.completed, (depth, m)
            deadlocked += 1
        else:
            assert outcome.completed, (depth, m, outcome.describe())
    assert deadlocked == 7 * 15
    # The first case the issue describes: stage 0 waits for g0 behind its send of a1, stage 1 for a1 behind g0.
    two = replay({r: old_executor_program(make_plan([even_pipeline(2, [1] * 4)]), r) for r in range(2)},
                 pair_groups(2))
    assert two.blocked == {0: "waits on [recv 1 grad 0] on pair 0,1", 1: "waits on [recv 0 act 1] on pair 0,1"}


MIXED = [
    # ragged micro-batches, TP fan-out 1 -> 2 -> 4 and fan-in 4 -> 1
    [even_pipeline(4, [3, 1, 2, 2, 1], tps=[1, 2, 4, 1])],
    # three pipelines of different cuts, depths and TP degrees: blocks held at tp 2, 1 and 4
    [([((0, 3), 2), ((3, 7), 1), ((7, 16), 4)], [2, 2, 1, 3]),
     ([((0, 5), 1), ((5, 16), 2)], [1] * 6),
     ([((0, 16), 1)], [3, 1])],
    # fewer micro-batches than stages next to a deep pipeline
    [even_pipeline(8, [1, 2], tps=[2, 1, 1, 2, 1, 1, 1, 2]), even_pipeline(2, [4] * 9)],
]


@pytest.mark.parametrize("schedule", FLAT)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_tp_fan_in_out_and_block_sync_of_differing_pipelines_complete(case: int, tied: bool, schedule: str) -> None:
    """The sync fired from backward hooks overlaps the stage's last backward (under zb-h1: its last W) and its
    sends: that needs the communicators to run side by side (ProcessGroupNCCL's stream per communicator, as
    Megatron's overlapped gradient reduce does). With --no-overlap-grad-sync it completes even with one FIFO
    per device. zb-h1 with every third rank's stage recomputing (unsplit beside split stages)."""
    plan = make_plan(MIXED[case], spec=dataclasses.replace(SPEC, tie_embeddings=tied), schedule=schedule,
                     recompute=frozenset(range(0, 64, 3)) if schedule != "1f1b" else frozenset())
    for lazy in (False, True):
        outcome = replay_plan(plan, lazy_init=lazy, warmup=lazy)
        assert outcome.completed and not outcome.errors, (lazy, outcome.describe())
        strict = replay_plan(plan, streams="device", lazy_init=lazy, warmup=lazy, overlap_sync=False)
        assert strict.completed, (lazy, strict.describe())


@pytest.mark.parametrize("schedule", FLAT)
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_the_sharded_optimizers_reduces_and_gathers_complete(case: int, schedule: str) -> None:
    """ZeRO-1 (``runtime/sync/zero.py``): one reduce-scatter per bucket tensor in the sync's order, one all-gather
    per bucket tensor after the optimizer in the reversed order, however many holders; tied embeddings (the
    matrix's holders overlap every block's)."""
    plan = make_plan(MIXED[case], spec=dataclasses.replace(SPEC, tie_embeddings=True), schedule=schedule)
    outcome = replay_plan(plan, sharded=True, lazy_init=True, warmup=True)
    assert outcome.completed and not outcome.errors, outcome.describe()
    assert replay_plan(plan, sharded=True, streams="device", overlap_sync=False).completed
    rank = plan.pipelines[-1].stages[-1].ranks[0]
    plain, zero = stage_buckets(plan, rank), stage_buckets(plan, rank, sharded=True)
    assert plain is not None and isinstance(zero, ShardedBuckets)
    assert zero.posts() == plain.posts()  # one reduce-scatter for each all-reduce, not one reduce per holder
    assert sorted(zero.gather_posts()) == sorted(zero.posts())


@pytest.mark.parametrize("schedule", FLAT)
def test_under_one_queue_per_gpu_the_runtime_overlaps_only_what_completes(schedule: str) -> None:
    """Every flat schedule x tied or not x overlap asked or not x sharded or not, replayed with ONE FIFO per
    device (``CUDA_DEVICE_MAX_CONNECTIONS=1``): with the overlap the runtime then runs
    (``config.overlap_is_safe``) every step completes; the tied + overlap case it turns off deadlocks under
    1F1B, so the rule is needed, not just safe."""
    deadlocked = 0
    for case, tied, asked, sharded in itertools.product(MIXED, (False, True), (False, True), (False, True)):
        plan = make_plan(case, spec=dataclasses.replace(SPEC, tie_embeddings=tied), schedule=schedule)
        overlap = asked and overlap_is_safe(tied, one_queue=True)
        assert replay_plan(plan, sharded=sharded, streams="device", overlap_sync=overlap).completed, (
            case, tied, asked, sharded)
        if asked and not overlap:
            deadlocked += not replay_plan(plan, sharded=sharded, streams="device", overlap_sync=True).completed
    assert deadlocked == (2 * len(MIXED) if schedule == "1f1b" else 0)
    assert overlap_is_safe(True, one_queue=False) and overlap_is_safe(False, one_queue=True)
    assert one_queue_variable({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert one_queue_variable({"CUDA_DEVICE_MAX_CONNECTIONS": "8", "NCCL_LAUNCH_ORDER_IMPLICIT": "0"}) is None


def test_the_overlapped_sync_needs_communicators_that_run_side_by_side() -> None:
    """One FIFO for all of a GPU's communicators: a last stage's tied all-reduce, posted before its last
    send, waits for the first stage, which waits for that send."""
    plan = make_plan([even_pipeline(2, [1, 1])], spec=dataclasses.replace(SPEC, tie_embeddings=True))
    assert replay_plan(plan).completed
    assert not replay_plan(plan, streams="device").completed
    assert replay_plan(plan, streams="device", overlap_sync=False).completed


def test_lazily_created_communicators_need_the_warm_up() -> None:
    """A TP rank whose stage sends nothing in its warm-up reaches the pipeline group's first use only after
    a TP collective its peer cannot join while that peer waits for the lazy communicator."""
    plan = make_plan(MIXED[1])
    assert not replay_plan(plan, lazy_init=True).completed
    assert replay_plan(plan, lazy_init=True, warmup=True).completed


def test_batches_hold_one_send_per_peer_and_direction_and_pair_up_across_stages() -> None:
    for depth, m in SHAPES:
        plan = make_plan([even_pipeline(depth, [1] * m)])
        for rank in range(plan.world_size):
            pos = plan.position_of(rank)
            actions = one_f_one_b(depth, pos.stage, m)
            batches = p2p_batches(actions, plan_peers(plan, rank))
            assert len(batches) == len(actions) + 1
            for batch in batches:
                sends = [(o.peer, o.payload) for o in batch if o.kind == "send"]
                assert len(sends) == len(set(sends))
            ops = [o for b in batches for o in b]
            expect_recvs = m * ((pos.stage > 0) + (pos.stage < depth - 1))
            assert sum(o.kind == "recv" for o in ops) == expect_recvs
            assert sum(o.kind == "send" for o in ops) == expect_recvs


def test_peers_across_tp_degrees_receive_each_tensor_once() -> None:
    plan = make_plan([even_pipeline(4, [1], tps=[1, 2, 4, 1])])
    peers = {r: plan_peers(plan, r) for r in range(plan.world_size)}
    assert peers[0] == Peers(None, (1, 2), 1, ())  # tp 1 -> tp 2: both next ranks take from rank 0
    assert peers[1] == Peers(0, (3, 5), 3, (0,)) and peers[2] == Peers(0, (4, 6), 4, ())
    assert peers[7] == Peers(3, (), None, (3, 4, 5, 6))  # tp 4 -> tp 1: input from rank 3, gradient to all four
    assert peers[3].act_to == (7,) and peers[4].act_to == () and peers[4].grad_from == 7
    for r, p in peers.items():  # every act_to / grad_to has its receiver pointing back
        assert all(peers[d].act_from == r for d in p.act_to)
        assert all(peers[d].grad_from == r for d in p.grad_to)


def test_replay_reports_mismatched_tags_missing_receives_and_absent_members() -> None:
    groups = {"g": (0, 1), "w": (0, 1, 2)}
    swapped = {0: [Post(0, "g", (Op("send", 1, "act 0"),)), Wait(0), Post(1, "g", (Op("send", 1, "act 1"),)), Wait(1)],
               1: [Post(0, "g", (Op("recv", 0, "act 1"),)), Wait(0), Post(1, "g", (Op("recv", 0, "act 0"),)), Wait(1)]}
    outcome = replay(swapped, groups)
    assert not outcome.completed and not outcome.blocked and len(outcome.errors) == 2
    assert "tags differ" in outcome.errors[0]
    lonely = replay({0: [Post(0, "g", (Op("send", 1, "x"),)), Wait(0)], 1: []}, groups)
    assert lonely.blocked == {0: "waits on [send 1 x] on g"}
    absent = replay({0: [Post(0, "w", (Op("collective", tag="c"),)), Wait(0)],
                     1: [Post(0, "w", (Op("collective", tag="c"),)), Wait(0)], 2: []}, groups)
    assert set(absent.blocked) == {0, 1}
    outsider = replay({0: [Post(0, "g", (Op("collective", tag="c"),)), Wait(0)],
                       2: [Post(0, "g", (Op("collective", tag="c"),)), Wait(0)]}, groups)
    assert not outsider.completed and "outside its members" in outsider.errors[0]
    with pytest.raises(AssertionError, match="posts a handle twice"):
        replay({0: [Post(0, "g", (Op("send", 1, "x"),)), Post(0, "g", (Op("send", 1, "y"),))], 1: []}, groups)
    # Two sends to each other in one batch each complete (a grouped launch), but not as separate posts.
    exchange = {r: [Post(0, "g", (Op("send", 1 - r, "t"), Op("recv", 1 - r, "t"))), Wait(0)] for r in (0, 1)}
    assert replay(exchange, groups).completed
    split = {r: [Post(0, "g", (Op("send", 1 - r, "t"),)), Post(1, "g", (Op("recv", 1 - r, "t"),)), Wait(1)]
             for r in (0, 1)}
    assert not replay(split, groups).completed


def test_the_step_program_posts_the_p2p_batches_in_schedule_order() -> None:
    plan = make_plan([even_pipeline(3, [2, 1, 2, 1])])
    program = step_program(plan, 1, [])
    posted = [item for item in program if isinstance(item, Post) and item.group == "pipeline 0"]
    batches = [b for b in p2p_batches(one_f_one_b(3, 1, 4), plan_peers(plan, 1)) if b]
    assert [tuple(Op(o.kind, o.peer, o.tag) for o in b) for b in batches] == [p.ops for p in posted]


def test_the_batches_before_a_w_post_the_next_receives_and_are_waited_at_the_next_f_or_b() -> None:
    """Under NCCL a send completes only with the peer's receive: waiting the B's sends before its W would hold
    the W until the previous stage reaches its own B, so the runtime waits them before its next F or B
    (``deferred_batches``). That F's or B's receives are posted in the same batch, before the run of Ws, so the
    peer's send to them need not wait until the Ws are done; the unit after the run posts no receive of its own.
    Every op is posted once, in the same order per peer as with the receives after the Ws (the replay above
    completes on every shape)."""
    for depth, m in SHAPES:
        plan = make_plan([even_pipeline(depth, [1] * m)], schedule="zb-h1")
        for rank in range(plan.world_size):
            actions = zb_h1(depth, rank, m)
            peers = plan_peers(plan, rank)
            batches = p2p_batches(actions, peers)
            deferred = deferred_batches(actions)
            assert deferred == {k for k, a in enumerate(actions) if a.kind == "W"}
            for k in deferred:
                sends = [o for o in batches[k] if o.kind == "send"]
                assert all(o.payload == "grad" for o in sends)
                after = next((j for j in range(k, len(actions)) if actions[j].kind != "W"), None)
                opens_run = k == 0 or actions[k - 1].kind != "W"
                want = action_recvs(actions[after], peers) if opens_run and after is not None else ()
                assert tuple(o for o in batches[k] if o.kind == "recv") == want
                if want:
                    assert all(o.kind == "send" for o in batches[after])
            if rank > 0 and m >= depth:  # a split stage sends a gradient alone before its first W
                assert any(batches[k] for k in deferred)
            every = [o for b in batches for o in b]
            assert len(every) == len(set(every)) == sum(len(action_recvs(a, peers)) + len(action_sends(a, peers))
                                                        for a in actions)
