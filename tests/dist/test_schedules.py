"""Every schedule trains to the same parameters as single-process AdamW, and a misplaced W is caught.

One forked 6-rank world runs five trainings one after another (fp64, 3 steps each, the tolerances of
``exactness.py``):

- three pipelines of different depths and ragged micro-batches (one with fewer micro-batches than
  stages), running zb-h1, zb-h1 and 1F1B side by side, so blocks are all-reduced across schedules;
- tied embeddings with a tp-2 stage between tp-1 stages and a recomputed stage, all zb-h1, next to a
  zb-h1 pipeline of two stages (the tied matrix synced between first and last stages);
- one 6-stage zb-h1 pipeline with 4 micro-batches (the late stages defer more W passes than there are
  micro-batches: all their W run after the last B);
- the first plan again with the sync armed at the last B instead of the last W (the old 1F1B rule): the
  blocks' all-reduces fire before the deferred weight gradients are in, and the checks must fail;
- the first plan with every pipeline on 1F1B, as the control the schedules are compared with.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.tokens.texts import prepare_tokens

from .exactness import fails, assert_matches_reference, assert_params_match, assert_stats_match
from .harness import run_ranks
from .plans import GPT_LIKE, LLAMA_LIKE
from .schedule_runs import STEPS, ArmAt, exact_config, outputs, reference_of, train_jobs

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

TIED = dataclasses.replace(GPT_LIKE, name="test-gpt-tied", tie_embeddings=True)

PipeDef = tuple[list[tuple[tuple[int, ...], tuple[int, int], bool]], tuple[int, ...], str]


def _plan(spec: ModelSpec, pipelines: list[PipeDef]) -> Plan:
    pipes = tuple(Pipeline(tuple(Stage(ranks, "cpu", layers, len(ranks), rc) for ranks, layers, rc in stages), sizes,
                           schedule) for stages, sizes, schedule in pipelines)
    plan = Plan("custom", spec.name, sum(p.num_samples for p in pipes), 16, pipes, compute_blocks(pipes),
                model_spec=spec)
    return Plan.from_dict(json.loads(plan.to_json()))  # validated as a plan file is, schedules included


THREE = _plan(LLAMA_LIKE, [
    ([((0,), (0, 2), False), ((1,), (2, 4), False), ((2,), (4, 6), False)], (2, 2, 1), "zb-h1"),
    ([((3,), (0, 3), False), ((4,), (3, 6), False)], (1,), "zb-h1"),  # one micro-batch, fewer than stages
    ([((5,), (0, 6), False)], (2, 1), "1f1b"),
])
TIED_TP = _plan(TIED, [
    ([((0,), (0, 2), False), ((1, 2), (2, 4), False), ((3,), (4, 6), True)], (1, 2, 1), "zb-h1"),
    ([((4,), (0, 3), True), ((5,), (3, 6), False)], (2, 1), "zb-h1"),
])
DEEP = _plan(LLAMA_LIKE, [([((r,), (r, r + 1), False) for r in range(6)], (2, 1, 2, 1), "zb-h1")])
THREE_1F1B = dataclasses.replace(THREE, pipelines=tuple(dataclasses.replace(p, schedule="1f1b")
                                                        for p in THREE.pipelines))


def _armed_at_last_b(actions: tuple) -> int:
    return max(k for k, a in enumerate(actions) if a.kind == "B")


RUNS: list[tuple[str, Plan, ArmAt]] = [
    ("three-mixed-schedules", THREE, None),
    ("tied-tp-recompute", TIED_TP, None),
    ("deep", DEEP, None),
    ("armed-at-last-b", THREE, _armed_at_last_b),
    ("three-1f1b", THREE_1F1B, None),
]


def _worker(rank: int, world_size: int, data: str, out_dir: str) -> None:
    train_jobs(rank, world_size, [(name, plan, arm_at, exact_config(data, out_dir, name, steps=STEPS))
                                  for name, plan, arm_at in RUNS], out_dir)


def test_every_schedule_matches_single_process_adamw_and_a_misplaced_w_does_not(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    words = ["zero", "bubble", "weight", "passes", "fill", "the", "drain", "."]
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(words, size=4000))], data)
    assert {p.world_size for _, p, _ in RUNS} == {6}
    run_ranks(6, _worker, (data, str(tmp_path)), tmp_path, deadline_s=240.0)
    refs: dict = {}
    for name, plan, arm_at in RUNS:
        ref = reference_of(plan, data, refs)
        got, records = outputs(tmp_path, name)
        if arm_at is None:
            assert_matches_reference(name, got, records, ref)
            assert max(ref.grad_norms) > 0.05, "clipping never engaged"
        else:
            assert fails(lambda: assert_params_match(name, got, ref.state)), "a W after the sync must be caught"
            assert fails(lambda: assert_stats_match(name, records, ref))
