"""The training loop of one rank: build the stage, run its schedule, sync blocks, clip, AdamW, report, checkpoint.

``train`` runs on every rank of an initialised (or to-be-initialised) process group. All
checks that can fail on user input run before any collective (``runtime/start/checks.py``), identically
on every rank, so bad input makes every rank raise the same one-line UserError instead of hanging.
A step reads the device once (``metrics.gather_stats``): loss, gradient norm and the non-finite
flag are computed on the device, clipping and fp16 unscaling are one foreach multiply.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
import os
import time
import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.precision import train_dtype
from ethpipe.runtime.checkpoint.consolidated import gather_consolidated, load_into, save_atomic
from ethpipe.runtime.start.checks import check_inputs, check_plan_runnable
from ethpipe.runtime.checkpoint.layout import DataCursor, ResumePoint
from ethpipe.runtime.checkpoint.state import load_checkpoint, save_checkpoint
from ethpipe.runtime.config import ADAM_BETAS, ADAM_EPS, AUTOCAST_DTYPES, TrainConfig, lr_at, make_optimizer
from ethpipe.runtime.start.run_settings import resume_line, run_settings, write_replanned_plan, write_run_config
from ethpipe.runtime.sync.stage_optim import build_stage_optimizer
from ethpipe.runtime.data import TokenFile, gather_samples, sample_ids
from ethpipe.runtime.adapt.emulate import Emulator, make_emulator
from ethpipe.runtime.pipeline.executor import StageIO, run_stage_step
from ethpipe.runtime.adapt.fault_hooks import ForwardKill, kill_spec, maybe_hang, maybe_kill, maybe_overflow
from ethpipe.runtime.sync.buckets import GradBuckets
from ethpipe.runtime.sync.grads import clip_coefficient
from ethpipe.runtime.groups import build_groups, control_group, destroy_groups
from ethpipe.runtime.sync.loss_scale import LossScaler
from ethpipe.runtime.observe.sinks import metrics_writer, open_sinks
from ethpipe.runtime.adapt.replan_step import Outcome, Replanner, decide_replan, replan_due
from ethpipe.runtime.observe.metrics import gather_stats, peak_memory_bytes, step_record, write_chrome_trace
from ethpipe.runtime.model.decoder import PARAM_DTYPES, build_stage, compile_blocks, state_dict_shapes
from ethpipe.runtime.start.placement import gather_and_check
from ethpipe.runtime.start.preflight import settle
from ethpipe.cluster_launch import check_node
from ethpipe.runtime.adapt.rebalance import Rebalancer, split_of
from ethpipe.runtime.model.tensor_parallel import TPGroup
from ethpipe.runtime.observe.timeline import Timeline
from ethpipe.runtime.start.watchdog import Watchdog
from ethpipe.schedule import actions_of

__all__ = ["ADAM_BETAS", "ADAM_EPS", "TrainConfig", "check_inputs", "check_plan_runnable", "lr_at", "make_optimizer",
           "sample_ids", "train"]


def _micro_batches(plan: Plan, data: TokenFile, ids: np.ndarray, pipeline: int,
                   device: torch.device) -> list[torch.Tensor]:
    """This pipeline's micro-batches of the step's global sample ids, under ``plan``'s split."""
    out = []
    for lo, hi in plan.microbatch_slices(pipeline):
        rows = torch.from_numpy(gather_samples(data, ids[lo:hi], plan.seq_len))
        if device.type == "cuda":  # pinned: the copy runs on the stream without holding the host
            rows = rows.pin_memory().to(device, non_blocking=True)
        out.append(rows.to(device))
    return out


def train(plan: Plan, config: TrainConfig, rank: int, world_size: int, device: torch.device | None = None,
          init_method: str = "env://", store: dist.Store | None = None,
          replanner: Replanner | None = None) -> list[dict[str, Any]]:
    """Train on this rank; returns the per-step metric records on rank 0 ([] elsewhere).

    Initialises the default process group if none exists (and tears it down afterwards);
    otherwise reuses it and only creates (and destroys) the plan's own groups. ``replanner``
    (``--replan-after``): after its ``after_steps`` steps, rank 0 asks it for a better plan; on a switch every
    rank checkpoints, rebuilds its stage under the new plan from that checkpoint, and goes on in this process.
    """
    problem: UserError | None = None
    try:
        spec, data, start = check_inputs(plan, config, world_size)
    except UserError as err:  # settled with every rank's outcome once the world is up (runtime/start/preflight.py)
        problem = err
    try:
        check_node(plan, rank)  # under `ethpipe launch`: this rank is on its planned node
    except UserError as err:
        problem = problem or err
    device = device if device is not None else torch.device("cpu")
    owns_world = not dist.is_initialized()
    if problem is not None and owns_world and world_size == 1:
        raise problem  # nobody waits for this rank
    if owns_world:
        backend = dist.get_default_backend_for_device(device)
        # device_id binds the world to this rank's GPU: NCCL communicators are then created eagerly (new_group
        # splits them at creation) instead of at their first use, which for batched p2p involves the whole group.
        try:
            dist.init_process_group(backend, init_method=None if store is not None else init_method, store=store,
                                    rank=rank, world_size=world_size, timeout=config.timeout,
                                    device_id=device if device.type != "cpu" else None)
        except Exception:
            if problem is not None:  # no world to settle with (e.g. not under a launcher): this rank's own line
                raise problem from None
            raise
    control: dist.ProcessGroup | None = None
    sinks: list[Any] = []
    try:
        control = control_group(config.timeout)
        if rank == 0 and problem is None:  # dashboards that cannot open stop every rank, with one line
            try:
                sinks = open_sinks(plan, config, start)
            except Exception as err:  # noqa: BLE001 - a directory, a login, a package: the user's to fix
                problem = UserError(f"--tensorboard / --wandb could not start: {str(err).splitlines()[0]}")
        settle(problem, control)
        _check_same_plan(plan, device)
        if not config.emulate:  # emulated device types run on CPUs
            gather_and_check(plan, device, control)
        if rank == 0:
            print(start_banner(plan, config, start, device), flush=True)
            if start.manifest is not None:
                print(resume_line(start.manifest, plan, config, train_dtype(plan, config.dtype)), flush=True)
        records: list[dict[str, Any]] = []
        with Watchdog(rank, config.watchdog_limit_s) as watchdog:
            while True:
                outcome = _train_on_world(plan, config, spec, data, start, rank, device, watchdog, control, replanner,
                                          sinks)
                records += outcome.records
                if outcome.switch_to is None:
                    return records
                plan, replanner = outcome.switch_to, None  # one switch per run
                config = dataclasses.replace(config, resume=True, auto_resume=False, init_from=None)
                spec, data, start = _switch_point(plan, config, world_size, outcome.switch_step, control)
                _check_same_plan(plan, device)
                _release_memory(device)
                if rank == 0:
                    saved = write_replanned_plan(plan, config.checkpoint_dir)
                    print(f"switched to the re-planned plan at step {start.step}: {len(plan.pipelines)} pipelines, "
                          f"predicted {(plan.predicted or {}).get('iteration_time_s', 0.0):.4f} s/step; after a "
                          f"crash resume with --plan {saved}", flush=True)
    finally:
        for sink in sinks:
            sink.close()
        if control is not None:
            dist.destroy_process_group(control)
        if owns_world:
            dist.destroy_process_group()


def _switch_point(plan: Plan, config: TrainConfig, world_size: int, step: int,
                  control: dist.ProcessGroup | None) -> tuple[ModelSpec, TokenFile, ResumePoint]:
    """Every rank resumes the new plan from the checkpoint of the switch step, or every rank stops: a rank that
    does not see it yet (a shared file system's stale listing) must not load an older one."""
    problem: UserError | None = None
    try:
        spec, data, start = check_inputs(plan, config, world_size)
        if start.step != step:
            raise UserError(f"after the plan switch this rank found the checkpoint of step {start.step}, not {step}: "
                            "the checkpoint directory is not shared consistently; resume with --auto-resume")
    except UserError as err:
        problem = err
    settle(problem, control)
    return spec, data, start


def _release_memory(device: torch.device) -> None:
    """Free the old stage before the new one grows (its hooks and closures form cycles) and restart the peak."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def start_banner(plan: Plan, config: TrainConfig, start: ResumePoint, device: torch.device) -> str:
    """One line saying what runs: the world, the precision and why, the steps."""
    dtype, planned = train_dtype(plan, config.dtype), plan.extra.get("dtype")
    if config.dtype is None:
        why = "the plan's" if planned else "the plan records none"
    else:
        why = f"--dtype; the plan was made for {planned}" if planned and planned != config.dtype else "--dtype"
    steps = f"steps {start.step}..{config.steps}" if start.step else f"{config.steps} steps"
    zero = f", AdamW state sharded over the {len(plan.pipelines)} pipelines" if plan.shard_optimizer else ""
    return (f"ethpipe train: {plan.world_size} ranks on {device.type}, {len(plan.pipelines)} pipelines{zero}, "
            f"{dtype} ({why}), {steps}")


def _check_same_plan(plan: Plan, device: torch.device) -> None:
    """Every rank must run the same plan (each may have re-planned on its own, e.g. after a restart)."""
    d = plan.to_dict()  # what execution depends on (not e.g. the planner's timing of itself)
    key = json.dumps([d[k] for k in ("model", "global_batch_size", "seq_len", "pipelines", "blocks")] +
                     [plan.extra.get("device_speeds"), plan.shard_optimizer, list(plan.shard_weights)], sort_keys=True)
    local = torch.tensor([zlib.crc32(key.encode())], dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    if len({int(p) for p in parts}) > 1:
        raise UserError("the ranks were given different plans: give every rank the same --plan (or the same "
                        "--replan-cluster, so they all plan alike)")


def _train_on_world(plan: Plan, config: TrainConfig, spec: ModelSpec, data: TokenFile, start: ResumePoint,
                    rank: int, device: torch.device, watchdog: Watchdog,
                    control: dist.ProcessGroup | None, replanner: Replanner | None = None,
                    sinks: list[Any] | None = None) -> Outcome:
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
                         recompute=config.recompute or stage.recompute, dtype=param_dtype, tp=tp,
                         chunks=stage.chunks)
    if config.init_from is not None and start.step_dir is None:
        load_into(module, config.init_from)
    if config.compile:
        compile_blocks(module)
    states = None
    if start.step_dir is not None:
        watchdog.beat(f"loading checkpoint {start.step_dir}")
        # a sharded optimizer keeps only its pieces of the full states: they load on the CPU first
        states = load_checkpoint(start, module, None, device, group=control,
                                 state_device=torch.device("cpu") if plan.shard_optimizer else None)
    stage_opt = build_stage_optimizer(plan, config, rank, module, state_dict_shapes(spec), tied, groups, device,
                                      states)
    del states
    buckets = stage_opt.buckets
    emulator: Emulator | None = (make_emulator(plan, rank, config.slowdowns, mode=config.emulate_mode)
                                 if config.emulate else None)
    autocast_dtype = AUTOCAST_DTYPES.get(dtype)
    io = StageIO(groups.pipeline_group, groups.peers, first, last, spec.hidden_size, plan.seq_len,
                 act_dtype=autocast_dtype or param_dtype, param_dtype=param_dtype, count_loss=pos.tp_rank == 0)
    loss_scale = 1.0 / (plan.global_batch_size * plan.seq_len)
    scaler = _initial_scaler(start) if dtype == "fp16" else None
    timeline = Timeline(device, synchronous=device.type == "cpu" or emulator is not None,
                        record=config.trace is not None)
    writer = metrics_writer(plan, config, start, device, sinks or []) if rank == 0 else None
    num_samples = data.num_samples(plan.seq_len)
    rebalancer = Rebalancer(plan, config.rebalance) if config.rebalance is not None else None
    current = plan  # the split running now: the plan's, until a rebalance changes it (same stages and groups)
    kill = kill_spec()
    sync = _SyncSteps(buckets, timeline, kill, rank)
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
            stage_opt.set_lr(lr)
            stage_opt.wait_params()  # sharded: the last step's all-gather (a stream wait on GPUs)
            buckets.zero_grads()
            ids = sample_ids(first_sample, plan.global_batch_size, num_samples, config.shuffle, config.seed)
            batch = _micro_batches(current, data, ids, pos.pipeline, device) if first or last else []
            inputs = [b[:, :-1].contiguous() for b in batch] if first else None
            targets = [b[:, 1:].contiguous() for b in batch] if last else None
            actions = actions_of(cur_pipe, pos.stage, split=not (config.recompute or config.compile))
            if forward_kill is not None:
                forward_kill.begin_step(step, cur_pipe.num_microbatches)
            timeline.start_step()
            sync.step, sync.start = step, None
            scale = scaler.scale if scaler is not None else 1.0
            loss = run_stage_step(module, actions, cur_pipe.micro_batch_sizes, inputs, targets, io,
                                  loss_scale * scale, emulator, step, timeline, autocast_dtype,
                                  on_last_backward=sync.fire_rest,
                                  before_last_backward=sync.arm if config.overlap_grad_sync else None)
            buckets.wait(sync.traced)
            timeline.sync_done()
            maybe_overflow(stage_opt.grads, rank, step)
            on_device = torch.cat([(loss.double() / scale).reshape(1), stage_opt.norm_parts()])
            stats = gather_stats(plan, on_device, lambda: _timings(timeline), device, control)
            stats = dataclasses.replace(stats, grad_norm=stats.grad_norm / scale)  # of the unscaled gradients
            skipped = scaler is not None and stats.num_nonfinite > 0  # the same world-wide count on every rank
            if not skipped:
                clip = clip_coefficient(stats.grad_norm, config.clip_grad) if config.clip_grad > 0 else 1.0
                opt_start = time.time()
                stage_opt.step(clip / scale)
                timeline.add("optimizer", opt_start, time.time())
            extra: dict[str, Any] = {"samples": [first_sample, first_sample + plan.global_batch_size],
                                     "split": list(split_of(current)), "restart": restart,
                                     "micro_batch_sizes": [list(p.micro_batch_sizes) for p in current.pipelines]}
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
            record = step_record(step, stats, time.time() - step_start, plan.global_batch_size * plan.seq_len, lr,
                                 extra)
            switch_to = None
            if replan_due(replanner, step, start) and step + 1 < config.steps and config.checkpoint_dir is not None:
                watchdog.beat("re-planning")
                so_far = [*(writer.records if writer is not None else []), record]  # rank 0's; the others' unused
                switch_to, record["replan"] = decide_replan(replanner, current, so_far, rank, control)
                if rank == 0:
                    print(record["replan"]["line"], flush=True)
            if writer is not None:
                writer.write(record)
            done = step + 1
            if config.checkpoint_dir is not None and (done == config.steps or switch_to is not None or
                                                      (config.save_every and done % config.save_every == 0)):
                save_start = time.time()
                stage_opt.wait_params()
                watchdog.beat(f"checkpoint save of step {done}")
                cursor = DataCursor(first_sample + plan.global_batch_size, config.shuffle, config.seed, num_samples)
                save_checkpoint(config.checkpoint_dir, done, module, stage_opt.optimizer, current, spec, cursor, config.keep,
                                device, extra={"dtype": dtype, "settings": run_settings(config, dtype),
                                       **({"loss_scaler": scaler.to_dict()} if scaler else {})},
                                group=control)
                if rank == 0 and config.run_config is not None:  # beside the checkpoints it wrote (not before)
                    write_run_config(config.run_config, config.checkpoint_dir)
                timeline.add("checkpoint", save_start, time.time())
            if switch_to is not None:
                stage_opt.wait_params()
                return Outcome(writer.records if writer is not None else [], switch_to, done)
        stage_opt.wait_params()
        watchdog.beat("final save")
        if config.save_final is not None:
            state = gather_consolidated(module, plan, rank, spec, control)
            if state is not None:
                save_atomic(state, config.save_final)
        if config.trace is not None:
            _write_trace(plan, config.trace, timeline, rank, control)
        return Outcome(writer.records if writer is not None else [])
    finally:
        buckets.remove_hooks()
        if writer is not None:
            writer.close()
        destroy_groups(groups)


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
            float(peak_memory_bytes(timeline.device))]


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
