"""ZeRO-1 across pipelines (``runtime/sync/zero.py``) trains exactly like single-process AdamW.

One forked 8-rank world runs, in float64 with the checks of ``exactness.py`` unless said otherwise:
- A sharded with unequal shard weights (GQA; pipelines cut at different layers, a tp-2 stage beside
  tp 1 and a tp-4 stage: shards of the common refinement's slices), clipping on;
- D sharded (tied embeddings: the matrix's shards over its 4 holding stages), clipping on;
- a resume chain: 2 steps of B sharded, a checkpoint, 2 steps of A with sharding OFF, a checkpoint,
  2 steps of A sharded with other shard weights: must equal 6 steps of the reference (sharded
  checkpoints hold full tensors under global names);
- C in fp16 sharded, an overflow forced into one rank's shard at step 1: every rank skips the step;
  within fp16 rounding of the fp32 reference that skips the same step (``test_precision.py``'s bound);
- a sharded run of A that measures each rank's optimizer-state bytes against the memory model.
``test_broken_runtime``-style: the same plan with one rank's shard cut shifted by one element fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ethpipe.runtime.sync.stage_optim as stage_optim
import ethpipe.runtime.sync.zero as zero
from ethpipe.cost.memory import moment_bytes_per_param
from ethpipe.plan import Plan
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.adapt.fault_hooks import OVERFLOW_ENV
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig, train

from .exactness import PARAM_ATOL, assert_matches_reference, assert_params_match
from .harness import run_ranks
from .reference import reference_train
from .test_precision import UNIT_ROUNDOFF
from .test_tensor_parallel import GQA, PLAN_A, PLAN_B, PLAN_C, PLAN_D, TIED

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

LR = 1e-3
BROKEN_ENV = "ETHPIPE_TEST_SHIFT_SHARD"  # this test's own hook: "RANK" shifts that rank's shard cuts by one


def sharded(plan: Plan, weights: tuple[float, ...] = ()) -> Plan:
    return dataclasses.replace(plan, shard_optimizer=True, shard_weights=weights)


WEIGHTS_1 = (3.0, 1.0, 2.0, 1.0, 1.0, 5.0, 1.0, 2.0)
WEIGHTS_2 = (1.0, 2.0, 1.0, 1.0, 4.0, 1.0, 3.0, 1.0)


def _shifted_bounds(numel: int, weights: Any) -> list[tuple[int, int]]:
    """A wrong runtime: this rank's shard cuts one element off from every other holder's."""
    bounds = _true_bounds(numel, weights)
    return [(min(a + 1, numel), min(b + 1, numel)) if i == 0 else (a, b) for i, (a, b) in enumerate(bounds)]


_true_bounds = zero.shard_bounds


def _worker(rank: int, world_size: int, runs: list[tuple[str, Plan, TrainConfig, dict[str, str]]],
            out_dir: str) -> None:
    built: list[stage_optim.StageOptimizer] = []
    build = stage_optim.build_stage_optimizer

    def capturing(*args: Any, **kwargs: Any) -> stage_optim.StageOptimizer:
        built.append(build(*args, **kwargs))
        return built[-1]

    import ethpipe.runtime.step as step_module
    step_module.build_stage_optimizer = capturing  # type: ignore[assignment]
    for name, plan, config, env in runs:
        os.environ.update(env)
        zero.shard_bounds = _shifted_bounds if os.environ.get(BROKEN_ENV) == str(rank) else _true_bounds
        try:
            records = train(plan, config, rank, world_size)
        finally:
            for key in env:
                os.environ.pop(key, None)
            zero.shard_bounds = _true_bounds
        opt = built[-1].optimizer
        state = {"state_bytes": opt.state_bytes() if hasattr(opt, "state_bytes") else None}
        Path(out_dir, f"{name}-rank{rank}.json").write_text(json.dumps(state))
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(records))


def test_sharded_optimizer_matches_single_process_adamw(tmp_path: Path) -> None:
    rng = np.random.default_rng(26)
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["state", "shard", "holder", "gather", "once", "."], size=4000))], data)
    common: dict[str, Any] = dict(data=data, lr=LR, progress=False, timeout_s=60.0, dtype="fp64")
    ckpt = str(tmp_path / "ckpt")
    final = {n: str(tmp_path / f"{n}.safetensors") for n in ("a", "d", "chain", "fp16", "broken")}
    runs: list[tuple[str, Plan, TrainConfig, dict[str, str]]] = [
        ("a", sharded(PLAN_A, WEIGHTS_1), TrainConfig(**common, steps=3, clip_grad=0.05, save_final=final["a"]), {}),
        ("d", sharded(PLAN_D), TrainConfig(**common, steps=2, clip_grad=0.05, save_final=final["d"],  # the optimizer's
                                           adam_betas=(0.8, 0.99), adam_eps=1e-6), {}),  # settings reach the shards
        ("b-on", sharded(PLAN_B, WEIGHTS_2), TrainConfig(**common, steps=2, checkpoint_dir=ckpt, bucket_bytes=2048), {}),
        ("a-off", PLAN_A, TrainConfig(**common, steps=4, checkpoint_dir=ckpt, resume=True), {}),
        ("a-on", sharded(PLAN_A, WEIGHTS_1), TrainConfig(**common, steps=6, checkpoint_dir=ckpt, resume=True,
                                                        save_final=final["chain"]), {}),
        ("fp16", sharded(PLAN_C), TrainConfig(**{**common, "dtype": "fp16"}, steps=3, save_final=final["fp16"]),
         {OVERFLOW_ENV: "3@1"}),
        ("a-equal", sharded(PLAN_A), TrainConfig(**common, steps=1), {}),
        ("broken", sharded(PLAN_A, WEIGHTS_1), TrainConfig(**common, steps=2, save_final=final["broken"]),
         {BROKEN_ENV: "3"}),
    ]
    run_ranks(8, _worker, (runs, str(tmp_path)), tmp_path, deadline_s=300.0)
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name, *_ in runs}
    kwargs: dict[str, Any] = dict(global_batch=8, seq_len=16, lr=LR, weight_decay=0.1, seed=0)

    ref_a = reference_train(GQA, data, steps=3, clip_grad=0.05, **kwargs)
    assert max(ref_a.grad_norms) > 0.05, "clipping never engaged: the test proves nothing"
    assert_matches_reference("A sharded", load_file(final["a"]), records["a"], ref_a)

    ref_d = reference_train(TIED, data, steps=2, clip_grad=0.05, betas=(0.8, 0.99), eps=1e-6,
                            **{**kwargs, "global_batch": PLAN_D.global_batch_size})
    assert_matches_reference("D sharded (tied)", load_file(final["d"]), records["d"], ref_d)

    ref_6 = reference_train(GQA, data, steps=6, clip_grad=0.0, **kwargs)
    chain = records["b-on"] + records["a-off"] + records["a-on"]
    assert [r["step"] for r in chain] == list(range(1, 7))
    assert_matches_reference("B on -> A off -> A on", load_file(final["chain"]), chain, ref_6)

    _check_fp16(data, load_file(final["fp16"]), records["fp16"])
    _check_state_bytes(tmp_path)

    ref_2 = reference_train(GQA, data, steps=2, clip_grad=0.0, **kwargs)
    broken = load_file(final["broken"])
    with pytest.raises(AssertionError):
        assert_params_match("broken", broken, ref_2.state)
    off = max(float((broken[k].double() - v).abs().max()) for k, v in ref_2.state.items())
    assert off > 1e3 * PARAM_ATOL, f"a shifted shard moved parameters by only {off:.1e}"


def _check_fp16(data: str, got: dict[str, torch.Tensor], records: list[dict[str, Any]]) -> None:
    from .test_tensor_parallel import GPT_LIKE
    ref = reference_train(GPT_LIKE, data, PLAN_C.global_batch_size, PLAN_C.seq_len, 3, LR, weight_decay=0.1,
                          clip_grad=0.0, seed=0, dtype=torch.float32, skip_steps=frozenset({1}))
    assert [r["skipped"] for r in records] == [False, True, False]
    u = UNIT_ROUNDOFF["fp16"]
    np.testing.assert_allclose([r["loss"] for r in records], ref.losses, rtol=u, err_msg="fp16 loss")
    init = build_full_model(GPT_LIKE, seed=0).state_dict()
    error = sum(float((got[k].float() - ref.state[k]).pow(2).sum()) for k in ref.state) ** 0.5
    update = sum(float((ref.state[k] - init[k]).pow(2).sum()) for k in ref.state) ** 0.5
    assert error <= 0.25 * update, f"fp16 sharded: ||p - p_ref|| = {error:.2e} vs update {update:.2e}"


def _check_state_bytes(tmp: Path) -> None:
    """Each rank's measured AdamW moment bytes equal the memory model's sharded term within 1%
    (``cost.memory.moment_bytes_per_param`` over the stage's parameters per TP rank, k = 3 pipelines)."""
    plan = sharded(PLAN_A)
    for pipe in plan.pipelines:
        for s, stage in enumerate(pipe.stages):
            params = (stage.num_layers * GQA.params_per_layer() + (GQA.embedding_params() if s == 0 else 0)
                      + (GQA.head_params() if s == pipe.depth - 1 else 0))
            model = moment_bytes_per_param(8, len(plan.pipelines)) * params / stage.tp
            for rank in stage.ranks:
                measured = json.loads((tmp / f"a-equal-rank{rank}.json").read_text())["state_bytes"]
                assert abs(measured - model) <= 0.01 * model, (rank, measured, model)
