"""What ``ethpipe train`` takes besides the plan: the run's settings, its learning-rate schedule and optimizer."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

from ethpipe.errors import UserError
from ethpipe.runtime.adapt.emulate import EmulateMode, Slowdown, check_emulate_mode
from ethpipe.comm.program import DEFAULT_BUCKET_BYTES
from ethpipe.runtime.adapt.rebalance import RebalanceConfig

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
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
    lr_schedule: Literal["constant", "cosine", "linear", "wsd"] = "constant"
    min_lr_ratio: float = 0.1  # cosine / linear / wsd decay to lr * min_lr_ratio at the last step
    decay_fraction: float = 0.2  # wsd: the share of the steps after warm-up spent decaying (the last ones)
    adam_betas: tuple[float, float] = ADAM_BETAS
    adam_eps: float = ADAM_EPS
    trace: str | None = None
    slowdowns: tuple[Slowdown, ...] = ()  # emulated stragglers (seam for --emulate-slowdown)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # gradient-sync buckets (runtime/sync/buckets.py); 0: one per unit
    overlap_grad_sync: bool = True  # fire each bucket from backward hooks during the last backward
    compile: bool = False  # torch.compile each decoder block (runtime/model.compile_blocks)
    fp32_residual: bool = False  # 16-bit runs: keep the residual stream in fp32 (default: the compute dtype)
    # Set on rank 0 once its TensorBoard sink is open: the run's folder under --tensorboard, which its checkpoints
    # record so that a resume logs into the same TensorBoard run (observe/sinks.tensorboard_run_dir).
    tensorboard_run: str | None = None
    # packed: sample i is tokens [i*s, i*s + s] of the stream (nanoGPT); documents: samples inside one document
    # each, padded, the loss the mean over the counted targets (runtime/data.DocumentSamples)
    samples: Literal["packed", "documents"] = "packed"
    val_data: str | None = None  # held-out tokens (``data prepare --val-fraction``) for the validation loss
    eval_every: int = 0  # the validation loss every N steps and after the last (0: never)
    eval_batches: int = 4  # global batches of val_data per evaluation (the same ones every time)
    timeout_s: float = 300.0  # every collective and p2p fails after this instead of hanging
    # Start-up (groups, building and loading stages) ends in a CPU barrier that waits this long for the slowest
    # rank (a 1-layer V100 stage is ready minutes before a 12-layer H100 one), not the collective timeout.
    start_timeout_s: float = 1800.0
    progress: bool = True  # rich progress bar on rank 0
    device: Literal["auto", "cpu"] = "auto"
    checkpoint_dir: str | None = None  # training checkpoints (torch.distributed.checkpoint), see docs/checkpoints.md
    save_every: int = 0  # save every K steps (0: only after the last step); needs checkpoint_dir
    keep: int = 3  # newest checkpoints kept
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir
    strict_resume: bool = False  # refuse a resume that changes a recorded setting (runtime/start/run_settings.py)
    auto_resume: bool = False  # resume if checkpoint_dir holds a complete checkpoint, else start fresh (restarts)
    rebalance: RebalanceConfig | None = None  # online data rebalancing (runtime/adapt/rebalance.py)
    watchdog_s: float | None = None  # end a rank without progress for this long; None: 2 x timeout_s + 60; 0: off
    log_sample_ids: bool = False  # metrics lines list the global sample ids of each step
    log_every: int = 0  # a console line every N steps (0: every 10 s when not a terminal, else the bar only)
    tensorboard: str | None = None  # TensorBoard event files here (runtime/observe/sinks.py)
    wandb: str | None = None  # Weights & Biases project (offline unless WANDB_MODE says otherwise)
    run_config: str | None = None  # the command's options as a --config file: written next to the checkpoints

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1, got {self.steps}")
        if self.samples not in ("packed", "documents"):
            raise UserError(f"--samples must be packed or documents, got {self.samples!r}")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise UserError(f"--eval-every must be >= 0 and --eval-batches >= 1, got {self.eval_every} and "
                            f"{self.eval_batches}")
        if self.eval_every and self.val_data is None:
            raise UserError("--eval-every needs --val-data FILE (held-out tokens: `ethpipe data prepare "
                            "--val-fraction 0.01` writes one beside the training file)")
        if self.lr <= 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.warmup_steps < 0:
            raise UserError("--weight-decay, --clip-grad and --warmup-steps must not be negative")
        if self.dtype not in (None, "fp32", "bf16", "fp16", "fp64"):
            raise UserError(f"--dtype must be fp32, bf16, fp16 or fp64, got {self.dtype!r}")
        check_emulate_mode(self.emulate_mode)
        if self.lr_schedule not in LR_SCHEDULES:
            raise UserError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0 or not 0.0 < self.decay_fraction <= 1.0:
            raise UserError(f"--min-lr-ratio must be in [0, 1] and --decay-fraction in (0, 1], got {self.min_lr_ratio} "
                            f"and {self.decay_fraction}")
        if not all(0.0 <= b < 1.0 for b in self.adam_betas) or not self.adam_eps > 0:
            raise UserError(f"--adam-beta1/--adam-beta2 must be in [0, 1) and --adam-eps positive, got "
                            f"{self.adam_betas} and {self.adam_eps}")
        if self.bucket_bytes < 0:
            raise UserError(f"--bucket-mib must be >= 0 (0: one all-reduce per block), got {self.bucket_bytes / 2**20}")
        if self.save_every < 0 or self.keep < 1:
            raise UserError(f"--save-every must be >= 0 and --keep >= 1, got {self.save_every} and {self.keep}")
        if (self.save_every or self.resume or self.auto_resume) and self.checkpoint_dir is None:
            raise UserError("--save-every, --resume and --auto-resume need --checkpoint-dir DIR")
        if self.resume and self.auto_resume:
            raise UserError("give --resume (a checkpoint must exist) or --auto-resume (resume if one exists), not both")
        if self.log_every < 0:
            raise UserError(f"--log-every must be >= 0 (0: every 10 s when the output is not a terminal), got "
                            f"{self.log_every}")
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
    """Linear warm-up to ``lr``, then constant, cosine or linear down to ``lr * min_lr_ratio`` at the last step,
    or warmup-stable-decay (``wsd``: ``lr`` until the last ``decay_fraction`` of the steps after warm-up, then
    linearly down to ``lr * min_lr_ratio``, as MiniCPM and torchtitan's WSD)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    low = config.lr * config.min_lr_ratio
    after = config.steps - config.warmup_steps  # steps from the end of warm-up on
    if config.lr_schedule == "wsd":
        decay = max(1, round(after * config.decay_fraction))
        into = step - (config.steps - decay)  # 0 at the first decaying step
        if into < 0:
            return config.lr
        return config.lr - (config.lr - low) * min(1.0, (into + 1) / decay)
    span = max(1, after - 1)
    progress = min(1.0, (step - config.warmup_steps) / span)
    if config.lr_schedule == "linear":
        return config.lr - (config.lr - low) * progress
    return low + 0.5 * (config.lr - low) * (1 + math.cos(math.pi * progress))


def make_optimizer(module: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with nanoGPT's grouping: weight decay on matrices/embeddings, not on norms/biases; the fused
    kernel on CUDA (one launch for the whole stage; its ``step`` lives on the device)."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = next(module.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.adam_betas, eps=config.adam_eps, fused=fused or None)


# Environment variables that make a GPU run all of a rank's NCCL communicators in one queue (one hardware
# connection, or kernels launched in the host's issue order): Megatron environments set the first.
ONE_QUEUE_VARIABLES = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_LAUNCH_ORDER_IMPLICIT": "1"}


def one_queue_variable(environ: Mapping[str, str]) -> str | None:
    """The variable (``NAME=value``) that serialises this rank's communicators, if one is set."""
    return next((f"{k}={v}" for k, v in ONE_QUEUE_VARIABLES.items() if environ.get(k, "").strip() == v), None)


def overlap_is_safe(tied: bool, one_queue: bool) -> bool:
    """Whether the block sync may start inside the last backward. Under one queue per GPU, a last stage's
    tied-matrix all-reduce posted before its last send waits for the first stage, which waits for that send
    (``ethpipe.comm.replay`` shows it for 1F1B; tests/unit/test_comm_replay.py): the sync then starts after the
    sends. Untied models, or communicators that run side by side, overlap as asked."""
    return not (tied and one_queue)
