"""One notation for a plan's pipelines (ethpipe/plan_text.py), and identical pipelines printed once."""

from __future__ import annotations

from ethpipe.plan import Pipeline, Stage
from ethpipe.plan_text import layers_text, micro_batches_text, pipeline_groups, pipeline_text, plan_shape, stage_text


def _pipe(first: str, cut: int, sizes: tuple[int, ...], recompute: bool = False) -> Pipeline:
    return Pipeline((Stage((0,), first, (0, cut), 1, recompute), Stage((1, 2), "a100_80gb_sxm", (cut, 32), 2, False)),
                    sizes)


def test_stages_pipelines_and_groups() -> None:
    assert layers_text([(0, 19)]) == "L0-18" and layers_text([(5, 6)]) == "L5"
    assert layers_text([(0, 7), (17, 23)]) == "L0-6+L17-22"
    pipe = _pipe("h100_sxm", 19, (1, 1, 1, 1), recompute=True)
    assert stage_text(pipe.stages[0]) == "h100_sxm L0-18*"
    assert pipeline_text(pipe) == "h100_sxm L0-18* -> a100_80gb_sxm tp2 L19-31"
    assert micro_batches_text(pipe) == "4 x b1" and micro_batches_text(_pipe("l4", 10, (2, 1))) == "2 (b2/1)"
    pipes = [pipe] * 3 + [_pipe("l4", 10, (2, 1))] + [pipe]
    assert [(i, p is pipe) for i, p in pipeline_groups(pipes)] == [([0, 1, 2], True), ([3], False), ([4], True)]


def test_one_line_per_group() -> None:
    from types import SimpleNamespace

    plan = SimpleNamespace(pipelines=[_pipe("h100_sxm", 19, (1, 1))] * 32)
    assert plan_shape(plan) == "32 x [h100_sxm L0-18 -> a100_80gb_sxm tp2 L19-31] 2 samples, 2 x b1"  # type: ignore[arg-type]
