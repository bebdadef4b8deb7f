"""Tied input/output embeddings train exactly under multi-stage and multi-pipeline plans.

The `tiny-gpt` preset with ``tie_embeddings=True`` (learned positions, biases), clipping on.
Two forked worlds (a plan's world size must equal the world's):
- 3 ranks: A = one pipeline of depth 3 (tied group: ranks 0 and 2), 3 steps from --init-from,
  --save-final and a training checkpoint;
- 6 ranks: B = three pipelines of depths 1, 2, 3 with uneven micro-batches (tied group 0, 1, 2,
  3, 5), the same 3 steps; C = A's checkpoint resumed under two pipelines of depths 2 and 4 (the
  tied copies reshard) for 2 more steps.
Every rank dumps its whole stage, so every replica (each copy of the tied matrix included) is
compared with single-process PyTorch, and the copies with each other bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ethpipe.runtime.step as step_module
from ethpipe.model_spec import model_presets
from ethpipe.plan import Plan
from ethpipe.runtime.checkpoint.consolidated import save_atomic
from ethpipe.runtime.checkpoint.weights import export_checkpoint
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.groups import tied_ranks
from ethpipe.runtime.model.decoder import TIED_WEIGHT, build_full_model
from ethpipe.runtime.train import TrainConfig, train

from .exactness import assert_params_match, assert_stats_match
from .harness import run_ranks
from .plans import make_plan
from .reference import ReferenceRun, reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

SPEC = dataclasses.replace(model_presets()["tiny-gpt"], tie_embeddings=True)
LR = 1e-3
CLIP = 0.05
STEPS_A = 3
STEPS_C = 5
PLAN_A = make_plan(SPEC, [([(0, (0, 2)), (1, (2, 5)), (2, (5, 6))], (3, 2, 1))])
PLAN_B = make_plan(SPEC, [
    ([(0, (0, 6))], (2, 1)),  # depth 1: one matrix used twice
    ([(1, (0, 4)), (2, (4, 6))], (1, 1)),
    ([(3, (0, 1)), (4, (1, 3)), (5, (3, 6))], (1,)),  # one micro-batch < stages
])
PLAN_C = make_plan(SPEC, [
    ([(0, (0, 3)), (1, (3, 6))], (1, 2)),
    ([(2, (0, 1)), (3, (1, 2)), (4, (2, 4)), (5, (4, 6))], (3,)),
])


def _capture_stages(out: list[torch.nn.Module]) -> None:
    """Keep the stage ``train`` builds (this forked rank only), to dump every replica afterwards."""
    build = step_module.build_stage

    def capturing(*args: Any, **kwargs: Any) -> torch.nn.Module:
        module = build(*args, **kwargs)
        out.append(module)
        return module

    step_module.build_stage = capturing  # type: ignore[assignment]


def _worker(rank: int, world_size: int, runs: list[tuple[str, Plan, TrainConfig]], out_dir: str) -> None:
    stages: list[torch.nn.Module] = []
    _capture_stages(stages)
    for name, plan, config in runs:
        records = train(plan, config, rank, world_size)
        torch.save(stages[-1].state_dict(), Path(out_dir, f"{name}-rank{rank}.pt"))
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(records))


def _check_run(tmp: Path, name: str, plan: Plan, ref: ReferenceRun, first_step: int = 0) -> None:
    copies = []
    for rank in range(plan.world_size):
        got = torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=True)
        assert (TIED_WEIGHT in got) == (rank in tied_ranks(plan)), (name, rank)
        assert not any(k.startswith("head.") for k in got), (name, rank)
        assert_params_match(f"{name} rank {rank}", got, {k: ref.state[k] for k in got})
        if TIED_WEIGHT in got:
            copies.append(got[TIED_WEIGHT])
    assert len(copies) == len(tied_ranks(plan)) >= 2
    assert all(torch.equal(c, copies[0]) for c in copies), f"{name}: the tied copies diverged"
    assert_stats_match(name, json.loads((tmp / f"{name}.json").read_text()), ref, first_step)


def test_tied_embeddings_match_single_process_adamw(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    words = ["tied", "weights", "stay", "equal", "when", "every", "copy", "sums", "the", "gradients", "."]
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(words, size=2000))], data)
    common: dict[str, Any] = {"data": data, "lr": LR, "clip_grad": CLIP, "progress": False, "timeout_s": 60.0,
                              "dtype": "fp64"}
    ckpt = str(tmp_path / "ckpt")
    init = str(tmp_path / "init.safetensors")  # --init-from fills every tied copy with the file's tok_emb.weight
    save_atomic(build_full_model(SPEC, seed=7).state_dict(), init)
    run_a = ("a", PLAN_A, TrainConfig(**common, steps=STEPS_A, save_final=str(tmp_path / "a.safetensors"),
                                      checkpoint_dir=ckpt, trace=str(tmp_path / "a.trace.json"), init_from=init))
    run_b = ("b", PLAN_B, TrainConfig(**common, steps=STEPS_A, bucket_bytes=4096, init_from=init))
    run_c = ("c", PLAN_C, TrainConfig(**common, steps=STEPS_C, checkpoint_dir=ckpt, resume=True))
    for world, runs in ((3, [run_a]), (6, [run_b, run_c])):
        (tmp_path / f"world{world}").mkdir()
        run_ranks(world, _worker, (runs, str(tmp_path)), tmp_path / f"world{world}", deadline_s=120.0)

    assert PLAN_A.global_batch_size == PLAN_B.global_batch_size == PLAN_C.global_batch_size
    kwargs: dict[str, Any] = {"global_batch": PLAN_A.global_batch_size, "seq_len": PLAN_A.seq_len, "lr": LR,
                              "weight_decay": 0.1, "clip_grad": CLIP, "seed": 0, "init_seed": 7}
    ref_a = reference_train(SPEC, data, steps=STEPS_A, **kwargs)
    ref_c = reference_train(SPEC, data, steps=STEPS_C, **kwargs)
    assert max(ref_c.grad_norms) > CLIP, "clipping never engaged: the test proves nothing"
    _check_run(tmp_path, "a", PLAN_A, ref_a)
    _check_run(tmp_path, "b", PLAN_B, ref_a)
    _check_run(tmp_path, "c", PLAN_C, ref_c, first_step=STEPS_A)

    # --save-final and export hold the model's own names and load into the single-process model
    export_checkpoint(ckpt, tmp_path / "exported.safetensors")  # the newest checkpoint: C's last step
    for file_name, ref in (("a.safetensors", ref_a), ("exported.safetensors", ref_c)):
        state = load_file(str(tmp_path / file_name))
        model = build_full_model(SPEC)
        model.load_state_dict(state)  # strict: exactly the model's keys
        assert model.head.weight is model.tok_emb.weight
        assert_params_match(file_name, state, ref.state)

    trace = json.loads((tmp_path / "a.trace.json").read_text())["traceEvents"]
    slices = {(e["tid"], e["name"]) for e in trace if e["ph"] == "X"}
    assert {(0, "allreduce tied"), (2, "allreduce tied")} <= slices and (1, "allreduce tied") not in slices
