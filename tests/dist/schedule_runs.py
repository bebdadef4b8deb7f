"""What the schedule exactness tests share: trainings in fp64 one after another in one forked world (each
optionally with the gradient sync armed somewhere else, to show the checks catch it), their outputs, and
the single-process references they are compared with (one per model and batch)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

import ethpipe.runtime.pipeline.executor as executor
from ethpipe.plan import Plan
from ethpipe.runtime.train import TrainConfig, train

from .reference import ReferenceRun, reference_train

STEPS, LR = 3, 1e-3
ArmAt = Callable[[tuple], int] | None  # where the sync's hooks arm instead of the last weight-gradient action
Job = tuple[str, Plan, ArmAt, TrainConfig]


def exact_config(data: str, out_dir: str, name: str, **kw: Any) -> TrainConfig:
    """fp64, clipping engaged, small buckets (several per stage), the final parameters saved as ``name``."""
    return TrainConfig(data=data, lr=LR, progress=False, timeout_s=60.0, dtype="fp64", clip_grad=0.05,
                       bucket_bytes=4096, save_final=str(Path(out_dir, f"{name}.safetensors")), **kw)


def train_jobs(rank: int, world_size: int, jobs: Sequence[Job], out_dir: str) -> None:
    """Every job on this rank (ranks beyond a plan's world sit it out); rank 0 writes each job's records."""
    real = executor.last_weight_grad_index
    for name, plan, arm_at, config in jobs:
        executor.last_weight_grad_index = arm_at or real  # type: ignore[assignment]
        records = train(plan, config, rank, world_size) if rank < plan.world_size else []
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(records))
    executor.last_weight_grad_index = real  # type: ignore[assignment]


def outputs(out_dir: Path, name: str) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """A job's final parameters and per-step records."""
    return load_file(out_dir / f"{name}.safetensors"), json.loads((out_dir / f"{name}.json").read_text())


def reference_of(plan: Plan, data: str, refs: dict[tuple[str, int], ReferenceRun]) -> ReferenceRun:
    """Single-process AdamW on the plan's model and batch, ``STEPS`` steps (cached in ``refs``)."""
    spec = plan.resolve_model()
    key = (spec.name, plan.global_batch_size)
    if key not in refs:
        refs[key] = reference_train(spec, data, plan.global_batch_size, plan.seq_len, STEPS, LR,
                                    weight_decay=0.1, clip_grad=0.05, seed=0)
    return refs[key]
