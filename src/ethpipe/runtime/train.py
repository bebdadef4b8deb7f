"""One rank's training run: the world, the checks every rank settles, the plan switches; the steps are ``step.py``.

``train`` runs on every rank of an initialised (or to-be-initialised) process group. All
checks that can fail on user input run before any collective (``runtime/start/checks.py``), identically
on every rank, so bad input makes every rank raise the same one-line UserError instead of hanging.
A step (``runtime/step.py``) reads the device once (``metrics.gather_stats``): loss, gradient norm and the
non-finite flag are computed on the device, clipping and fp16 unscaling are one foreach multiply.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ethpipe.cluster_launch import check_node
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.precision import train_dtype
from ethpipe.runtime.adapt.replan_step import Replanner
from ethpipe.runtime.checkpoint.layout import ResumePoint
from ethpipe.runtime.config import ADAM_BETAS, ADAM_EPS, TrainConfig, lr_at, make_optimizer
from ethpipe.runtime.data import TokenFile, sample_ids
from ethpipe.runtime.groups import control_group
from ethpipe.runtime.observe.sinks import TensorBoardSink, open_sinks
from ethpipe.runtime.start.checks import check_inputs, check_plan_runnable
from ethpipe.runtime.start.placement import check_placement, local_device_info
from ethpipe.runtime.start.preflight import settle
from ethpipe.runtime.start.run_settings import (replanned_path, resume_line, with_plan, write_replanned_plan,
                                                write_run_config)
from ethpipe.runtime.start.watchdog import Watchdog
from ethpipe.runtime.step import run_plan

# The runtime's entry points and the config they take, importable from here (launchers, tests, benchmarks).
__all__ = ["ADAM_BETAS", "ADAM_EPS", "TrainConfig", "check_inputs", "check_plan_runnable", "lr_at", "make_optimizer",
           "Replanner", "sample_ids", "train"]


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
        spec, data, start = check_inputs(plan, config, world_size, rank)
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
            board = next((s.log_dir for s in sinks if isinstance(s, TensorBoardSink)), None)
            if board is not None and config.tensorboard is not None and Path(board) != Path(config.tensorboard):
                config = dataclasses.replace(config, tensorboard_run=Path(board).name)
        device_info = None if config.emulate else local_device_info(device)  # emulated types run on CPUs
        payloads = settle(problem, control, (plan_key(plan), device_info))
        check_same_plan([key for key, _ in payloads])
        if device_info is not None:
            check_placement(plan, [info for _, info in payloads])
        if rank == 0:
            print(start_banner(plan, config, start, device), flush=True)
            if start.manifest is not None:
                print(resume_line(start.manifest, plan, config, train_dtype(plan, config.dtype)), flush=True)
        records: list[dict[str, Any]] = []
        with Watchdog(rank, config.watchdog_limit_s) as watchdog:
            while True:
                outcome = run_plan(plan, config, spec, data, start, rank, device, watchdog, control, replanner, sinks)
                records += outcome.records
                if outcome.switch_to is None:
                    return records
                plan, replanner = outcome.switch_to, None  # one switch per run
                assert config.checkpoint_dir is not None, "a plan switch goes through a checkpoint"
                config = dataclasses.replace(config, resume=True, auto_resume=False, init_from=None,
                                             run_config=with_plan(config.run_config, replanned_path(
                                                 config.checkpoint_dir)))
                spec, data, start = _switch_point(plan, config, world_size, outcome.switch_step, control)
                _release_memory(device)
                if rank == 0:
                    saved = write_replanned_plan(plan, config.checkpoint_dir)
                    if config.run_config is not None:  # run.toml repeats the run from here: with the new plan
                        write_run_config(config.run_config, config.checkpoint_dir)
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
        spec, data, start = check_inputs(plan, config, world_size, dist.get_rank())
        if start.step != step:
            raise UserError(f"after the plan switch this rank found the checkpoint of step {start.step}, not {step}: "
                            "the checkpoint directory is not shared consistently; resume with --auto-resume")
    except UserError as err:
        problem = err
    check_same_plan(settle(problem, control, plan_key(plan)))
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


def plan_key(plan: Plan) -> int:
    """A checksum of what execution depends on (not e.g. the planner's timing of itself)."""
    d = plan.to_dict()
    key = json.dumps([d[k] for k in ("model", "global_batch_size", "seq_len", "pipelines", "blocks")] +
                     [plan.extra.get("device_speeds"), plan.shard_optimizer, list(plan.shard_weights),
                      plan.extra.get("grad_reduce", "fp32")], sort_keys=True)
    return zlib.crc32(key.encode())


def check_same_plan(keys: list[int]) -> None:
    """Every rank must run the same plan (each may have re-planned on its own, e.g. after a restart)."""
    if len(set(keys)) > 1:
        raise UserError("the ranks were given different plans: give every rank the same --plan (or the same "
                        "--replan-cluster, so they all plan alike)")
