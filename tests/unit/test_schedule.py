"""Schedules (1F1B, zb-h1) read as data, without processes."""

from __future__ import annotations

import pytest

from ethpipe.schedule import (
    Action, last_weight_grad_index, max_in_flight, one_f_one_b, pipeline_schedule, split_microbatches, stage_actions,
    zb_h1,
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
    with pytest.raises(ValueError, match="schedule must be one of 1f1b, zb-h1"):
        stage_actions("interleaved", 4, 0, 5)
