"""Starting the ranks: under torchrun (env:// rendezvous) or spawned locally from one command.

Local runs rendezvous through a FileStore in a fresh temporary directory, so they never race
for a port. Each local worker dies with its parent (PR_SET_PDEATHSIG) and runs one compute
thread. A rank that fails ends the whole world: ``torch.multiprocessing`` terminates the other
workers, and a user error (``UserError``) on any rank comes back to the caller as that one line.
Any other exception is a crash: the first crashed rank's traceback outlives the run directory
in a crash report (``ethpipe.errors.write_crash_report``) that ``TrainingFailed`` names.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import CheckpointException

from ethpipe.errors import ReportedElsewhere, UserError, write_crash_report
from ethpipe.plan import Plan
from ethpipe.precision import plan_gpus
from ethpipe.runtime.model.kernel_modes import apply_kernel_modes
from ethpipe.runtime.train import Replanner, TrainConfig, check_inputs, check_plan_runnable, train
from ethpipe.runtime.start.watchdog import WATCHDOG_EXIT_CODE

_PR_SET_PDEATHSIG = 1


class TrainingFailed(RuntimeError):
    """A rank died or crashed: ``str()`` is one line naming the rank, the root cause and, for a crash,
    the kept crash report; ``details`` holds the crashed rank's traceback (also in ``report``)."""

    def __init__(self, message: str, details: str = "", report: Path | None = None) -> None:
        super().__init__(message)
        self.details = details
        self.report = report


def in_torchrun() -> bool:
    """True when launched by torchrun / torch elastic (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(config: TrainConfig, local_rank: int, local_world_size: int) -> torch.device:
    """The accelerator when present (one per local rank), else the CPU; never a hard-coded type."""
    if config.device == "cpu" or not torch.accelerator.is_available():
        return torch.device("cpu")
    count = torch.accelerator.device_count()
    if local_world_size > count:
        raise UserError(
            f"this machine has {count} accelerators but {local_world_size} ranks would share them: "
            "run with --device cpu, or launch across machines with torchrun"
        )
    accel = torch.accelerator.current_accelerator()
    assert accel is not None
    torch.accelerator.set_device_index(local_rank)
    return torch.device(accel.type, local_rank)


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphans after a crash)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def uses_accelerator(config: TrainConfig) -> bool:
    return config.device != "cpu" and torch.accelerator.is_available()


def default_start_method(accelerator: bool = False) -> str:
    """fork on Linux for CPU ranks (sub-second start, modules already imported); spawn for accelerators
    (a process forked after CUDA is initialised cannot use it) and on other systems."""
    return "fork" if sys.platform.startswith("linux") and not accelerator else "spawn"


# Set for GPU runs unless the user set them (docs/runtime.md, "On GPUs"): read when the first process
# group and the allocator are created, so before any of them.
GPU_ENVIRONMENT = {
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",  # micro-batch sizes differ per pipeline and change
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a failed or timed-out collective ends the process
    "TORCH_FR_BUFFER_SIZE": "20000",  # the NCCL flight recorder: the last 20000 collectives per rank
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ... written out when a collective times out
}


# Older names of the same settings: where the user set one, theirs stands.
_SAME_SETTING = {"PYTORCH_ALLOC_CONF": ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"),
                 "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",)}


def set_gpu_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Apply ``GPU_ENVIRONMENT`` where ``environ`` (default ``os.environ``) sets neither the key nor an older
    name of it; returns what was set."""
    env = os.environ if environ is None else environ
    applied = {k: v for k, v in GPU_ENVIRONMENT.items()
               if k not in env and not any(old in env for old in _SAME_SETTING.get(k, ()))}
    env.update(applied)
    return applied


def _local_worker(rank: int, plan: Plan, config: TrainConfig, world_size: int, run_dir: str,
                  num_threads: int, replanner: Replanner | None = None) -> None:
    die_with_parent()
    torch.set_num_threads(num_threads)
    try:
        device = pick_device(config, rank, world_size)
        apply_kernel_modes(plan, device)
        records = train(plan, config, rank, world_size, device, init_method=f"file://{run_dir}/store",
                        replanner=replanner)
    except UserError as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        Path(run_dir, f"error-{rank:05d}.txt").write_text(message)
        raise SystemExit(2) from None
    except (Exception, CheckpointException):  # DCP's exception is a BaseException
        # The first rank to crash holds the root cause; the others only see peers disappear.
        Path(run_dir, f"crash-{time.time_ns():020d}-{rank:05d}.txt").write_text(
            f"rank {rank}: {traceback.format_exc()}")
        raise
    if rank == 0:
        Path(run_dir, "records.json").write_text(json.dumps(records))


def check_local_devices(plan: Plan, config: TrainConfig, has_accelerator: bool | None = None) -> None:
    """A plan for catalog GPUs, spawned on a machine without any: refuse rather than start one CPU process per
    rank (a 7B plan's 16 ranks would exhaust the host) unless asked (``--emulate``, ``--device cpu``)."""
    gpus = sorted({g.id for g in plan_gpus(plan) if g.vendor})
    has_accelerator = torch.accelerator.is_available() if has_accelerator is None else has_accelerator
    if gpus and not has_accelerator and not config.emulate and config.device == "auto":
        raise UserError(f"the plan runs on {', '.join(gpus)} but this machine has no GPU: start it where those GPUs "
                        f"are (`ethpipe launch`), or pass --emulate to emulate them here, or --device cpu to run its "
                        f"{plan.world_size} ranks as CPU processes anyway")


def run_local(plan: Plan, config: TrainConfig, start_method: str | None = None,
              num_threads: int = 1, replanner: Replanner | None = None) -> list[dict[str, Any]]:
    """Spawn the plan's whole world on this machine, train, return rank 0's per-step records.

    All input checks run here first, so bad input fails before any process starts.
    """
    check_inputs(plan, config, plan.world_size)
    check_local_devices(plan, config)
    import torch.optim  # noqa: F401  (imported before fork so children do not each pay for it)

    accelerator = uses_accelerator(config)
    if accelerator:
        set_gpu_environment()  # inherited by the workers
    with tempfile.TemporaryDirectory(prefix="ethpipe-run-") as run_dir:
        context = mp.start_processes(
            _local_worker, args=(plan, config, plan.world_size, run_dir, num_threads, replanner),
            nprocs=plan.world_size, join=False, start_method=start_method or default_start_method(accelerator),
        )
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)  # not one "Terminating process N via signal SIGTERM" per rank: our line says why
        try:
            while not context.join():
                pass
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            errors = sorted(Path(run_dir).glob("error-*.txt"))
            if errors:
                raise UserError(errors[0].read_text()) from None
            raise _failure(context.processes, Path(run_dir)) from None
        finally:
            spawn_log.setLevel(level)
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
        return json.loads(Path(run_dir, "records.json").read_text())


# What a rank's error says when a peer went away first (gloo's TCP pairs; NCCL's watchdog): a consequence.
PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                     "remote process exited or there was a network error")


def _failure(processes: list[Any], run_dir: Path) -> TrainingFailed:
    """The root cause in one line: a rank killed by a signal or the watchdog, else the first crash
    (its traceback copied to a crash report, since ``run_dir`` is deleted).

    ``torch.multiprocessing`` ends the other ranks with SIGTERM once one fails, and the peers of a
    dead rank crash on their broken connections, so those are consequences, not causes.
    """
    for proc in processes:
        proc.join(timeout=5)
    codes = {rank: proc.exitcode for rank, proc in enumerate(processes)}
    for rank, code in codes.items():
        if code is not None and code < 0 and -code != signal.SIGTERM:
            return TrainingFailed(f"training failed: rank {rank} was killed by {signal.Signals(-code).name}; "
                                  "resume from the last checkpoint (--auto-resume)")
    for rank, code in codes.items():
        if code == WATCHDOG_EXIT_CODE:
            return TrainingFailed(f"training failed: rank {rank} made no progress within --watchdog-s and was "
                                  "ended by its watchdog (see its message above)")
    crashes = sorted(run_dir.glob("crash-*.txt"))
    if crashes:
        # A crashed rank tears its groups down before it writes its report, so a peer can report the broken
        # connection first: the earliest report that is not such a consequence is the cause.
        texts = [c.read_text() for c in crashes]
        text = next((t for t in texts if not peer_lost(t)), texts[0])
        lines = [line for line in text.strip().splitlines() if line.strip()]
        report = write_crash_report(text)
        return TrainingFailed(f"training failed on {lines[0].split(':')[0]}: {lines[-1].strip()} "
                              f"(traceback in {report})", text, report)
    return TrainingFailed(f"training failed: ranks exited with codes {codes}")


def run_torchrun(plan: Plan, config: TrainConfig, replanner: Replanner | None = None) -> list[dict[str, Any]]:
    """This process is one rank of a torchrun world: check, pick the device, train."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    try:  # the same outcome on every rank (the plan against this world): rank 0 says it, the others exit 2
        check_plan_runnable(plan, world_size)
    except UserError as err:
        if rank != 0:
            raise ReportedElsewhere(str(err)) from None
        raise
    # Input problems that differ per node (a data file missing on one) are settled world-wide inside ``train``
    # (runtime/start/preflight.py): the cause prints once, every rank exits 2 within seconds.
    if uses_accelerator(config):
        set_gpu_environment()
    device = pick_device(config, local_rank, local_world)
    apply_kernel_modes(plan, device)
    try:
        return train(plan, config, rank, world_size, device, store=torchrun_store(rank, world_size, config),
                     replanner=replanner)
    except Exception as err:  # noqa: BLE001 - re-raised unless it is a peer's death seen from here
        if not peer_lost(str(err)):
            raise
        raise TrainingFailed(peer_lost_line(rank, socket.gethostname(), config)) from None


def peer_lost(error_text: str) -> bool:
    """Whether an error (its message, or a crash report) is this rank's broken connection to a peer that went away
    first: a consequence, not a cause."""
    return any(marker in error_text for marker in PEER_LOSS_MARKERS)


def peer_lost_line(rank: int, host: str, config: TrainConfig) -> str:
    """Under torchrun a rank cannot see how its peer ended; what it can say, in one line, and what to do."""
    resume = ("torchrun restarts the ranks and they resume from the last checkpoint (--auto-resume)"
              if config.auto_resume else "resume from the last checkpoint with --resume" if config.checkpoint_dir
              else "no --checkpoint-dir: the run starts over")
    return (f"rank {rank} on {host} lost its connection to another rank, which died or was killed first (torchrun's "
            f"summary names it and its exit code or signal); {resume}")


def torchrun_store(rank: int, world_size: int, config: TrainConfig) -> dist.Store:
    """The rendezvous store, with one key prefix per torchrun attempt.

    torchrun keeps its store across ``--max-restarts``; gloo's rendezvous keys of the killed
    attempt would survive in it and the restarted ranks would dial the dead processes' ports
    (measured with torch 2.13: "Gloo connectFullMesh failed ... Connection refused"), so every
    attempt gets its own prefix.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=config.timeout)
    return dist.PrefixStore(f"ethpipe/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
