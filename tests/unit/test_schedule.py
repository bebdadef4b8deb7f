"""Schedules (1F1B, zb-h1, interleaved) read as data, without processes."""

from __future__ import annotations

import pytest

from ethpipe.schedule import (
    Action, interleaved, interleaved_fits, last_weight_grad_index, max_in_flight, max_in_flight_layers, one_f_one_b,
    pipeline_schedule, split_microbatches, stage_actions, zb_h1,
)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
def test_every_microbatch_once_and_in_order(stages: int, microbatches: int) -> None:
    for stage, actions in enumerate(pipeline_schedule(stages, microbatches)):
        forwards = [a.microbatch for a in actions if a.kind == "F"]
        backwards = [a.microbatch for a in actions if a.kind == "B"]
        assert forwards == list(range(microbatches)) and backwards == list(range(microbatches))
        for i in range(microbatches):  # a micro-batch is forwarded before it is backwarded
            assert actions.index(Action("F", i)) < actions.index(Action("B", i))
        warmup = next(k for k, a in enumerate(actions) if a.kind == "B")
        assert warmup == min(stages - stage - 1, microbatches) + (1 if stages - stage - 1 < microbatches else 0)
        assert max_in_flight(actions) == min(stages - stage, microbatches)


def test_known_order_last_and_first_stage() -> None:
    assert [str(a) for a in one_f_one_b(3, 2, 3)] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert [str(a) for a in one_f_one_b(3, 0, 3)] == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert [str(a) for a in one_f_one_b(4, 1, 4)] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_fewer_microbatches_than_stages() -> None:
    assert [str(a) for a in one_f_one_b(6, 0, 2)] == ["F0", "F1", "B0", "B1"]
    assert [str(a) for a in one_f_one_b(6, 5, 2)] == ["F0", "B0", "F1", "B1"]


def test_no_deadlock_when_replayed_as_blocking_p2p() -> None:
    """Replay all stages with blocking receives and unbounded sends: every list must finish."""
    for stages in range(1, 6):
        for mbs in range(1, 7):
            lists = [list(a) for a in pipeline_schedule(stages, mbs)]
            sent_f: set[tuple[int, int]] = set()
            sent_b: set[tuple[int, int]] = set()
            progress = True
            while progress:
                progress = False
                for s, actions in enumerate(lists):
                    if not actions:
                        continue
                    a = actions[0]
                    ready = (s == 0 or (s - 1, a.microbatch) in sent_f) if a.kind == "F" else \
                        (s == stages - 1 or (s + 1, a.microbatch) in sent_b)
                    if ready:
                        (sent_f if a.kind == "F" else sent_b).add((s, a.microbatch))
                        actions.pop(0)
                        progress = True
            assert all(not a for a in lists), (stages, mbs)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        one_f_one_b(2, 2, 1)
    with pytest.raises(ValueError):
        one_f_one_b(2, 0, 0)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 13])
def test_zb_h1_splits_every_backward_but_stage_0s_and_keeps_1f1b_communication(stages: int, microbatches: int) -> None:
    for stage, (zb, ref) in enumerate(zip(pipeline_schedule(stages, microbatches, "zb-h1"),
                                          pipeline_schedule(stages, microbatches))):
        assert [a for a in zb if a.kind != "W"] == list(ref)  # F/B order (so every send and receive) is 1F1B's
        weights = [a.microbatch for a in zb if a.kind == "W"]
        assert weights == ([] if stage == 0 else list(range(microbatches)))
        assert split_microbatches(zb) == frozenset(weights)
        for j in weights:  # W j after B j, and after B (j + stage) when there is one: stage s defers s W passes
            after = zb.index(Action("B", min(j + stage, microbatches - 1)))
            assert zb.index(Action("W", j)) > after
        assert max_in_flight(zb) == (min(stages, microbatches) if stage > 0 else max_in_flight(ref))
        assert max_in_flight(zb) <= min(stages, microbatches)  # never more than 1F1B's stage 0
        assert last_weight_grad_index(zb) == len(zb) - 1


def test_zb_h1_known_orders_and_unsplit_stages() -> None:
    assert [str(a) for a in zb_h1(4, 3, 6)] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0", "F4", "B4",
                                                "W1", "F5", "B5", "W2", "W3", "W4", "W5"]
    assert [str(a) for a in zb_h1(4, 1, 4)] == ["F0", "F1", "F2", "B0", "F3", "B1", "W0", "B2", "W1", "B3", "W2",
                                                "W3"]
    assert zb_h1(4, 2, 5, split=False) == one_f_one_b(4, 2, 5)  # a recomputing stage runs whole backwards
    assert stage_actions("zb-h1", 4, 0, 5) == one_f_one_b(4, 0, 5)
    with pytest.raises(ValueError, match="schedule must be one of 1f1b, zb-h1, interleaved"):
        stage_actions("dualpipe", 4, 0, 5)
    with pytest.raises(ValueError, match="only 'interleaved' runs several chunks"):
        stage_actions("interleaved", 4, 0, 5)
    with pytest.raises(ValueError, match="only 'interleaved' runs several chunks"):
        stage_actions("1f1b", 4, 0, 5, num_chunks=2)


@pytest.mark.parametrize("stages,chunks", [(2, 2), (3, 2), (4, 3), (5, 4)])
def test_interleaved_runs_every_chunk_of_every_microbatch_once_backward_after_forward(stages: int, chunks: int) -> None:
    for m in [n for n in range(1, 3 * stages + 1) if interleaved_fits(stages, n)]:
        for s in range(stages):
            acts = stage_actions("interleaved", stages, s, m, num_chunks=chunks)
            pairs = [(a.kind, a.microbatch, a.chunk) for a in acts]
            assert sorted(pairs) == sorted((k, j, c) for k in "FB" for j in range(m) for c in range(chunks))
            assert all(pairs.index(("F", j, c)) < pairs.index(("B", j, c)) for j in range(m) for c in range(chunks))
            # forwards visit chunk 0 before chunk 1 of a micro-batch, backwards the other way
            assert all(pairs.index(("F", j, c)) < pairs.index(("F", j, c + 1)) and
                       pairs.index(("B", j, c + 1)) < pairs.index(("B", j, c)) for j in range(m) for c in range(chunks - 1))


def test_interleaved_known_orders_and_refused_counts() -> None:
    # Megatron's order: groups of `depth` micro-batches through chunk 0 then chunk 1; warm-up 2 (S - s - 1) + (v - 1) S
    assert [str(a) for a in interleaved(2, 1, 4, 2)] == [
        "F0", "F1", "F0.1", "B0.1", "F1.1", "B1.1", "F2", "B0", "F3", "B1", "F2.1", "B2.1", "F3.1", "B3.1", "B2", "B3"]
    assert [str(a) for a in interleaved(2, 0, 4, 2)][:6] == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1"]
    assert [a.kind for a in interleaved(3, 1, 3, 2)] == ["F"] * 6 + ["B"] * 6  # one group: every forward first
    assert max_in_flight(interleaved(2, 0, 4, 2)) == 5  # warm-up 4 (micro-batch, chunk) pairs, then one more
    assert max_in_flight_layers(interleaved(2, 0, 4, 2), (1, 1)) == 2.5  # ... of half a stage each
    assert max_in_flight_layers(interleaved(2, 0, 4, 2), (3, 1)) == pytest.approx(3.25)  # F0 F1 F0.1 F1.1 F2, B0.1, F3
    assert max_in_flight_layers(one_f_one_b(3, 0, 5), (4,)) == 3
    assert [interleaved_fits(3, m) for m in range(1, 10)] == [True, True, True, False, False, True, False, False, True]
    with pytest.raises(ValueError, match="runs at most 3 micro-batches or a multiple of 3, not 5: use 3 or 6"):
        interleaved(3, 0, 5, 2)
    with pytest.raises(ValueError, match="at least 2 stages and 2 model chunks"):
        interleaved(1, 0, 2, 2)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_stashed_inputs_live_as_long_as_the_graph_that_holds_them(schedule: str) -> None:
    """A split micro-batch's input stays referenced by its graph until its W: it counts as stashed until
    then, as in ``max_in_flight``; a first stage receives no input."""
    from ethpipe.schedule import max_stashed_inputs

    for stages, m in [(4, 8), (3, 2), (6, 4)]:
        for s in range(stages):
            acts = stage_actions(schedule, stages, s, m)
            assert max_stashed_inputs(acts, first=s == 0) == (0 if s == 0 else max_in_flight(acts))
    acts = interleaved(3, 0, 6, 2)
    assert max_stashed_inputs(acts, first=True) < max_stashed_inputs(acts, first=False) == max_in_flight(acts)


def test_a_last_stage_holds_one_head_graph_per_live_last_chunk_micro_batch() -> None:
    """1F1B's last stage runs F then B: one head and loss graph at a time; zb-h1 keeps each until its W;
    interleaved with every forward first keeps all of them (the memory model adds the rest: ``held_of``)."""
    from ethpipe.cost.plan_memory import held_of
    from ethpipe.plan import Pipeline, Stage

    flat = (Stage((0,), "x", (0, 4)), Stage((1,), "x", (4, 8)), Stage((2,), "x", (8, 12)))
    assert held_of(Pipeline(flat, (1,) * 6), 2).live_heads == 1
    assert held_of(Pipeline(flat, (1,) * 6, "zb-h1"), 2).live_heads == max_in_flight(zb_h1(3, 2, 6)) > 1
    assert held_of(Pipeline(flat, (1,) * 6), 1).live_heads == 0
    chunked = tuple(Stage((s,), "x", (2 * s, 2 * s + 2), chunks=((2 * s, 2 * s + 2), (6 + 2 * s, 8 + 2 * s)))
                    for s in range(3))
    assert held_of(Pipeline(chunked, (1,) * 3, "interleaved"), 2).live_heads == 3  # every forward first
    assert held_of(Pipeline(chunked, (1,) * 6, "interleaved"), 2).live_heads == 1


def test_the_memory_models_closed_form_counts_what_the_lists_hold() -> None:
    """``plan_memory`` counts 1F1B and zb-h1 lists in closed form (the planner asks for thousands of shapes):
    equal to counting the lists themselves for every stage of every shape here, split or not."""
    from ethpipe.cost.plan_memory import _held, _held_of_actions

    for schedule in ("1f1b", "zb-h1"):
        for depth in range(1, 13):
            for m in range(1, 3 * depth + 3):
                for s in range(depth):
                    for split in (True, False):
                        acts = stage_actions(schedule, depth, s, m, split)
                        counted = _held_of_actions(acts, (1,), s == 0, s == depth - 1)
                        assert _held(schedule, depth, s, m, split, (5,)) == counted, (schedule, depth, m, s, split)


def test_action_names_and_the_interleaved_rings_links() -> None:
    """Runtime spans and trace events are named by ``str(Action)``: chunk actions (``F3.1``) count as compute
    too; an interleaved pipeline of 3 or more stages has one more boundary, the wrap-around."""
    from ethpipe.cost.p2p import links
    from ethpipe.plan import Pipeline, Stage
    from ethpipe.schedule import is_action_name

    assert all(is_action_name(str(a)) for a in interleaved(3, 0, 6, 2) + zb_h1(3, 1, 4))
    assert not any(is_action_name(n) for n in ("recv", "Fx", "B3.", "allreduce block 2", "W", "F3.1.2"))
    chunked = tuple(Stage((s,), "x", (s, s + 1), chunks=((s, s + 1), (3 + s, 4 + s))) for s in range(3))
    assert [(a.ranks, b.ranks) for a, b in links(Pipeline(chunked, (1,), "interleaved"))] == [
        ((0,), (1,)), ((1,), (2,)), ((2,), (0,))]
    assert len(links(Pipeline(tuple(Stage((s,), "x", (2 * s, 2 * s + 2)) for s in range(3)), (1,)))) == 2
