"""Where rank 0's step records go besides the JSON lines file: TensorBoard (``--tensorboard DIR``) and Weights &
Biases (``--wandb PROJECT``, offline unless ``WANDB_MODE`` says otherwise).

Both get the same scalars from the same record (``scalars``), so a dashboard shows what the metrics file holds:
loss, gradient norm, tokens/s, measured and predicted step time, MFU, per-pipeline compute and idle time, exposed
sync, per-rank peak memory (and, on GPUs, its ratio to the plan's prediction); rebalances and re-plans are events.
Each sink imports its library only when asked for, with a one-line error naming the package to install.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ethpipe.errors import UserError

if TYPE_CHECKING:
    import torch

    from ethpipe.plan import Plan
    from ethpipe.runtime.checkpoint.layout import ResumePoint
    from ethpipe.runtime.config import TrainConfig
    from ethpipe.runtime.observe.metrics import MetricsWriter


class Sink(Protocol):
    plan_memory_bytes: Sequence[int]  # per rank, the plan's predicted peak (set for each plan the run trains)

    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def scalars(record: dict[str, Any], plan_memory_bytes: Sequence[int] = ()) -> dict[str, float]:
    """The record's numbers under dashboard names (``section/name``); absent fields are left out."""
    out: dict[str, float] = {}
    for key, name in (("loss", "train/loss"), ("grad_norm", "train/grad_norm"), ("tokens_per_s", "train/tokens_per_s"),
                      ("iteration_time_s", "train/step_time_s"), ("predicted_step_s", "train/predicted_step_time_s"),
                      ("mfu", "train/mfu"), ("lr", "train/lr"), ("loss_scale", "train/loss_scale"),
                      ("grad_sync_exposed_s", "sync/exposed_s"), ("val_loss", "val/loss")):
        if record.get(key) is not None:
            out[name] = float(record[key])
    for p, (busy, idle) in enumerate(zip(record.get("pipeline_compute_s", ()), record.get("pipeline_idle_s", ()))):
        out[f"pipeline/{p}/compute_s"] = float(busy)
        out[f"pipeline/{p}/idle_s"] = float(idle)
    for rank, peak in enumerate(record.get("peak_memory_bytes", ())):
        out[f"memory/rank_{rank}/peak_gib"] = peak / 2**30
        if rank < len(plan_memory_bytes) and plan_memory_bytes[rank]:
            out[f"memory/rank_{rank}/peak_vs_plan"] = peak / plan_memory_bytes[rank]
    return out


def events(record: dict[str, Any]) -> list[str]:
    """What happened at this step besides training: a data rebalance, a plan switch, a restart."""
    out = []
    if record.get("rebalance"):
        out.append(f"rebalance at step {record['step']}: {record['rebalance']}")
    if record.get("replan"):
        out.append(f"re-plan at step {record['step']}: {record['replan']}")
    if record.get("skipped"):
        out.append(f"step {record['step']} skipped (fp16 overflow, loss scale {record.get('loss_scale')})")
    return out


TENSORBOARD_RUN = "tensorboard_run"  # the checkpoint manifest's record of the run's TensorBoard folder


def tensorboard_run_dir(root: str | Path, start: ResumePoint, now: datetime.datetime | None = None
                        ) -> tuple[Path, int | None]:
    """A run's TensorBoard folder under ``--tensorboard ROOT`` and the step its writer purges from.

    Each training run is one TensorBoard run, in its own folder: a fresh start a new ``run-<UTC time>`` (a run
    repeated from its run.toml, or another run pointed at the same ROOT, never writes into an earlier run's
    curves); a resume the folder its checkpoint recorded, purged from the step after it (what a crashed attempt
    logged past the checkpoint goes). A checkpoint from before run folders: ROOT itself, as then."""
    root = Path(root)
    if start.manifest is None:
        stamp = (now or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y%m%d-%H%M%S")
        folder = root / f"run-{stamp}"
        k = 1
        while folder.exists():  # two runs started in one second
            k += 1
            folder = root / f"run-{stamp}-{k}"
        return folder, None
    name = start.manifest.extra.get(TENSORBOARD_RUN)
    return (root / name if name else root), start.step + 1  # record steps count from 1


class TensorBoardSink:
    """torch.utils.tensorboard event files in ``log_dir`` (one run per directory), opened at the first record: a
    run that fails to start leaves no event file."""

    def __init__(self, log_dir: str, plan_memory_bytes: Sequence[int] = (), purge_step: int | None = None) -> None:
        self.plan_memory_bytes = tuple(plan_memory_bytes)
        self.log_dir, self._purge_step = log_dir, purge_step
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install 'ethpipe[tensorboard]' "
                            "(or pip install tensorboard)") from None
        self._writer_cls = SummaryWriter
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None:
            # purge_step: a resumed run drops what a crashed attempt logged after the checkpoint it resumes from;
            # flushed every 10 s by its own thread (and on close), not by rank 0 between steps
            self._writer = self._writer_cls(log_dir=self.log_dir, purge_step=self._purge_step, flush_secs=10)
        return self._writer

    def write(self, record: dict[str, Any]) -> None:
        self._open()
        step = int(record["step"])
        for name, value in scalars(record, self.plan_memory_bytes).items():
            self._writer.add_scalar(name, value, step)
        for text in events(record):
            self._writer.add_text("events", text, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbSink:
    """A Weights & Biases run: offline (a run directory to `wandb sync` later) unless ``WANDB_MODE`` is set."""

    def __init__(self, project: str, settings: dict[str, Any], plan_memory_bytes: Sequence[int] = ()) -> None:
        self.plan_memory_bytes = tuple(plan_memory_bytes)
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install 'ethpipe[wandb]' (or pip install wandb)") \
                from None
        self._wandb = wandb
        self._run = wandb.init(project=project, config=settings, mode=os.environ.get("WANDB_MODE", "offline"),
                               dir=os.environ.get("WANDB_DIR"))

    @property
    def run_dir(self) -> str:
        return str(self._run.dir)

    def write(self, record: dict[str, Any]) -> None:
        values: dict[str, Any] = dict(scalars(record, self.plan_memory_bytes))
        texts = events(record)
        if texts:
            values["events"] = "; ".join(texts)
        self._run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


def plan_memory(plan: Plan, config: TrainConfig, device: torch.device) -> list[int]:
    """Per rank, the plan's predicted peak bytes where they describe the devices the ranks run on (GPUs)."""
    if device.type != "cuda" or config.emulate:
        return []
    by_rank = {d["rank"]: int(d["memory_bytes"]) for d in (plan.predicted or {}).get("devices", [])}
    return [by_rank.get(r, 0) for r in range(plan.world_size)]


def open_sinks(plan: Plan, config: TrainConfig, start: ResumePoint) -> list[Any]:
    """Rank 0's dashboards, open for the whole run (a --replan-after switch keeps logging into the same run)."""
    from ethpipe.precision import train_dtype
    from ethpipe.runtime.start.run_settings import run_settings

    sinks: list[Any] = []
    if config.tensorboard is not None:
        log_dir, purge_step = tensorboard_run_dir(config.tensorboard, start)
        sinks.append(TensorBoardSink(str(log_dir), purge_step=purge_step))
    if config.wandb is not None:
        settings = {**run_settings(config, train_dtype(plan, config.dtype)), "world_size": plan.world_size,
                    "pipelines": len(plan.pipelines), "model": plan.model,
                    "global_batch_size": plan.global_batch_size, "seq_len": plan.seq_len}
        sinks.append(WandbSink(config.wandb, settings))
    return sinks


def metrics_writer(plan: Plan, config: TrainConfig, start: ResumePoint, device: torch.device,
                    sinks: list[Any]) -> MetricsWriter:
    """Rank 0's metrics under this plan: the JSON lines file, the console, the dashboards."""
    from ethpipe.runtime.observe.metrics import MetricsWriter

    # An emulated run paces CPU processes: the plan's times are of its real devices, unless the plan pins the
    # emulated ones (paced targets or profiles: `ethpipe demo`); MFU (of the real devices' peaks) never applies.
    section = plan.extra.get("emulation") or {}
    pinned = isinstance(section, dict) and ("compute_s" in section or "profiles" in section)
    predicted = dict(plan.predicted or {}) if not config.emulate or pinned else {}
    if config.emulate:
        predicted.pop("mfu", None)
    memory = plan_memory(plan, config, device)
    for sink in sinks:
        sink.plan_memory_bytes = memory
    capacity = {d["rank"]: int(d.get("memory_capacity_bytes", 0)) for d in predicted.get("devices", [])}
    on_gpus = memory and all(capacity.get(r, 0) > 0 for r in range(plan.world_size))
    return MetricsWriter(config.metrics, config.steps - start.step, config.progress, append=start.step > 0,
                         predicted_step_s=predicted.get("iteration_time_s"), total_steps=config.steps,
                         log_every_steps=config.log_every, predicted_mfu=predicted.get("mfu"), sinks=sinks,
                         capacity_bytes=[capacity[r] for r in range(plan.world_size)] if on_gpus else ())
