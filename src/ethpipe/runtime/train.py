"""The training loop of one rank: build the stage, run 1F1B, sync blocks, clip, AdamW, report, checkpoint.

``train`` runs on every rank of an initialised (or to-be-initialised) process group. All
checks that can fail on user input run before any collective, identically on every rank,
so bad input makes every rank raise the same one-line UserError instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

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
from ethpipe.runtime.checkpoint import (
    check_checkpoint,
    gather_consolidated,
    load_into,
    save_atomic,
)
from ethpipe.runtime.ckpt_layout import (
    DataCursor,
    ResumePoint,
    check_fresh_dir,
    complete_checkpoints,
    find_resume,
)
from ethpipe.runtime.ckpt_state import load_checkpoint, save_checkpoint
from ethpipe.runtime.data import (
    TokenFile,
    gather_samples,
    open_tokens,
    sample_ids,
    validate_data,
)
from ethpipe.runtime.emulate import (
    EmulateMode,
    Emulator,
    Slowdown,
    check_emulate_mode,
    check_emulation,
    make_emulator,
)
from ethpipe.runtime.executor import StageIO, Timeline, run_stage_step
from ethpipe.runtime.fault_hooks import (
    ForwardKill,
    kill_spec,
    maybe_hang,
    maybe_kill,
    maybe_overflow,
)
from ethpipe.runtime.grad_sync import (
    BlockGradSync,
    clip_coefficient,
    owned_square_norm,
    scale_gradients,
    stage_sync_units,
    tied_parameters,
)
from ethpipe.runtime.groups import build_groups, control_group, destroy_groups
from ethpipe.runtime.loss_scale import LossScaler, count_nonfinite, unscale_gradients
from ethpipe.runtime.metrics import (
    MetricsWriter,
    gather_stats,
    step_record,
    write_chrome_trace,
)
from ethpipe.runtime.model import PARAM_DTYPES, build_stage, state_dict_shapes
from ethpipe.runtime.placement import gather_and_check
from ethpipe.runtime.rebalance import RebalanceConfig, Rebalancer, split_of
from ethpipe.runtime.tensor_parallel import TPGroup
from ethpipe.runtime.watchdog import Watchdog
from ethpipe.schedule import one_f_one_b

__all__ = ["TrainConfig", "check_inputs", "check_plan_runnable", "lr_at", "make_optimizer", "sample_ids", "train"]

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``ethpipe train`` takes besides the plan (defaults = the CLI's defaults)."""

    data: str
    steps: int
    lr: float = 3e-4
    weight_decay: float = 0.1  # decoupled, on parameters with >= 2 dims only
    clip_grad: float = 0.0  # max global grad norm; 0 = no clipping
    seed: int = 0  # model init and shuffle order
    shuffle: bool = False
    # None: the plan's precision (``precision.train_dtype``); bf16/fp16: autocast over fp32 weights and
    # optimizer (fp16 with dynamic loss scaling); fp64: parameters, activations and optimizer in float64
    # (exactness checks)
    dtype: Literal["fp32", "bf16", "fp16", "fp64"] | None = None
    recompute: bool = False  # activation recomputation on every stage (plans may also set it per stage)
    metrics: str | None = None
    init_from: str | None = None
    save_final: str | None = None
    emulate: bool = False
    emulate_mode: EmulateMode = "paced"  # paced: the plan's targets; measured: real compute x scale / speed
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    trace: str | None = None
    slowdowns: tuple[Slowdown, ...] = ()  # emulated stragglers (seam for --emulate-slowdown)
    bucket_bytes: int = 0  # 0: one all-reduce per block; else split blocks into buckets of this size
    timeout_s: float = 300.0  # every collective and p2p fails after this instead of hanging
    progress: bool = True  # rich progress bar on rank 0
    device: Literal["auto", "cpu"] = "auto"
    checkpoint_dir: str | None = None  # training checkpoints (torch.distributed.checkpoint), see docs/checkpoints.md
    save_every: int = 0  # save every K steps (0: only after the last step); needs checkpoint_dir
    keep: int = 3  # newest checkpoints kept
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir
    auto_resume: bool = False  # resume if checkpoint_dir holds a complete checkpoint, else start fresh (restarts)
    rebalance: RebalanceConfig | None = None  # online data rebalancing (runtime/rebalance.py)
    watchdog_s: float | None = None  # end a rank without progress for this long; None: 2 x timeout_s + 60; 0: off
    log_sample_ids: bool = False  # metrics lines list the global sample ids of each step

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.warmup_steps < 0:
            raise UserError("--weight-decay, --clip-grad and --warmup-steps must not be negative")
        if self.dtype not in (None, "fp32", "bf16", "fp16", "fp64"):
            raise UserError(f"--dtype must be fp32, bf16, fp16 or fp64, got {self.dtype!r}")
        check_emulate_mode(self.emulate_mode)
        if self.lr_schedule not in ("constant", "cosine"):
            raise UserError(f"--lr-schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.save_every < 0 or self.keep < 1:
            raise UserError(f"--save-every must be >= 0 and --keep >= 1, got {self.save_every} and {self.keep}")
        if (self.save_every or self.resume or self.auto_resume) and self.checkpoint_dir is None:
            raise UserError("--save-every, --resume and --auto-resume need --checkpoint-dir DIR")
        if self.resume and self.auto_resume:
            raise UserError("give --resume (a checkpoint must exist) or --auto-resume (resume if one exists), not both")
        if self.watchdog_s is not None and self.watchdog_s < 0:
            raise UserError(f"--watchdog-s must be >= 0 (0 = off), got {self.watchdog_s}")
        if self.resume and self.init_from is not None:
            raise UserError("give --init-from or --resume, not both: a resumed run takes its weights from the "
                            "checkpoint")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def watchdog_limit_s(self) -> float:
        """Longer than any collective may wait, so a timeout reports first when it can."""
        return 2 * self.timeout_s + 60 if self.watchdog_s is None else self.watchdog_s


def lr_at(config: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then constant or cosine down to ``lr * min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    span = max(1, config.steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    low = config.lr * config.min_lr_ratio
    return low + 0.5 * (config.lr - low) * (1 + math.cos(math.pi * progress))


def make_optimizer(module: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with nanoGPT's grouping: weight decay on matrices/embeddings, not on norms/biases."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=ADAM_BETAS, eps=ADAM_EPS)


def check_plan_runnable(plan: Plan, world_size: int) -> ModelSpec:
    """Plan-level checks that need no processes (also run by the launcher before spawning)."""
    if world_size != plan.world_size:
        raise UserError(
            f"the plan needs {plan.world_size} ranks but the world has {world_size}: "
            f"launch with --nproc-per-node {plan.world_size} (or run `ethpipe train` without torchrun)"
        )
    spec = plan.resolve_model()
    check_one_world(plan_gpus(plan), "the plan")
    check_tp(plan.pipelines, spec)
    if plan.seq_len > spec.max_seq_len:
        raise UserError(f"plan seq_len {plan.seq_len} exceeds model '{spec.name}' max_seq_len {spec.max_seq_len}")
    return spec


def check_inputs(plan: Plan, config: TrainConfig, world_size: int) -> tuple[ModelSpec, TokenFile, ResumePoint]:
    """Every user-input check, before any process group exists; also where training starts."""
    spec = check_plan_runnable(plan, world_size)
    check_train_dtype(plan, config.dtype)
    if config.dtype is not None:
        check_dtype_fits(plan, config.dtype)
    data = open_tokens(config.data, spec.vocab_size)
    start = ResumePoint()
    resume = config.resume or (config.auto_resume and bool(complete_checkpoints(config.checkpoint_dir or "")))
    if resume:
        assert config.checkpoint_dir is not None
        start = find_resume(config.checkpoint_dir, spec, plan.seq_len, config.shuffle, config.seed,
                            data.num_samples(plan.seq_len))
        if start.step > config.steps or (start.step == config.steps and not config.auto_resume):
            raise UserError(f"the checkpoint is at step {start.step} and --steps is {config.steps}: nothing to "
                            "train; raise --steps")
    elif config.checkpoint_dir is not None:
        check_fresh_dir(config.checkpoint_dir)
    if start.step == 0:
        validate_data(data, plan.seq_len, plan.global_batch_size, config.steps, config.shuffle, spec.vocab_size)
    else:
        _validate_resumed_data(data, plan, config, start)
    if config.init_from is not None and start.step_dir is None:
        check_checkpoint(config.init_from, spec)
    if config.emulate:
        check_emulation(plan)
    for s in config.slowdowns:
        if not 0 <= s.rank < plan.world_size:
            raise UserError(f"slowdown rank {s.rank} is not in the plan (world size {plan.world_size})")
    return spec, data, start


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


def _micro_batches(plan: Plan, data: TokenFile, ids: np.ndarray, pipeline: int,
                   device: torch.device) -> list[torch.Tensor]:
    """This pipeline's micro-batches of the step's global sample ids, under ``plan``'s split."""
    out = []
    for lo, hi in plan.microbatch_slices(pipeline):
        out.append(torch.from_numpy(gather_samples(data, ids[lo:hi], plan.seq_len)).to(device))
    return out


def train(plan: Plan, config: TrainConfig, rank: int, world_size: int, device: torch.device | None = None,
          init_method: str = "env://", store: dist.Store | None = None) -> list[dict[str, Any]]:
    """Train on this rank; returns the per-step metric records on rank 0 ([] elsewhere).

    Initialises the default process group if none exists (and tears it down afterwards);
    otherwise reuses it and only creates (and destroys) the plan's own groups.
    """
    spec, data, start = check_inputs(plan, config, world_size)
    device = device if device is not None else torch.device("cpu")
    owns_world = not dist.is_initialized()
    if owns_world:
        backend = dist.get_default_backend_for_device(device)
        # device_id binds the world to this rank's GPU: NCCL communicators are then created eagerly (new_group
        # splits them at creation) instead of at their first use, which for batched p2p involves the whole group.
        dist.init_process_group(backend, init_method=None if store is not None else init_method, store=store,
                                rank=rank, world_size=world_size, timeout=config.timeout,
                                device_id=device if device.type != "cpu" else None)
    control: dist.ProcessGroup | None = None
    try:
        _check_same_plan(plan, device)
        control = control_group(config.timeout)
        if not config.emulate:  # emulated device types run on CPUs
            gather_and_check(plan, device, control)
        if rank == 0:
            print(start_banner(plan, config, start, device), flush=True)
        with Watchdog(rank, config.watchdog_limit_s) as watchdog:
            return _train_on_world(plan, config, spec, data, start, rank, device, watchdog, control)
    finally:
        if control is not None:
            dist.destroy_process_group(control)
        if owns_world:
            dist.destroy_process_group()


def start_banner(plan: Plan, config: TrainConfig, start: ResumePoint, device: torch.device) -> str:
    """One line saying what runs: the world, the precision and why, the steps."""
    dtype, planned = train_dtype(plan, config.dtype), plan.extra.get("dtype")
    if config.dtype is None:
        why = "the plan's" if planned else "the plan records none"
    else:
        why = f"--dtype; the plan was made for {planned}" if planned and planned != config.dtype else "--dtype"
    steps = f"steps {start.step}..{config.steps}" if start.step else f"{config.steps} steps"
    return (f"ethpipe train: {plan.world_size} ranks on {device.type}, {len(plan.pipelines)} pipelines, "
            f"{dtype} ({why}), {steps}")


def _check_same_plan(plan: Plan, device: torch.device) -> None:
    """Every rank must run the same plan (each may have re-planned on its own, e.g. after a restart)."""
    d = plan.to_dict()  # what execution depends on (not e.g. the planner's timing of itself)
    key = json.dumps([d[k] for k in ("model", "global_batch_size", "seq_len", "pipelines", "blocks")] +
                     [plan.extra.get("device_speeds")], sort_keys=True)
    local = torch.tensor([zlib.crc32(key.encode())], dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    if len({int(p) for p in parts}) > 1:
        raise UserError("the ranks were given different plans: give every rank the same --plan (or the same "
                        "--replan-cluster, so they all plan alike)")


def _train_on_world(plan: Plan, config: TrainConfig, spec: ModelSpec, data: TokenFile, start: ResumePoint,
                    rank: int, device: torch.device, watchdog: Watchdog,
                    control: dist.ProcessGroup | None) -> list[dict[str, Any]]:
    tied = spec.tie_embeddings
    groups = build_groups(plan, rank, config.timeout, tied, device)
    pos = groups.position
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    first, last = pos.stage == 0, pos.stage == pipe.depth - 1
    dtype = train_dtype(plan, config.dtype)
    param_dtype = PARAM_DTYPES[dtype]
    tp = TPGroup(groups.tp_group, pos.tp_rank, stage.tp) if stage.tp > 1 else None
    module = build_stage(spec, stage.layers, first, last, seed=config.seed, device=device,
                         recompute=config.recompute or stage.recompute, dtype=param_dtype, tp=tp)
    if config.init_from is not None and start.step_dir is None:
        load_into(module, config.init_from)
    optimizer = make_optimizer(module, config)
    if start.step_dir is not None:
        watchdog.beat(f"loading checkpoint {start.step_dir}")
        load_checkpoint(start, module, optimizer, device, group=control)
    blocks, units = stage_sync_units(plan, rank, module, state_dict_shapes(spec), tied)
    params = dict(module.named_parameters())
    tied_copy = tied_parameters(module, tied)
    sync = BlockGradSync(params, units, groups.block_groups, config.bucket_bytes)
    emulator: Emulator | None = (make_emulator(plan, rank, config.slowdowns, mode=config.emulate_mode)
                                 if config.emulate else None)
    autocast_dtype = AUTOCAST_DTYPES.get(dtype)
    io = StageIO(groups.pipeline_group, groups.peers, first, last, spec.hidden_size, plan.seq_len,
                 act_dtype=autocast_dtype or param_dtype, param_dtype=param_dtype, count_loss=pos.tp_rank == 0)
    loss_scale = 1.0 / (plan.global_batch_size * plan.seq_len)
    scaler = _initial_scaler(start) if dtype == "fp16" else None
    timeline = Timeline(record=config.trace is not None)
    writer = (MetricsWriter(config.metrics, config.steps - start.step, config.progress, append=start.step > 0)
              if rank == 0 else None)
    num_samples = data.num_samples(plan.seq_len)
    rebalancer = Rebalancer(plan, config.rebalance) if config.rebalance is not None else None
    current = plan  # the split running now: the plan's, until a rebalance changes it (same stages and groups)
    kill = kill_spec()
    forward_kill = ForwardKill.arm(module, kill, rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        for step in range(start.step, config.steps):
            watchdog.beat(f"step {step}")
            maybe_hang(rank, step)
            cur_pipe = current.pipelines[pos.pipeline]
            first_sample = start.next_sample + (step - start.step) * plan.global_batch_size
            step_start = time.time()
            lr = lr_at(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            ids = sample_ids(first_sample, plan.global_batch_size, num_samples, config.shuffle, config.seed)
            batch = _micro_batches(current, data, ids, pos.pipeline, device) if first or last else []
            inputs = [b[:, :-1].contiguous() for b in batch] if first else None
            targets = [b[:, 1:].contiguous() for b in batch] if last else None
            timeline.busy_s = timeline.phase_s = 0.0
            actions = one_f_one_b(cur_pipe.depth, pos.stage, cur_pipe.num_microbatches)
            if forward_kill is not None:
                forward_kill.begin_step(step, cur_pipe.num_microbatches)

            def start_sync(step: int = step) -> None:
                sync.start()
                maybe_kill(kill, rank, "allreduce", step)  # test hook: peers are inside the all-reduces

            scale = scaler.scale if scaler is not None else 1.0
            loss = run_stage_step(module, actions, cur_pipe.micro_batch_sizes, inputs, targets, io,
                                  loss_scale * scale, emulator, step, timeline, autocast_dtype,
                                  on_last_backward=start_sync)
            sync_start = time.time()
            sync.finish(lambda label: timeline.add(f"allreduce {label}", sync.started_s, time.time()))
            sync_exposed_s = time.time() - sync_start
            maybe_overflow(module, rank, step)
            nonfinite = count_nonfinite(module) if scaler is not None else 0
            if scaler is not None:
                unscale_gradients(module, scale)
            stats = gather_stats(plan, {
                "loss_part": float(loss) / scale, "square_norm_part": owned_square_norm(plan, rank, params, blocks, tied_copy),
                "busy_s": timeline.busy_s, "idle_s": max(0.0, timeline.phase_s - timeline.busy_s),
                "sync_exposed_s": sync_exposed_s, "nonfinite_part": nonfinite,
            }, device)
            skipped = scaler is not None and stats.num_nonfinite > 0  # the same world-wide count on every rank
            if not skipped:
                if config.clip_grad > 0:
                    scale_gradients(module, clip_coefficient(stats.grad_norm, config.clip_grad))
                opt_start = time.time()
                optimizer.step()
                timeline.add("optimizer", opt_start, time.time())
            extra: dict[str, Any] = {"samples": [first_sample, first_sample + plan.global_batch_size],
                                     "split": list(split_of(current)), "restart": restart}
            if scaler is not None:
                extra.update({"loss_scale": scale, "skipped": skipped, **({"grad_norm": None} if skipped else {})})
                scaler = scaler.after_step(finite=not skipped)
            if config.log_sample_ids:
                extra["sample_ids"] = [int(i) for i in ids]
            if rebalancer is not None:
                decision = rebalancer.observe(step, stats.rank_busy_s)  # same numbers on every rank
                if decision is not None:
                    extra["rebalance"] = decision.to_record()
                current = rebalancer.plan  # applies from the next step on
            if writer is not None:
                tokens = plan.global_batch_size * plan.seq_len
                writer.write(step_record(step, stats, time.time() - step_start, tokens, lr, extra))
            done = step + 1
            if config.checkpoint_dir is not None and (done == config.steps or
                                                      (config.save_every and done % config.save_every == 0)):
                save_start = time.time()
                watchdog.beat(f"checkpoint save of step {done}")
                cursor = DataCursor(first_sample + plan.global_batch_size, config.shuffle, config.seed, num_samples)
                save_checkpoint(config.checkpoint_dir, done, module, optimizer, current, spec, cursor, config.keep,
                                device, extra={"loss_scaler": scaler.to_dict()} if scaler is not None else None,
                                group=control)
                timeline.add("checkpoint", save_start, time.time())
        watchdog.beat("final save")
        if config.save_final is not None:
            state = gather_consolidated(module, plan, rank, spec, control)
            if state is not None:
                save_atomic(state, config.save_final)
        if config.trace is not None:
            _write_trace(plan, config.trace, timeline, rank, control)
        return writer.records if writer is not None else []
    finally:
        if writer is not None:
            writer.close()
        destroy_groups(groups)


def _initial_scaler(start: ResumePoint) -> LossScaler:
    """A fresh fp16 loss scaler, or the one the checkpoint we resume from saved."""
    saved = start.manifest.extra.get("loss_scaler") if start.manifest is not None else None
    return LossScaler.from_dict(saved) if saved else LossScaler()


def _write_trace(plan: Plan, path: str, timeline: Timeline, rank: int, group: dist.ProcessGroup | None) -> None:
    gathered: list[Any] | None = [None] * plan.world_size if rank == 0 else None
    dist.gather_object(timeline.events, gathered, dst=0, group=group)
    if gathered is not None:
        labels = []
        for r in range(plan.world_size):
            p = plan.position_of(r)
            device = plan.pipelines[p.pipeline].stages[p.stage].device
            labels.append(f"rank {r} (pipeline {p.pipeline} stage {p.stage}, {device})")
        write_chrome_trace(path, gathered, labels)
