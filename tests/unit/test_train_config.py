"""Training configuration: LR schedule, AdamW grouping, and plan checks that need no processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ethpipe.model_spec import model_presets
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig, check_plan_runnable, lr_at, make_optimizer


def test_lr_schedules() -> None:
    const = TrainConfig(data="x", steps=10, lr=1.0)
    assert [lr_at(const, k) for k in (0, 5, 9)] == [1.0, 1.0, 1.0]
    warm = dataclasses.replace(const, warmup_steps=4)
    assert [lr_at(warm, k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = dataclasses.replace(const, warmup_steps=1, lr_schedule="cosine")
    assert lr_at(cos, 1) == pytest.approx(1.0) and lr_at(cos, 9) == pytest.approx(0.1)
    assert lr_at(cos, 5) == pytest.approx(0.55)


def test_weight_decay_only_on_matrices() -> None:
    opt = make_optimizer(build_full_model("tiny-gpt"), TrainConfig(data="x", steps=1, weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and isinstance(opt, torch.optim.AdamW)


def test_bad_config_values() -> None:
    with pytest.raises(ValueError, match="--steps"):
        TrainConfig(data="x", steps=0)
    with pytest.raises(ValueError, match="--dtype"):
        TrainConfig(data="x", steps=1, dtype="fp8")  # type: ignore[arg-type]


def _plan(tp: int = 1) -> Plan:
    stage = Stage(tuple(range(tp)), "cpu", (0, 8), tp)
    pipes = (Pipeline((stage,), (2,)),)
    return Plan("custom", "tiny", 2, 16, pipes, compute_blocks(pipes), model_presets()["tiny"])


def test_plan_checks() -> None:
    check_plan_runnable(_plan(), 1)
    with pytest.raises(ValueError, match="needs 1 ranks but the world has 4"):
        check_plan_runnable(_plan(), 4)
    check_plan_runnable(_plan(tp=2), 2)  # tensor parallelism runs
    kv_heads = model_presets()["tiny"].num_kv_heads
    with pytest.raises(ValueError, match=rf"stages\[0\].tp' is {2 * kv_heads} .* {kv_heads} KV heads, fewer than"):
        check_plan_runnable(_plan(tp=2 * kv_heads), 2 * kv_heads)
