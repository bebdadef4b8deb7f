"""Simulator against hand-computed timelines (times are round numbers from FakeCost)."""

from __future__ import annotations

import pytest

from ethpipe.sim import simulate
from ethpipe.sim.report import SimReport

from _sim_fakes import FakeCost, make_plan


def _spans(report: SimReport, rank: int) -> list[tuple[str, float, float]]:
    return [(e.name, e.start_s, e.end_s) for e in report.events if e.kind == "compute" and rank in e.ranks]


def test_one_stage_runs_forward_backward_back_to_back() -> None:
    plan = make_plan([([(0, 4)], [1, 1, 1], "fast")])
    report = simulate(plan, FakeCost(optimizer_time_s=1.0))
    assert _spans(report, 0) == [("F0", 0, 4), ("B0", 4, 12), ("F1", 12, 16), ("B1", 16, 24), ("F2", 24, 28), ("B2", 28, 36)]
    assert report.iteration_time_s == 37.0
    (stats,) = report.ranks
    assert (stats.busy_s, stats.idle_s, stats.bubble_s, stats.sync_wait_s) == (37.0, 0.0, 0.0, 0.0)
    assert report.exposed_comm_s == 0.0
    assert report.tokens_per_s == pytest.approx(3 * 16 / 37.0)


def test_two_stages_three_microbatches_with_p2p() -> None:
    # Transfers are rendezvous: a 0.5 s transfer starts when both the sender has produced the tensor and the
    # receiver has posted its receive (after its previous action), and occupies the receiver before its action
    # and the sender before its next one: stage 0's F1 waits until stage 1 has taken F0, and stage 1's flush
    # until stage 0, done with B1, has taken B2.
    plan = make_plan([([(0, 1), (1, 2)], [1, 1, 1], "fast")])
    report = simulate(plan, FakeCost(p2p_time_s=0.5, optimizer_time_s=0.25))
    assert _spans(report, 0) == [("F0", 0, 1), ("F1", 1.5, 2.5), ("B0", 5, 7), ("F2", 7, 8), ("B1", 8.5, 10.5),
                                 ("B2", 12, 14)]
    assert _spans(report, 1) == [("F0", 1.5, 2.5), ("B0", 2.5, 4.5), ("F1", 5, 6), ("B1", 6, 8),
                                 ("F2", 8.5, 9.5), ("B2", 9.5, 11.5)]
    comm = [(e.name, e.stage, e.start_s, e.end_s) for e in report.events if e.kind == "p2p"]
    assert ("recv B2", 0, 11.5, 12.0) in comm and ("recv F1", 1, 4.5, 5.0) in comm
    assert sorted(c for c in comm if c[0].startswith("send")) == [("send B2", 1, 11.5, 12.0), ("send F0", 0, 1.0, 1.5)]
    assert len(comm) == 8
    assert report.iteration_time_s == 14.25
    s0, s1 = report.ranks
    assert (s0.flush_s, s0.recv_s, s0.bubble_s, s0.busy_s) == (14.0, 1.5, 3.5, 9.25)
    assert (s1.flush_s, s1.recv_s, s1.bubble_s, s1.idle_s) == (12.0, 1.5, 1.5, 14.25 - 9.25)
    assert (s0.peak_memory_bytes, s1.peak_memory_bytes) == (201, 101)  # 1F1B: stage 0 holds 2 micro-batches
    path = [(e.name, e.stage) for e in report.critical_path]
    assert path == [("F0", 0), ("recv F0", 1), ("F0", 1), ("B0", 1), ("recv F1", 1), ("F1", 1), ("B1", 1),
                    ("recv F2", 1), ("F2", 1), ("B2", 1), ("recv B2", 0), ("B2", 0), ("optimizer", 0)]
    assert report.pipeline_flush_s == (14.0,)


def test_unequal_stages_bottleneck_on_first_stage() -> None:
    plan = make_plan([([(0, 3), (3, 4)], [1, 1], "fast")])
    report = simulate(plan, FakeCost())
    assert _spans(report, 0) == [("F0", 0, 3), ("F1", 3, 6), ("B0", 6, 12), ("B1", 12, 18)]
    assert _spans(report, 1) == [("F0", 3, 4), ("B0", 4, 6), ("F1", 6, 7), ("B1", 7, 9)]
    assert report.iteration_time_s == 18.0
    assert [r.bubble_s for r in report.ranks] == [0.0, 3.0]  # stage 1 waits only for the first F0
    assert report.ranks[1].idle_s == 18.0 - 6.0


def test_smaller_last_microbatch_is_shorter() -> None:
    plan = make_plan([([(0, 1), (1, 2)], [2, 1], "fast")])
    report = simulate(plan, FakeCost())
    assert _spans(report, 0) == [("F0", 0, 2), ("F1", 2, 3), ("B0", 8, 12), ("B1", 12, 14)]
    assert _spans(report, 1) == [("F0", 2, 4), ("B0", 4, 8), ("F1", 8, 9), ("B1", 9, 11)]
    assert report.iteration_time_s == 14.0
    assert [r.peak_memory_bytes for r in report.ranks] == [2 * 2 * 100 + 1, 1 * 2 * 100 + 1]


def _two_pipelines_sync_cost() -> FakeCost:
    return FakeCost(grad_bytes_by_layers={(0, 1): 1000, (1, 2): 3000}, optimizer_time_s=0.5)


def test_blockwise_sync_overlaps_the_drain_of_other_stages() -> None:
    plan = make_plan([([(0, 1), (1, 2)], [1], "fast"), ([(0, 1), (1, 2)], [1], "fast")])
    report = simulate(plan, _two_pipelines_sync_cost())
    # Last stages flush at 4 and sync block 1 (3 s) while first stages still run B0 until 6.
    ar = sorted((e.block, e.ranks[0], e.start_s, e.end_s) for e in report.events if e.kind == "allreduce")
    assert ar == [(0, 0, 6, 7), (0, 2, 6, 7), (1, 1, 4, 7), (1, 3, 4, 7)]
    assert report.iteration_time_s == 7.5
    assert report.exposed_comm_s == 1.0  # without sync: flush 6 + optimizer 0.5
    assert [r.sync_wait_s for r in report.ranks] == [1.0, 3.0, 1.0, 3.0]


def test_flat_sync_waits_for_the_slowest_flush() -> None:
    plan = make_plan([([(0, 1), (1, 2)], [1], "fast"), ([(0, 1), (1, 2)], [1], "fast")])
    report = simulate(plan, _two_pipelines_sync_cost(), flat_sync=True)
    ar = sorted((e.block, e.ranks[0], e.start_s, e.end_s) for e in report.events if e.kind == "allreduce")
    assert ar == [(0, 0, 6, 7), (0, 2, 6, 7), (1, 1, 6, 9), (1, 3, 6, 9)]
    assert report.iteration_time_s == 9.5
    assert report.critical_path[-1].name == "optimizer"
    assert [e.name for e in report.critical_path][-2] == "allreduce block 1"


def test_shared_holder_syncs_blocks_in_descending_order() -> None:
    # Pipeline 1 (one stage, twice as fast) holds both blocks and syncs them in the runtime's order, blocks
    # descending: block 1 with pipeline 0's last stage (free at 8), then block 0 with its first (free at 12).
    plan = make_plan([([(0, 2), (2, 4)], [1], "fast"), ([(0, 4)], [1], "quick")])
    cost = FakeCost(fwd_per_layer_s={"fast": 1.0, "quick": 0.5}, grad_bytes_by_layers={(0, 2): 1000, (2, 4): 1000})
    report = simulate(plan, cost)
    ar = {(e.block, e.ranks[0]): (e.start_s, e.end_s) for e in report.events if e.kind == "allreduce"}
    assert ar[(1, 1)] == (8, 9) and ar[(1, 2)] == (8, 9)
    assert ar[(0, 0)] == (12, 13) and ar[(0, 2)] == (12, 13)
    assert report.iteration_time_s == 13.0
    assert report.ranks[2].bubble_s == 0.0 and report.ranks[2].sync_wait_s == 7.0


def test_microbatches_fewer_than_stages() -> None:
    plan = make_plan([([(0, 1), (1, 2), (2, 3)], [1], "fast")])
    report = simulate(plan, FakeCost())
    assert report.iteration_time_s == 3 * 1 + 3 * 2
    assert [e.name for e in report.critical_path][:3] == ["F0", "recv F0", "F0"]


def test_to_dict_is_json_ready() -> None:
    import json

    plan = make_plan([([(0, 1), (1, 2)], [1, 1], "fast")])
    report = simulate(plan, FakeCost())
    data = json.loads(json.dumps(report.to_dict()))
    assert data["iteration_time_s"] == report.iteration_time_s
    assert len(data["ranks"]) == 2 and "events" not in data
    assert len(report.to_dict(include_events=True)["events"]) == len(report.events)


def test_every_optimizer_waits_for_the_steps_stats_after_the_last_sync() -> None:
    """runtime/step.py: after its sync every rank joins ONE world-wide all-gather of the step's stats (the gradient
    norm the clipped optimizer needs), so no rank steps its optimizer before the slowest rank's sync is done. The
    quick pipeline (flush 6) waits for the slow one (flush 12) and the 0.5 s stats gather: its optimizer runs at
    12.5, not 6, and the critical path runs through the gather."""
    plan = make_plan([([(0, 4)], [1], "fast"), ([(0, 4)], [1], "quick")])
    report = simulate(plan, FakeCost(fwd_per_layer_s={"fast": 1.0, "quick": 0.5}, optimizer_time_s=1.0,
                                     stats_time_s=0.5))
    gathers = sorted((e.ranks[0], e.start_s, e.end_s) for e in report.events if e.name == "allgather stats")
    assert gathers == [(0, 12.0, 12.5), (1, 12.0, 12.5)]
    optimizers = sorted((e.ranks[0], e.start_s, e.end_s) for e in report.events if e.kind == "optimizer")
    assert optimizers == [(0, 12.5, 13.5), (1, 12.5, 13.5)]
    assert report.iteration_time_s == 13.5
    assert [r.sync_wait_s for r in report.ranks] == [0.5, 6.5]
    assert report.exposed_comm_s == 0.0  # the gather is the step's own, not the sync's
    assert [e.name for e in report.critical_path][-3:] == ["B0", "allgather stats", "optimizer"]
