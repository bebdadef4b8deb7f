"""The sender's wait (cost/rendezvous.py): priced alike by the simulator, the replay and 1F1B's closed form.

A transfer starts once the sender has produced the tensor and the receiver has posted its receive (after its
previous action); the receiver waits for it before its action, the sender before its next action and its flush.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from ethpipe.cost.periodic_graph import base_count, extend, find_pattern
from ethpipe.cost.pipeline import stage_finish_s
from ethpipe.cost.rendezvous import stage_nodes
from ethpipe.cost.rendezvous_replay import EXTEND_FROM, _finish, _flat, _graph, rendezvous_finish_s
from ethpipe.cost.schedule_time import replay_finish_s, stage_finish_of
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.schedule import pipeline_schedule
from ethpipe.sim import simulate

from _sim_fakes import FakeCost, FreeSyncTiming, make_plan


def test_two_stages_slow_link_the_senders_wait_moves_the_flush() -> None:
    """Stage 0 (4 layers: F 4 s, B 8 s) before a light stage 1 (F 1 s, B 2 s), 1 s links, 3 micro-batches.
    Stage 0 is the bottleneck and runs F0, F1, B0, F2, B1, B2; its F1 waits until stage 1 has taken F0 (1 s:
    a receive stage 1 posted at the start), every later batch of it holds a 1 s receive (its send to stage 1
    goes at the same time), so it flushes at 3 (F + B) + 4 p = 40 s, not the 39 s of free sends. Stage 1's last
    send (B2's gradient) completes when stage 0, done with B1 at 3 F + 2 B + 3 p = 31 s, has taken it: 32 s."""
    f0, b0, p, m = 4.0, 8.0, 1.0, 3
    plan = make_plan([([(0, 4), (4, 5)], [1] * m, "fast")])
    report = simulate(plan, FakeCost(p2p_time_s=p))
    hand = [m * (f0 + b0) + (m + 1) * p, m * f0 + (m - 1) * b0 + (m + 1) * p]
    assert [r.flush_s for r in report.ranks] == hand == [40.0, 32.0]
    assert ("send F0", 0, 4.0, 5.0) in [(e.name, e.stage, e.start_s, e.end_s) for e in report.events]
    fwd = np.array([[f0] * m, [1.0] * m])
    bwd = np.array([[b0] * m, [2.0] * m])
    act, grad = np.array([[0.0] * m, [p] * m]), np.array([[p] * m, [0.0] * m])
    assert replay_finish_s("1f1b", fwd + act, bwd + grad, recv=(act, grad)) == pytest.approx(hand, rel=1e-12)
    assert stage_finish_s(fwd + act, bwd + grad, (act, grad)) == pytest.approx(hand, rel=1e-12)
    assert stage_finish_s(fwd + act, bwd + grad)[0] == m * (f0 + b0) + m * p  # free sends: 39 s


class _Links(FreeSyncTiming):
    """Per-sample stage times by layer (a virtual stage per layer) and per-direction link seconds by rank pair
    (0 for some: a free transfer keeps the old timeline)."""

    def __init__(self, per_sample: list[tuple[float, float, float]], links: dict[tuple[int, int], float]) -> None:
        self.per_sample, self.links = per_sample, links

    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        f, b, _ = self.per_sample[stage.layers[0]]
        return f * micro_batch, b * micro_batch

    def weight_grad_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> float:
        return 0.0 if stage.recompute else self.per_sample[stage.layers[0]][2] * micro_batch

    def p2p_s(self, src_rank: int, dst_rank: int, micro_batch: int) -> float:
        return self.links[(src_rank, dst_rank)] * micro_batch



def _case(rng: random.Random, schedule: str) -> tuple[Plan, _Links, tuple[np.ndarray, ...], tuple[bool, ...], int]:
    v = rng.randint(2, 3) if schedule == "interleaved" else 1
    depth = rng.randint(2, 5) if v > 1 else rng.randint(1, 6)
    m = rng.choice([n for n in range(1, 3 * depth + 1) if n <= depth or n % depth == 0]) if v > 1 else rng.randint(1, 12)
    b = rng.randint(1, 3)
    sizes = tuple([b] * (m - 1) + [rng.randint(1, b)])
    per = []
    for _ in range(depth * v):
        f = rng.uniform(0.3, 3.0)
        bw = f * rng.uniform(1.5, 3.0)
        per.append((f, bw, bw * rng.uniform(0.2, 0.6)))
    links = {(a, c): rng.choice([0.0, rng.uniform(0.05, 2.0), rng.uniform(0.05, 2.0)])
             for a in range(depth) for c in range(depth)}
    unsplit = tuple(rng.random() < 0.15 for _ in range(depth)) if schedule == "zb-h1" else ()
    stages = tuple(Stage((s,), "x", (s, s + 1), 1, bool(unsplit and unsplit[s]),
                         tuple((c * depth + s, c * depth + s + 1) for c in range(v)) if v > 1 else None)
                   for s in range(depth))
    pipe = Pipeline(stages, sizes, schedule)
    plan = Plan(method="eth", model="tiny", global_batch_size=sum(sizes), seq_len=16, pipelines=(pipe,),
                blocks=compute_blocks([pipe]))
    rows = depth * v
    rank = [r % depth for r in range(rows)]
    act = np.array([[links[(rank[r - 1], rank[r])] * n if r else 0.0 for n in sizes] for r in range(rows)])
    grad = np.array([[links[(rank[r + 1], rank[r])] * n if r + 1 < rows else 0.0 for n in sizes] for r in range(rows)])
    fwd = np.array([[per[r][0] * n for n in sizes] for r in range(rows)]) + act
    bwd = np.array([[per[r][1] * n for n in sizes] for r in range(rows)]) + grad
    moved = np.array([[0.0 if unsplit and unsplit[r % depth] else per[r][2] * n for n in sizes] for r in range(rows)])
    return plan, _Links(per, links), (fwd, bwd, moved, act, grad), unsplit, v


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_the_replay_is_the_simulators_rendezvous_on_random_plans(schedule: str) -> None:
    """Unequal stages, ragged micro-batches, direction-dependent and some free links; zb-h1's deferred sends
    (waited after the W), recomputing stages that never split, interleaved units and the ring's wrap-around.
    1F1B's closed form stays a lower bound, and with every link free everything is what it was, bit for bit."""
    rng = random.Random({"1f1b": 41, "zb-h1": 42, "interleaved": 43}[schedule])
    moved_somewhere = 0
    for _ in range(80):
        plan, table, (fwd, bwd, moved, act, grad), unsplit, v = _case(rng, schedule)
        exact = np.array([r.flush_s for r in simulate(plan, table).ranks])
        w = moved if schedule == "zb-h1" else None
        got = replay_finish_s(schedule, fwd, bwd, w, unsplit, v, (act, grad))
        assert got == pytest.approx(exact, rel=1e-12, abs=1e-12), (plan.pipelines[0], table.links)
        free = replay_finish_s(schedule, fwd - act, bwd - grad, w, unsplit, v)
        zeros = replay_finish_s(schedule, fwd - act, bwd - grad, w, unsplit, v, (0 * act, 0 * grad))
        assert np.array_equal(free, zeros)
        moved_somewhere += bool(np.any(got > replay_finish_s(schedule, fwd, bwd, w, unsplit, v) * (1 + 1e-9)))
        if schedule == "1f1b":
            assert np.all(stage_finish_of("1f1b", fwd, bwd, recv=(act, grad)) <= exact * (1 + 1e-12))
            assert np.array_equal(stage_finish_s(fwd - act, bwd - grad, (0 * act, 0 * grad)),
                                  stage_finish_s(fwd - act, bwd - grad))
    assert moved_somewhere > 20  # the senders' waits did change most timelines


def test_a_stage_running_its_ws_has_posted_the_next_receive() -> None:
    """zb-h1 on two stages, 3 micro-batches, 0.5 s links: stage 0 (F 0.5 s, B 1 s) is ready to send F2's
    activation at 5.0 s, while stage 1 (F 1 s, input-gradient B 1 s, W 2 s) runs W0 from 5.5 to 7.5 s. Its
    receive for F2 was posted with B1's deferred send, before W0, so the transfer runs at 5.5-6.0 s (once stage 0
    posts it with its receive of B1's gradient), stage 0's B1 starts at 6.0 s and stage 1's F2 right after W0.
    With that receive posted after W0 (the order before 2026-12-07) stage 0's send waited until 8.0 s: flushes
    11.5 and 14.0 s instead of 11.0 and 13.5 s."""
    m, p = 3, 0.5
    stages = (Stage((0,), "x", (0, 1)), Stage((1,), "x", (1, 2)))
    pipe = Pipeline(stages, (1,) * m, "zb-h1")
    plan = Plan(method="eth", model="tiny", global_batch_size=m, seq_len=16, pipelines=(pipe,),
                blocks=compute_blocks([pipe]))
    report = simulate(plan, _Links([(0.5, 1.0, 0.0), (1.0, 3.0, 2.0)], {(0, 1): p, (1, 0): p, (0, 0): 0, (1, 1): 0}))
    at = {(e.stage, e.name): (e.start_s, e.end_s) for e in report.events}
    assert at[(1, "W0")] == (5.5, 7.5) and at[(1, "recv F2")] == (5.5, 6.0) and at[(1, "F2")] == (7.5, 8.5)
    assert at[(0, "B1")] == (6.0, 7.0) and (0, "send F2") not in at  # the sender never waited
    assert [r.flush_s for r in report.ranks] == [11.0, 13.5]
    assert (report.ranks[1].recv_s, report.ranks[1].bubble_s) == (1.0, 0.5)  # F2's receive ran during W0: no wait
    sizes = np.ones((2, m))
    act, grad = np.array([[0.0] * m, [p] * m]), np.array([[p] * m, [0.0] * m])
    fwd, bwd = np.array([[0.5], [1.0]]) * sizes + act, np.array([[1.0], [3.0]]) * sizes + grad
    moved = np.array([[0.0], [2.0]]) * sizes
    assert list(replay_finish_s("zb-h1", fwd, bwd, moved, recv=(act, grad))) == [11.0, 13.5]


def test_1f1b_closed_form_is_exact_on_equal_stages_with_slow_links() -> None:
    """Equal stages and links (any speed): the closed form's paths price the rendezvous exactly."""
    for depth, m, f, b, p in [(2, 3, 1.0, 2.0, 0.5), (4, 8, 1.0, 2.0, 1.5), (6, 4, 2.0, 3.0, 0.3), (8, 16, 1.0, 2.0, 4.0)]:
        act = np.full((depth, m), p)
        act[0] = 0.0
        grad = np.full((depth, m), p)
        grad[-1] = 0.0
        fwd, bwd = np.full((depth, m), f) + act, np.full((depth, m), b) + grad
        exact = replay_finish_s("1f1b", fwd, bwd, recv=(act, grad))
        assert stage_finish_s(fwd, bwd, (act, grad)) == pytest.approx(exact, rel=1e-12)


def test_the_nodes_follow_the_runtimes_batches() -> None:
    """zb-h1's stage 1 posts its B's send and the next unit's receive before the W and waits both after it; an
    interleaved steady-state unit's F waits both its own and its B's receives, and the unit's sends go out after
    the B."""
    lists = pipeline_schedule(3, 4, "zb-h1", (False,) * 3)
    acts, nodes = lists[1], stage_nodes(lists)[1]
    kinds = [str(acts[n.action]) if n.action >= 0 else "wait" for n in nodes]
    assert kinds == ["F0", "F1", "B0", "F2", "B1", "W0", "wait", "F3", "B2", "W1", "wait", "B3", "W2", "W3", "wait"]
    wait = nodes[6]
    assert [str(acts[x.action]) for x in wait.sends] == ["B1"] and wait.sends[0].posted == 4
    assert [str(acts[r.action]) for r in wait.recvs] == ["F3"] and wait.posted == 4  # posted after B1, before W0
    assert nodes[7].sends == () and nodes[7].recvs == () and nodes[7].src is not None
    # Its producer's send waits for that post (stage 0 sends F3's activation), not for the end of W0.
    up = stage_nodes(lists)[0]
    assert [x.post for n in up for x in n.sends if x.dst == 1 and str(lists[0][x.action]) == "F3"] == [4]
    lists = pipeline_schedule(2, 4, "interleaved", (False,) * 2, 2)
    acts, nodes = lists[1], stage_nodes(lists, 2)[1]
    at = next(k for k, n in enumerate(nodes) if len(n.recvs) == 2)
    unit, after, following = nodes[at], nodes[at + 1], nodes[at + 2]
    assert [str(acts[r.action]) for r in unit.recvs] == ["F2", "B0"]
    assert str(acts[after.action]) == "B0" and after.recvs == () and after.sends == ()
    assert [(str(acts[x.action]), x.posted) for x in following.sends] == [("F2", at + 1), ("B0", at + 1)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_a_receive_starts_where_its_send_is_posted(schedule: str) -> None:
    """Every timed receive waits for the node after which its producer posts the send, the same node the sender's
    side of that transfer starts from: an interleaved F's output goes out with its unit's B (``p2p_units``), so
    a receiver cannot have it at the end of the F (a review found the two sides disagreeing there)."""
    for depth, m, chunks in [(2, 4, 2), (3, 6, 2), (4, 8, 2), (3, 6, 3), (4, 4, 1), (3, 7, 1)]:
        if (schedule == "interleaved") != (chunks > 1):
            continue
        lists = pipeline_schedule(depth, m, schedule, (False,) * depth, chunks)
        nodes = stage_nodes(lists, chunks)
        posted = {(s, send.dst, lists[s][send.action].microbatch, send.action): send.posted
                  for s, stage in enumerate(nodes) for node in stage for send in node.sends}
        checked = 0
        for s, stage in enumerate(nodes):
            for node in stage:
                for r in node.recvs:
                    a = lists[s][r.action]
                    sends = [at for (src, dst, j, k), at in posted.items()
                             if src == r.src and dst == s and j == a.microbatch and lists[src][k].kind == a.kind]
                    assert r.node in sends, (schedule, depth, m, chunks, s, a, r, sends)
                    checked += 1
        assert checked > 0


def _same_flat(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_long_pipelines_graph_is_extended_exactly(schedule: str) -> None:
    """The graph of a long pipeline, written from the affine pattern of three short counts
    (cost/periodic_graph.py), is the node-by-node one, array for array: every depth to 12, three recompute
    patterns (none, every other stage, the last), counts from the base to three steady states past it. A pattern
    is found for each shape, so the planner's long pipelines are all extended."""
    for depth in range(1, 13):
        for unsplit in ((False,) * depth, tuple(s % 2 == 0 for s in range(depth)),
                        tuple(s == depth - 1 for s in range(depth))):
            build = functools.partial(_flat, schedule, depth, unsplit=unsplit)
            pattern = find_pattern(build, depth)
            assert pattern is not None, (schedule, depth, unsplit)
            for m in range(base_count(depth), base_count(depth) + 3 * depth + 4, 1 if depth < 5 else 3):
                assert _same_flat(extend(pattern, m), build(m)), (schedule, depth, unsplit, m)


def test_a_pattern_that_does_not_write_the_third_count_is_refused() -> None:
    """The pattern is checked against the count after the two it is read from: a build that differs there (one
    micro-batch index of one term) gets no pattern, so such graphs are built node by node."""
    depth = 4
    build = functools.partial(_flat, "zb-h1", depth, unsplit=(False,) * depth)

    def bent(m: int):
        flat = build(m)
        if m == base_count(depth) + 2:
            flat.terms[len(flat.terms) // 2, 5] += 1
        return flat
    assert find_pattern(build, depth) is not None
    assert find_pattern(bent, depth) is None


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_replays_graph_past_the_extension_point_is_the_node_by_node_one() -> None:
    """What the rendezvous replay evaluates (``_graph``, levelled) for a long zb-h1 pipeline with a recomputing
    stage is, field for field, the levelling of the node-by-node graph; so is every flush it prices."""
    depth, unsplit = 6, (False, True, False, False, False, False)
    m = base_count(depth) + EXTEND_FROM + 5
    direct = _finish(_flat("zb-h1", depth, m, unsplit))
    assert _same(tuple(_graph("zb-h1", depth, m, unsplit, 1)), tuple(direct))
    rng = np.random.default_rng(3)
    table, transfers = rng.uniform(0.5, 2.0, (5, depth, m)), rng.uniform(0.01, 0.3, (3, depth, m))
    flush = rendezvous_finish_s("zb-h1", table, transfers, unsplit, 1)
    assert flush.shape == (depth,) and np.all(flush > table[0].sum(-1))
