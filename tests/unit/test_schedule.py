"""1F1B action lists read as data, without processes."""

from __future__ import annotations

import pytest

from ethpipe.schedule import Action, max_in_flight, one_f_one_b, pipeline_schedule


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
