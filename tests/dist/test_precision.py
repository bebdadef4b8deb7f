"""fp16 (dynamic loss scaling) and bf16 autocast train like the fp32 reference, within 16-bit rounding.

One forked 3-rank world (two pipelines: depth 2 on ranks 0-1, depth 1 on rank 2) runs:
- fp16 and bf16, 4 steps each;
- fp16 with an overflow forced into ONE rank's gradients at step 1 (rank 2, the test hook
  ``ETHPIPE_TEST_OVERFLOW``): every rank must skip that step (else the replicas of a layer in
  the two pipelines diverge), the scale must halve, and training must go on and match a
  reference that skips the same step;
- the same run split in two halves with a checkpoint between: the loss scaler is resumed.

Tolerances against the fp32 single-process reference, derived from the unit roundoff u of the
autocast type (fp16: u = 2^-11 = 4.9e-4; bf16: u = 2^-8 = 3.9e-3): the loss is a mean of
log-softmax terms whose inputs carry a few roundings, so its relative error is O(u); rtol = u.
Gradients pass back through a few rounded products per layer: rtol 4u on the gradient norm.
Parameters: AdamW's update m / sqrt(v) is not linear in the gradient error (tiny elements
flip), so the check is on the whole update: ||p - p_ref|| <= 0.25 ||p_ref - p_0|| (the direction
agrees; measured 0.02-0.05). A forgotten unscale (x 65536 gradient norm) or a rank stepping
alone fails these by orders of magnitude.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ethpipe.runtime.step as step_module
from ethpipe.plan import Plan
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.adapt.fault_hooks import OVERFLOW_ENV
from ethpipe.runtime.sync.loss_scale import INIT_SCALE
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig, train

from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan
from .reference import ReferenceRun, reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

STEPS, LR = 4, 1e-3
PLAN = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1)), ([(2, (0, 6))], (2, 1))])
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _worker(rank: int, world_size: int, runs: list[tuple[str, TrainConfig, str | None]], out_dir: str) -> None:
    stages: list[torch.nn.Module] = []
    build = step_module.build_stage

    def capturing(*args: Any, **kwargs: Any) -> torch.nn.Module:
        stages.append(build(*args, **kwargs))
        return stages[-1]

    step_module.build_stage = capturing  # type: ignore[assignment]
    for name, config, overflow in runs:
        if overflow:
            os.environ[OVERFLOW_ENV] = overflow
        try:
            records = train(PLAN, config, rank, world_size)
        finally:
            os.environ.pop(OVERFLOW_ENV, None)
        torch.save(stages[-1].state_dict(), Path(out_dir, f"{name}-rank{rank}.pt"))
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(records))


def _run(tmp: Path) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    rng = np.random.default_rng(3)
    data = str(tmp / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["half", "precision", "full", "result", "."], size=3000))], data)
    common: dict[str, Any] = dict(data=data, lr=LR, progress=False, timeout_s=60.0)
    runs = [
        ("fp16", TrainConfig(**common, steps=STEPS, dtype="fp16"), None),
        ("bf16", TrainConfig(**common, steps=STEPS, dtype="bf16"), None),
        ("overflow", TrainConfig(**common, steps=STEPS, dtype="fp16"), "2@1"),
        ("first-half", TrainConfig(**common, steps=2, dtype="fp16", checkpoint_dir=str(tmp / "ck")), "2@1"),
        ("second-half", TrainConfig(**common, steps=STEPS, dtype="fp16", checkpoint_dir=str(tmp / "ck"),
                                    resume=True), None),
    ]
    run_ranks(3, _worker, (runs, str(tmp)), tmp)
    return data, {name: json.loads((tmp / f"{name}.json").read_text()) for name, _, _ in runs}


def _whole_model(tmp: Path, name: str, plan: Plan) -> dict[str, torch.Tensor]:
    """Pipeline 0's stages make the whole model; pipeline 1's replica must equal it bit for bit."""
    merged: dict[str, torch.Tensor] = {}
    for rank in plan.pipelines[0].ranks:
        merged.update(torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=True))
    replica = torch.load(tmp / f"{name}-rank{plan.pipelines[1].ranks[0]}.pt", weights_only=True)
    assert set(replica) == set(merged)
    diverged = [k for k in merged if not torch.equal(merged[k], replica[k])]
    assert not diverged, f"{name}: the pipelines' replicas diverged (a rank stepped alone?): {diverged[:3]}"
    return merged


def _assert_close_to(name: str, dtype: str, got: dict[str, torch.Tensor], records: list[dict[str, Any]],
                     ref: ReferenceRun, init: dict[str, torch.Tensor]) -> None:
    u = UNIT_ROUNDOFF[dtype]
    np.testing.assert_allclose([r["loss"] for r in records], ref.losses, rtol=u, err_msg=f"{name} loss")
    norms = [(r["grad_norm"], want) for r, want in zip(records, ref.grad_norms) if r["grad_norm"] is not None]
    np.testing.assert_allclose(*zip(*norms), rtol=4 * u, err_msg=f"{name} grad_norm")
    error = sum(float((got[k] - ref.state[k]).pow(2).sum()) for k in ref.state) ** 0.5
    update = sum(float((ref.state[k] - init[k]).pow(2).sum()) for k in ref.state) ** 0.5
    assert error <= 0.25 * update, f"{name}: ||p - p_ref|| = {error:.2e} vs update {update:.2e}"


def test_fp16_and_bf16_follow_fp32_and_an_overflow_skips_everywhere(tmp_path: Path) -> None:
    data, records = _run(tmp_path)
    kwargs: dict[str, Any] = dict(weight_decay=0.1, clip_grad=0.0, seed=0, dtype=torch.float32)
    ref = reference_train(LLAMA_LIKE, data, PLAN.global_batch_size, PLAN.seq_len, STEPS, LR, **kwargs)
    ref_skip = reference_train(LLAMA_LIKE, data, PLAN.global_batch_size, PLAN.seq_len, STEPS, LR,
                               skip_steps=frozenset({1}), **kwargs)
    init = build_full_model(LLAMA_LIKE, seed=0).state_dict()
    for dtype in ("fp16", "bf16"):
        _assert_close_to(dtype, dtype, _whole_model(tmp_path, dtype, PLAN), records[dtype], ref, init)
    assert [r["loss"] for r in records["fp16"]] != ref.losses, "fp16 equals fp32 exactly: autocast was off"
    assert [r["loss_scale"] for r in records["fp16"]] == [INIT_SCALE] * STEPS
    assert not any(r["skipped"] for r in records["fp16"])

    overflow = records["overflow"]
    assert [r["skipped"] for r in overflow] == [False, True, False, False]
    assert [r["loss_scale"] for r in overflow] == [INIT_SCALE, INIT_SCALE, INIT_SCALE / 2, INIT_SCALE / 2]
    assert overflow[1]["grad_norm"] is None and overflow[1]["lr"] == LR  # the step counts, its update does not
    _assert_close_to("overflow", "fp16", _whole_model(tmp_path, "overflow", PLAN), overflow, ref_skip, init)

    resumed = records["first-half"] + records["second-half"]
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in overflow], "the scaler was not resumed"
    assert [r["loss"] for r in resumed] == [r["loss"] for r in overflow]  # same kernels, same order: bit for bit
    whole = _whole_model(tmp_path, "overflow", PLAN)
    again = _whole_model(tmp_path, "second-half", PLAN)
    assert all(torch.equal(whole[k], again[k]) for k in whole)
