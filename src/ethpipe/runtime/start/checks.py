"""Every check of user input that ``ethpipe train`` makes before any process group exists.

They run identically on every rank (and in the launcher before it spawns any), so bad input makes
every rank raise the same one-line UserError instead of some ranks hanging.
"""

from __future__ import annotations

from pathlib import Path

from ethpipe.catalog import check_one_world
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.plan_validate import check_tp
from ethpipe.precision import (
    check_dtype_fits,
    check_train_dtype,
    plan_gpus,
    train_dtype,
)
from ethpipe.runtime.adapt.emulate import check_emulation
from ethpipe.runtime.checkpoint.consolidated import check_checkpoint
from ethpipe.runtime.checkpoint.layout import (
    ResumePoint,
    check_fresh_dir,
    complete_checkpoints,
    find_resume,
)
from ethpipe.runtime.config import TrainConfig
from ethpipe.runtime.data import TokenFile, open_tokens, validate_data, with_documents
from ethpipe.runtime.start.run_settings import check_strict_resume
from ethpipe.runtime.pipeline.validation import open_validation


def _launch_fix(plan: Plan) -> str:
    """How to start the plan's world: per node where the plan knows its nodes."""
    if plan.cluster is None:
        return f"launch {plan.world_size} processes (or run `ethpipe train` without torchrun)"
    from ethpipe.cluster_launch import node_ranks

    nodes = node_ranks(plan)
    if len(nodes) == 1:
        return f"launch with --nproc-per-node {plan.world_size} on one node (or run `ethpipe train` without torchrun)"
    counts = ", ".join(f"node {k}: --nproc-per-node {n.num_ranks}" for k, n in enumerate(nodes))
    return f"start {len(nodes)} nodes in the cluster file's order ({counts}); `ethpipe launch` prints the commands"


def check_plan_runnable(plan: Plan, world_size: int) -> ModelSpec:
    """Plan-level checks that need no processes (also run by the launcher before spawning)."""
    if world_size != plan.world_size:
        raise UserError(f"the plan needs {plan.world_size} ranks but the world has {world_size}: {_launch_fix(plan)}")
    spec = plan.resolve_model()
    check_one_world(plan_gpus(plan), "the plan")
    check_tp(plan.pipelines, spec)
    if plan.seq_len > spec.max_seq_len:
        raise UserError(f"plan seq_len {plan.seq_len} exceeds model '{spec.name}' max_seq_len {spec.max_seq_len}")
    return spec


def check_inputs(plan: Plan, config: TrainConfig, world_size: int,
                 rank: int | None = None) -> tuple[ModelSpec, TokenFile, ResumePoint]:
    """Every user-input check, before any process group exists; also where training starts. ``rank``: on a
    rank, the checkpoint's files are checked a stride per rank (the launcher, with None, checks them all)."""
    spec = check_plan_runnable(plan, world_size)
    check_train_dtype(plan, config.dtype)
    if config.dtype is not None:
        check_dtype_fits(plan, config.dtype)
    data = open_tokens(config.data, spec.vocab_size)
    if config.samples == "documents":
        data = with_documents(data, plan.seq_len)
    start = ResumePoint()
    if config.checkpoint_dir is not None and Path(config.checkpoint_dir).exists() and not Path(
            config.checkpoint_dir).is_dir():
        raise UserError(f"--checkpoint-dir '{config.checkpoint_dir}' is a file, not a directory: give a directory "
                        "(it is created if missing)")
    resume = config.resume or (config.auto_resume and bool(complete_checkpoints(config.checkpoint_dir or "")))
    if resume:
        assert config.checkpoint_dir is not None
        start = find_resume(config.checkpoint_dir, spec, plan.seq_len, config.shuffle, config.seed,
                            data.num_samples(plan.seq_len), None if rank is None else (rank, world_size))
        if start.step > config.steps or (start.step == config.steps and not config.auto_resume):
            raise UserError(f"the checkpoint is at step {start.step} and --steps is {config.steps}: nothing to "
                            "train; raise --steps")
    elif config.checkpoint_dir is not None:
        check_fresh_dir(config.checkpoint_dir)
    if config.strict_resume and start.manifest is not None:
        check_strict_resume(start.manifest, config, train_dtype(plan, config.dtype))
    if start.step == 0:
        validate_data(data, plan.seq_len, plan.global_batch_size, config.steps, config.shuffle, spec.vocab_size)
    else:
        _validate_resumed_data(data, plan, config, start)
    if config.init_from is not None and start.step_dir is None:
        check_checkpoint(config.init_from, spec)
    if config.eval_every and config.val_data is not None:
        open_validation(config.val_data, plan, config.eval_batches, spec.vocab_size, config.samples == "documents")
    if config.emulate:
        check_emulation(plan)
    if config.compile and any(s.tp > 1 for p in plan.pipelines for s in p.stages):
        raise UserError("--compile with a tensor-parallel stage is not supported (its collectives sit inside "
                        "the blocks): drop --compile, or plan with --max-tp 1")
    for s in config.slowdowns:
        if not 0 <= s.rank < plan.world_size:
            raise UserError(f"slowdown rank {s.rank} is not in the plan (world size {plan.world_size})")
    _check_dashboards(config)
    return spec, data, start


def _check_dashboards(config: TrainConfig) -> None:
    """The packages --tensorboard / --wandb need, before any rank starts (rank 0 logs; every rank checks alike)."""
    from importlib.util import find_spec

    if config.tensorboard is not None and find_spec("tensorboard") is None:
        raise UserError("--tensorboard needs the tensorboard package: pip install 'ethpipe[tensorboard]'")
    if config.wandb is not None and find_spec("wandb") is None:
        raise UserError("--wandb needs the wandb package: pip install 'ethpipe[wandb]'")


def _validate_resumed_data(data: TokenFile, plan: Plan, config: TrainConfig, start: ResumePoint) -> None:
    end_sample = start.next_sample + (config.steps - start.step) * plan.global_batch_size
    available = data.num_samples(plan.seq_len)
    if end_sample > available:
        raise UserError(
            f"data file '{data.path}' holds {available} samples but resuming at sample {start.next_sample} for "
            f"{config.steps - start.step} more steps of {plan.global_batch_size} needs {end_sample}: use fewer "
            "--steps or more data"
        )
    validate_data(data, plan.seq_len, 1, end_sample, config.shuffle, plan.resolve_model().vocab_size)
