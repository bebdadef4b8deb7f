"""One rank's run of steps on one plan: build the stage once, then tell each step's story in phases.

``run_plan`` builds what a rank needs for a plan (``build_stage_run``: its groups, its stage, the optimizer
that syncs and updates it, its I/O) and steps it. A step (``train_step``) is, in order:

1. ``begin_step``: the learning rate, the last step's parameter all-gather waited, gradients zeroed, this
   pipeline's micro-batches of the global batch and the stage's schedule;
2. ``forward_backward``: the schedule runs, and the block sync fires behind the last backward;
3. ``finish_sync``: the block all-reduces waited;
4. ``gather_step_stats``: the step's one collective and read (loss, gradient norm, non-finite flag, timings);
5. ``optimizer_step``: clipped AdamW, unless fp16 loss scaling skips the step;
6. ``step_extra``: what the record says beyond the stats, and the loss scaler and rebalancer moved on.

Between steps the loop records the step, asks a replanner when one is due and saves checkpoints; after the
last, ``finish_run`` writes the consolidated model and the trace.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan, layout_key
from ethpipe.precision import train_dtype
from ethpipe.runtime.pipeline.validation import eval_due, open_validation, validation_loss
from ethpipe.runtime.observe.sinks import TENSORBOARD_RUN
from ethpipe.runtime.adapt.emulate import Emulator, make_emulator
from ethpipe.runtime.adapt.fault_hooks import ForwardKill, kill_spec, maybe_hang, maybe_kill, maybe_overflow
from ethpipe.runtime.adapt.rebalance import Rebalancer, split_of
from ethpipe.runtime.adapt.replan_step import Outcome, Replanner, decide_replan, replan_due
from ethpipe.runtime.checkpoint.consolidated import load_into, save_consolidated
from ethpipe.runtime.checkpoint.layout import DataCursor, ResumePoint
from ethpipe.runtime.checkpoint.state import load_checkpoint, save_checkpoint
from ethpipe.runtime.config import AUTOCAST_DTYPES, TrainConfig, lr_at, one_queue_variable, overlap_is_safe
from ethpipe.runtime.data import TokenFile, micro_batches, model_inputs, sample_ids
from ethpipe.runtime.groups import RankGroups, build_groups, destroy_groups
from ethpipe.runtime.model.decoder import PARAM_DTYPES, build_stage, compile_blocks, state_dict_shapes
from ethpipe.runtime.model.tensor_parallel import TPGroup
from ethpipe.runtime.observe.metrics import (MetricsWriter, StepStats, device_used_bytes, gather_stats,
                                             peak_memory_bytes, step_record, write_trace)
from ethpipe.runtime.observe.sinks import metrics_writer
from ethpipe.runtime.observe.timeline import Timeline
from ethpipe.runtime.pipeline.executor import StageIO, run_stage_step
from ethpipe.runtime.start.preflight import wait_for_every_rank
from ethpipe.runtime.start.run_settings import run_settings, write_run_config
from ethpipe.runtime.start.watchdog import Watchdog
from ethpipe.runtime.sync.buckets import GradBuckets
from ethpipe.runtime.sync.grads import clip_coefficient
from ethpipe.runtime.sync.loss_scale import LossScaler
from ethpipe.runtime.sync.stage_optim import StageOptimizer, build_stage_optimizer
from ethpipe.schedule import Action, actions_of


@dataclass
class StageRun:
    """Everything one rank keeps while it steps one plan. ``current`` is the split running now (the plan's,
    until a rebalance changes it: same stages and groups); ``scaler`` the fp16 loss scaler (None otherwise)."""

    plan: Plan
    config: TrainConfig
    spec: ModelSpec
    data: TokenFile
    start: ResumePoint
    rank: int
    device: torch.device
    groups: RankGroups
    module: torch.nn.Module
    stage_opt: StageOptimizer
    io: StageIO
    timeline: Timeline
    sync: _SyncSteps
    emulator: Emulator | None
    writer: MetricsWriter | None
    rebalancer: Rebalancer | None
    forward_kill: ForwardKill | None
    dtype: str
    autocast_dtype: torch.dtype | None
    num_samples: int
    restart: int
    current: Plan
    scaler: LossScaler | None
    overlap: bool  # the block sync starts inside the last backward (``config.overlap_is_safe``)

    @property
    def first(self) -> bool:
        return self.groups.position.stage == 0

    @property
    def last(self) -> bool:
        return self.groups.position.stage == self.plan.pipelines[self.groups.position.pipeline].depth - 1

    def first_sample(self, step: int) -> int:
        return self.start.next_sample + (step - self.start.step) * self.plan.global_batch_size

    def records(self) -> list[dict[str, Any]]:
        return self.writer.records if self.writer is not None else []


@dataclass(frozen=True)
class StepInputs:
    """What ``begin_step`` prepared: the step's global sample ids, this stage's micro-batches and schedule."""

    ids: np.ndarray
    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    actions: tuple[Action, ...]
    # 1 / the step's counted targets (the global batch's: the same on every rank): every pipeline's loss is a share
    # of the global mean
    loss_scale: float


def run_plan(plan: Plan, config: TrainConfig, spec: ModelSpec, data: TokenFile, start: ResumePoint, rank: int,
             device: torch.device, watchdog: Watchdog, control: dist.ProcessGroup | None,
             replanner: Replanner | None = None, sinks: list[Any] | None = None) -> Outcome:
    """Step ``plan`` from ``start`` to the last step, or to the step where ``replanner`` switches plans."""
    run = build_stage_run(plan, config, spec, data, start, rank, device, watchdog, control, sinks or [])
    val = (open_validation(config.val_data, plan, config.eval_batches, spec.vocab_size, config.samples == "documents")
           if config.eval_every and config.val_data is not None else None)
    try:
        wait_for_every_rank(config.start_timeout_s, watchdog, control)
        for step in range(start.step, config.steps):
            watchdog.beat(f"step {step}")
            maybe_hang(rank, step)
            record = train_step(run, step)
            if val is not None and eval_due(step, config.eval_every, config.steps):
                watchdog.beat(f"validation after step {step + 1}")
                run.stage_opt.wait_params()  # sharded: every holder's updated shard is here before the forwards
                pos = run.groups.position
                record["val_loss"] = validation_loss(run.module, run.current, pos.pipeline, pos.stage, run.io, val,
                                                     config.eval_batches, run.device, run.autocast_dtype)
            switch_to = None
            if replan_due(replanner, step, start) and step + 1 < config.steps and config.checkpoint_dir is not None:
                watchdog.beat("re-planning")
                so_far = [*run.records(), record]  # rank 0's; the others' unused
                switch_to, record["replan"] = decide_replan(replanner, run.current, so_far, rank, control)
                if rank == 0:
                    print(record["replan"]["line"], flush=True)
            if run.writer is not None:
                run.writer.write(record)
            done = step + 1
            if config.checkpoint_dir is not None and (done == config.steps or switch_to is not None or
                                                      (config.save_every and done % config.save_every == 0)):
                save_step(run, done, watchdog, control)
            if switch_to is not None:
                run.stage_opt.wait_params()
                return Outcome(run.records(), switch_to, done)
        finish_run(run, watchdog, control)
        return Outcome(run.records())
    finally:
        run.stage_opt.buckets.remove_hooks()
        if run.writer is not None:
            run.writer.close()
        destroy_groups(run.groups)


def build_stage_run(plan: Plan, config: TrainConfig, spec: ModelSpec, data: TokenFile, start: ResumePoint,
                    rank: int, device: torch.device, watchdog: Watchdog, control: dist.ProcessGroup | None,
                    sinks: list[Any]) -> StageRun:
    """This rank's groups, stage (initialised, loaded or resumed), optimizer, I/O, timeline and reporters."""
    tied = spec.tie_embeddings
    watchdog.beat("creating process groups")
    groups = build_groups(plan, rank, config.timeout, tied, device)
    pos = groups.position
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    first, last = pos.stage == 0, pos.stage == pipe.depth - 1
    dtype = train_dtype(plan, config.dtype)
    param_dtype = PARAM_DTYPES[dtype]
    tp = TPGroup(groups.tp_group, pos.tp_rank, stage.tp) if stage.tp > 1 else None
    watchdog.beat("building the stage")
    # A resume or --init-from (a state file or a Hugging Face directory: every name checked present before any
    # rank starts) overwrites every parameter: nothing to draw.
    loaded = start.step_dir is not None or config.init_from is not None
    module = build_stage(spec, stage.layers, first, last, seed=config.seed, device=device,
                         recompute=config.recompute or stage.recompute, dtype=param_dtype, tp=tp,
                         chunks=stage.chunks, init=not loaded, fp32_residual=config.fp32_residual,
                         sublayers=stage.sublayers)
    if config.init_from is not None and start.step_dir is None:
        watchdog.beat(f"loading --init-from {config.init_from}")
        load_into(module, config.init_from)
    if config.compile:
        compile_blocks(module)
    states = None
    if start.step_dir is not None:
        watchdog.beat(f"loading checkpoint {start.step_dir}")
        # a sharded optimizer keeps only its pieces of the full states: they load on the CPU first
        states = load_checkpoint(start, module, None, device, group=control,
                                 state_device=torch.device("cpu") if plan.shard_optimizer else None)
    watchdog.beat("building the optimizer")
    stage_opt = build_stage_optimizer(plan, config, rank, module, state_dict_shapes(spec), tied, groups, device,
                                      states)
    del states
    emulator = make_emulator(plan, rank, config.slowdowns, mode=config.emulate_mode) if config.emulate else None
    autocast_dtype = AUTOCAST_DTYPES.get(dtype)
    io = StageIO(groups.pipeline_group, groups.peers, first, last, spec.hidden_size, plan.seq_len,
                 act_dtype=autocast_dtype or param_dtype, param_dtype=param_dtype, count_loss=pos.tp_rank == 0)
    timeline = Timeline(device, synchronous=device.type == "cpu" or emulator is not None,
                        record=config.trace is not None)
    kill = kill_spec()
    one_queue = one_queue_variable(os.environ)
    if config.overlap_grad_sync and rank == 0 and not overlap_is_safe(tied, device.type == "cuda" and bool(one_queue)):
        print(f"ethpipe train: {one_queue} runs each GPU's communicators in one queue, where the tied embedding's "
              "all-reduce inside the last backward deadlocks: the gradient sync starts after the last sends",
              flush=True)
    return StageRun(
        plan=plan, config=config, spec=spec, data=data, start=start, rank=rank, device=device, groups=groups,
        module=module, stage_opt=stage_opt, io=io, timeline=timeline,
        sync=_SyncSteps(stage_opt.buckets, timeline, kill, rank), emulator=emulator,
        writer=metrics_writer(plan, config, start, device, sinks) if rank == 0 else None,
        rebalancer=Rebalancer(plan, config.rebalance) if config.rebalance is not None else None,
        forward_kill=ForwardKill.arm(module, kill, rank), dtype=dtype, autocast_dtype=autocast_dtype,
        num_samples=data.num_samples(plan.seq_len),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), current=plan,
        scaler=_initial_scaler(start) if dtype == "fp16" else None,
        overlap=config.overlap_grad_sync and overlap_is_safe(tied, device.type == "cuda" and one_queue is not None))


def train_step(run: StageRun, step: int) -> dict[str, Any]:
    """One training step on this rank, in its phases; returns the step's metric record."""
    step_start = time.time()
    lr = lr_at(run.config, step)
    batch = begin_step(run, step, lr)
    scale = run.scaler.scale if run.scaler is not None else 1.0
    loss = forward_backward(run, step, batch, scale)
    finish_sync(run, step)
    stats = gather_step_stats(run, loss, scale)
    skipped = run.scaler is not None and stats.num_nonfinite > 0  # the same world-wide count on every rank
    if not skipped:
        optimizer_step(run, stats, scale)
    extra = step_extra(run, step, batch, stats, scale, skipped)
    return step_record(step, stats, time.time() - step_start, run.plan.global_batch_size * run.plan.seq_len, lr,
                       extra)


def begin_step(run: StageRun, step: int, lr: float) -> StepInputs:
    """Set the learning rate, wait the last step's parameter all-gather (sharded; a stream wait on GPUs), zero
    the gradients, and cut this pipeline's micro-batches out of the step's global batch."""
    run.stage_opt.set_lr(lr)
    run.stage_opt.wait_params()
    run.stage_opt.buckets.zero_grads()
    config, pos = run.config, run.groups.position
    cur_pipe = run.current.pipelines[pos.pipeline]
    ids = sample_ids(run.first_sample(step), run.plan.global_batch_size, run.num_samples, config.shuffle,
                     config.seed)
    batch = micro_batches(run.current, run.data, ids, pos.pipeline, run.device) if run.first or run.last else []
    return StepInputs(ids=ids,
                      inputs=[model_inputs(b) for b in batch] if run.first else None,
                      targets=[b[:, 1:].contiguous() for b in batch] if run.last else None,
                      loss_scale=1.0 / run.data.counted_tokens(ids, run.plan.seq_len),
                      actions=actions_of(cur_pipe, pos.stage, split=not (config.recompute or config.compile)))


def forward_backward(run: StageRun, step: int, batch: StepInputs, scale: float) -> torch.Tensor:
    """Run the stage's schedule; the block sync is armed before the last backward (with ``overlap_grad_sync``)
    and the rest fired after its sends. Returns this rank's share of the (scaled) loss."""
    cur_pipe = run.current.pipelines[run.groups.position.pipeline]
    if run.forward_kill is not None:
        run.forward_kill.begin_step(step, cur_pipe.num_microbatches)
    run.timeline.start_step()
    run.sync.step, run.sync.start = step, None
    return run_stage_step(run.module, batch.actions, cur_pipe.micro_batch_sizes, batch.inputs, batch.targets,
                          run.io, batch.loss_scale * scale, run.emulator, step, run.timeline, run.autocast_dtype,
                          on_last_backward=run.sync.fire_rest,
                          before_last_backward=run.sync.arm if run.overlap else None)


def finish_sync(run: StageRun, step: int) -> None:
    """Wait this stage's block all-reduces (the gradients are then the global batch's)."""
    run.stage_opt.buckets.wait(run.sync.traced)
    run.timeline.sync_done()
    maybe_overflow(run.stage_opt.grads, run.rank, step)


def gather_step_stats(run: StageRun, loss: torch.Tensor, scale: float) -> StepStats:
    """The step's one collective and read: the global loss, the gradient norm (of the unscaled gradients) and
    every rank's timings, on the world's device group (no host-side group in a step)."""
    on_device = torch.cat([(loss.double() / scale).reshape(1), run.stage_opt.norm_parts()])
    stats = gather_stats(run.plan, on_device, lambda: _timings(run.timeline), run.device)
    return dataclasses.replace(stats, grad_norm=stats.grad_norm / scale)


def optimizer_step(run: StageRun, stats: StepStats, scale: float) -> None:
    """Clip by the global norm (every block counted once) and unscale in one multiply, then AdamW."""
    clip = clip_coefficient(stats.grad_norm, run.config.clip_grad) if run.config.clip_grad > 0 else 1.0
    opt_start = time.time()
    run.stage_opt.step(clip / scale)
    run.timeline.add("optimizer", opt_start, time.time())


def step_extra(run: StageRun, step: int, batch: StepInputs, stats: StepStats, scale: float,
               skipped: bool) -> dict[str, Any]:
    """The record's fields beyond the stats; moves the loss scaler and the rebalancer on (the next step's
    split is the rebalancer's)."""
    first_sample = run.first_sample(step)
    extra: dict[str, Any] = {"samples": [first_sample, first_sample + run.plan.global_batch_size],
                             "split": list(split_of(run.current)), "restart": run.restart,
                             "layout": layout_key(run.plan),
                             "micro_batch_sizes": [list(p.micro_batch_sizes) for p in run.current.pipelines]}
    if run.scaler is not None:
        extra.update({"loss_scale": scale, "skipped": skipped, **({"grad_norm": None} if skipped else {})})
        run.scaler = run.scaler.after_step(finite=not skipped)
    if run.config.log_sample_ids:
        extra["sample_ids"] = [int(i) for i in batch.ids]
    if run.rebalancer is not None:
        decision = run.rebalancer.observe(step, stats.rank_busy_s)  # same numbers on every rank
        if decision is not None:
            extra["rebalance"] = decision.to_record()
        run.current = run.rebalancer.plan  # applies from the next step on
    return extra


def save_step(run: StageRun, done: int, watchdog: Watchdog, control: dist.ProcessGroup | None) -> None:
    """Checkpoint after ``done`` steps (the parameters all-gathered first), and the run config beside it."""
    config = run.config
    save_start = time.time()
    run.stage_opt.wait_params()
    watchdog.beat(f"checkpoint save of step {done}")
    cursor = DataCursor(run.first_sample(done - 1) + run.plan.global_batch_size, config.shuffle, config.seed,
                        run.num_samples)
    extra = {"dtype": run.dtype, "settings": run_settings(config, run.dtype),
             **({"loss_scaler": run.scaler.to_dict()} if run.scaler else {}),
             **({TENSORBOARD_RUN: config.tensorboard_run} if config.tensorboard_run else {})}
    save_checkpoint(config.checkpoint_dir, done, run.module, run.stage_opt.optimizer, run.current, run.spec, cursor,
                    config.keep, run.device, extra=extra, group=control)
    if run.rank == 0 and config.run_config is not None:  # beside the checkpoints it wrote (not before)
        write_run_config(config.run_config, config.checkpoint_dir)
    run.timeline.add("checkpoint", save_start, time.time())


def finish_run(run: StageRun, watchdog: Watchdog, control: dist.ProcessGroup | None) -> None:
    """After the last step: the consolidated model (``--save-final``) and the trace (``--trace``)."""
    run.stage_opt.wait_params()
    watchdog.beat("final save")
    if run.config.save_final is not None:
        save_consolidated(run.module, run.plan, run.rank, run.spec, control, run.config.save_final)
    if run.config.trace is not None:
        write_trace(run.plan, run.config.trace, run.timeline.events, run.rank, control)


@dataclass
class _SyncSteps:
    """The gradient sync's per-step callbacks: armed before the last backward (hooks), the rest fired after its
    sends; its trace slices start where the sync started (the last backward, or after its sends)."""

    buckets: GradBuckets
    timeline: Timeline
    kill: Any
    rank: int
    step: int = 0
    start: Any = None  # the trace mark where this step's sync began

    def _begin(self) -> None:
        if self.start is None and self.timeline.record:
            self.start = self.timeline.mark()

    def arm(self) -> None:
        self._begin()
        self.buckets.arm()

    def fire_rest(self) -> None:
        self._begin()
        self.buckets.flush()
        maybe_kill(self.kill, self.rank, "allreduce", self.step)  # test hook: peers are inside the all-reduces

    def traced(self, label: str) -> None:
        if self.start is not None:
            self.timeline.span(f"allreduce {label}", self.start, self.timeline.mark())


def _timings(timeline: Timeline) -> list[float]:
    """This step's HOST_FIELDS (``metrics``), resolved from its marks (complete after the stats read)."""
    timeline.finish_step()
    return [timeline.fwd_s, timeline.bwd_s, max(0.0, timeline.phase_s - timeline.busy_s), timeline.sync_exposed_s,
            float(peak_memory_bytes(timeline.device)), float(device_used_bytes(timeline.device))]


def _initial_scaler(start: ResumePoint) -> LossScaler:
    """A fresh fp16 loss scaler, or the one the checkpoint we resume from saved."""
    saved = start.manifest.extra.get("loss_scaler") if start.manifest is not None else None
    return LossScaler.from_dict(saved) if saved else LossScaler()
