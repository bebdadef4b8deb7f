"""The interleaved schedule trains to the same parameters as single-process AdamW; a sync armed too early fails.

One forked 6-rank world runs three trainings one after another (fp64, 3 steps each, the tolerances of
``exactness.py``):

- an interleaved pipeline of 3 stages x 2 chunks with 6 ragged micro-batches, an interleaved pipeline of
  2 stages x 2 chunks of unequal layers with 2 micro-batches (every forward first), and a 1F1B stage, side
  by side: blocks are all-reduced across pipelines whose chunks cut the model differently;
- tied embeddings with a tp-2 middle stage and a recomputing last stage in an interleaved pipeline of 3
  micro-batches, next to an interleaved 2-stage pipeline of 3 chunks per stage whose first stage recomputes
  (the tied matrix lives in chunk 0 of the first stage and the last chunk of the last);
- the first plan with the gradient sync armed at the stage's first backward instead of its last: buckets
  all-reduce before later chunks' gradients are in, and the checks must fail;
- checkpoints across layouts: 2 steps under the first plan, saved, then resumed for the third under a
  plan with one range per stage (1F1B and zb-h1), and the other way round; both match 3 reference steps.
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
THREE_BY_TWO = [((0, 1), (3, 4)), ((1, 2), (4, 5)), ((2, 3), (5, 6))]  # 6 layers in 6 virtual stages
TWO_BY_TWO = [((0, 2), (3, 5)), ((2, 3), (5, 6))]  # unequal chunks
TWO_BY_THREE = [((0, 1), (2, 3), (4, 5)), ((1, 2), (3, 4), (5, 6))]  # three chunks per stage (the planner tries 2-4)

StageDef = tuple[tuple[int, ...], tuple[tuple[int, int], ...], bool]  # ranks, chunks (or one range), recompute


def _plan(spec: ModelSpec, pipelines: list[tuple]) -> Plan:
    """``(stages, sizes[, schedule])`` per pipeline; stages with several chunks run interleaved."""
    pipes = tuple(Pipeline(tuple(Stage(ranks, "cpu", chunks[0], len(ranks), rc, chunks if len(chunks) > 1 else ())
                                 for ranks, chunks, rc in stages), sizes,
                           "interleaved" if len(stages[0][1]) > 1 else (rest[0] if rest else "1f1b"))
                  for stages, sizes, *rest in pipelines)
    plan = Plan("custom", spec.name, sum(p.num_samples for p in pipes), 16, pipes, compute_blocks(pipes),
                model_spec=spec)
    return Plan.from_dict(json.loads(plan.to_json()))  # validated as a plan file is, chunks included


MIXED = _plan(LLAMA_LIKE, [
    ([((r,), THREE_BY_TWO[r], False) for r in range(3)], (2, 1, 2, 1, 1, 2)),
    ([((3 + r,), TWO_BY_TWO[r], False) for r in range(2)], (1, 2)),
    ([((5,), ((0, 6),), False)], (2, 1)),
])
TIED_TP = _plan(TIED, [
    ([((0,), THREE_BY_TWO[0], False), ((1, 2), THREE_BY_TWO[1], False), ((3,), THREE_BY_TWO[2], True)], (1, 2, 1)),
    ([((4,), TWO_BY_THREE[0], True), ((5,), TWO_BY_THREE[1], False)], (2, 1, 1, 2)),
])
FLAT = _plan(LLAMA_LIKE, [
    ([((r,), ((2 * r, 2 * r + 2),), False) for r in range(3)], (3, 3, 3)),
    ([((3,), ((0, 3),), False), ((4,), ((3, 6),), False)], (3,), "zb-h1"),
    ([((5,), ((0, 6),), False)], (2, 1)),
])


def _armed_at_first_b(actions: tuple) -> int:
    return min(k for k, a in enumerate(actions) if a.kind == "B")


RUNS: list[tuple[str, Plan, ArmAt]] = [
    ("mixed", MIXED, None),
    ("tied-tp-recompute", TIED_TP, None),
    ("armed-at-first-b", MIXED, _armed_at_first_b),
]
RESUMES = [("interleaved-then-flat", MIXED, FLAT), ("flat-then-interleaved", FLAT, MIXED)]  # 2 steps, then 1


def _worker(rank: int, world_size: int, data: str, out_dir: str) -> None:
    jobs = [(name, plan, arm_at, exact_config(data, out_dir, name, steps=STEPS)) for name, plan, arm_at in RUNS]
    for name, first, then in RESUMES:
        ckpt = str(Path(out_dir, f"ckpt-{name}"))
        jobs += [(f"{name}-saved", first, None, exact_config(data, out_dir, f"{name}-saved", steps=STEPS - 1,
                                                             checkpoint_dir=ckpt)),
                 (name, then, None, exact_config(data, out_dir, name, steps=STEPS, checkpoint_dir=ckpt, resume=True))]
    train_jobs(rank, world_size, jobs, out_dir)


def test_interleaved_matches_single_process_adamw_resumes_across_layouts_and_an_early_sync_does_not(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    words = ["each", "rank", "holds", "two", "chunks", "of", "the", "model", "."]
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(words, size=4000))], data)
    assert {p.world_size for _, p, _ in RUNS} == {FLAT.world_size} == {6}
    assert [p.num_chunks for p in MIXED.pipelines] == [2, 2, 1] and [p.num_chunks for p in TIED_TP.pipelines] == [2, 3]
    run_ranks(6, _worker, (data, str(tmp_path)), tmp_path, deadline_s=240.0)
    refs: dict = {}
    for name, plan, arm_at in RUNS + [(name, then, None) for name, _, then in RESUMES]:
        ref = reference_of(plan, data, refs)
        got, records = outputs(tmp_path, name)
        if name in {n for n, _, _ in RESUMES}:  # one resumed step: its parameters and its step's stats
            assert len(records) == 1
            assert_matches_reference(name, got, records, ref, first_step=STEPS - 1)
            continue
        if arm_at is None:
            assert_matches_reference(name, got, records, ref)
            assert max(ref.grad_norms) > 0.05, "clipping never engaged"
        else:
            assert fails(lambda: assert_params_match(name, got, ref.state)), "a sync before the last B must be caught"
            assert fails(lambda: assert_stats_match(name, records, ref))
