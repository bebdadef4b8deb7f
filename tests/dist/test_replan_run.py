"""`train --replan-after`: a plan switch inside the running job keeps training exact (fp64 scheme).

One forked 3-rank world trains 4 steps under A = two pipelines (depth 2 + depth 1); after step 2 the replanner
(a fixed one here: the fit and the planner's choice are tested in tests/unit/test_run_fit.py) switches to B =
one pipeline of depth 3: every rank checkpoints, rebuilds its stage under B from that checkpoint and goes on in
the same process. Losses, gradient norms and the final weights equal single-process training, the metrics
file holds each step once with the decision on the switching step, and a switch that does not restore the
optimizer state from the checkpoint fails the same checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file

from ethpipe.plan import Plan
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.train import TrainConfig, train

from .exactness import assert_params_match, assert_stats_match
from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

PLAN_A = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1)), ([(2, (0, 6))], (2, 1))])
PLAN_B = make_plan(LLAMA_LIKE, [([(0, (0, 2)), (1, (2, 4)), (2, (4, 6))], (3, 3))])
STEPS, LR, AFTER = 4, 1e-3, 2


@dataclass(frozen=True)
class FixedReplanner:
    """Switches to ``plan`` after ``after_steps`` steps, whatever was measured."""

    after_steps: int
    plan: Plan

    def __call__(self, current: Plan, records: list[dict[str, Any]]) -> tuple[Plan | None, dict[str, Any]]:
        assert [r["step"] for r in records] == list(range(1, self.after_steps + 1))  # every step so far, on rank 0
        return self.plan, {"switched": True, "line": "test: switching to plan B", "after_steps": len(records)}


def _worker(rank: int, world_size: int, data: str, out: str, name: str, forget_optimizer: bool) -> None:
    if forget_optimizer:  # a broken switch: the new stage's AdamW state starts empty instead of from the checkpoint
        import ethpipe.runtime.step as step_module

        real = step_module.load_checkpoint

        def load_weights_only(start, module, optimizer, device, **kw):  # type: ignore[no-untyped-def]
            real(start, module, optimizer, device, **kw)
            return None

        step_module.load_checkpoint = load_weights_only
    config = TrainConfig(data=data, steps=STEPS, lr=LR, progress=False, timeout_s=60.0, dtype="fp64",
                         checkpoint_dir=str(Path(out, f"ckpt-{name}")), metrics=str(Path(out, f"{name}.jsonl")),
                         save_final=str(Path(out, f"{name}.safetensors")), clip_grad=0.05)
    records = train(PLAN_A, config, rank, world_size, replanner=FixedReplanner(AFTER, PLAN_B))
    if rank == 0:
        Path(out, f"{name}.json").write_text(json.dumps(records))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("replan")
    rng = np.random.default_rng(0)
    data = str(tmp / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["learn", "the", "devices", "re", "plan", "."], size=3000))], data)
    for name, broken in (("switch", False), ("broken", True)):
        world = tmp / f"w-{name}"
        world.mkdir()
        run_ranks(3, _worker, (data, str(tmp), name, broken), world)
    ref = reference_train(LLAMA_LIKE, data, PLAN_A.global_batch_size, PLAN_A.seq_len, STEPS, LR, 0.1, 0.05, 0)
    return {"tmp": tmp, "ref": ref}


def test_a_switch_inside_the_job_continues_exactly(run: dict[str, Any]) -> None:
    tmp, ref = run["tmp"], run["ref"]
    records = json.loads((tmp / "switch.json").read_text())
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert_stats_match("switch", records, ref)
    assert_params_match("switch", load_file(tmp / "switch.safetensors"), ref.state)
    lines = [json.loads(x) for x in (tmp / "switch.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))  # each step once, across the switch
    assert [bool(r.get("replan")) for r in lines] == [False, True, False, False]
    assert [len(r["split"]) for r in lines] == [2, 2, 1, 1]  # A's two pipelines, then B's one
    assert all(len(r["rank_fwd_s"]) == 3 and min(r["rank_bwd_s"]) > 0 for r in lines)


def test_a_switch_that_drops_the_optimizer_state_fails_the_checks(run: dict[str, Any]) -> None:
    tmp, ref = run["tmp"], run["ref"]
    records = json.loads((tmp / "broken.json").read_text())
    assert_stats_match("broken, before the switch", records[:AFTER + 1], ref)  # the step after still uses A's grads
    with pytest.raises(AssertionError):
        assert_params_match("broken", load_file(tmp / "broken.safetensors"), ref.state)
