"""Per-step metrics (one JSON line per step), the console progress bar, and Chrome traces.

Every rank contributes one small vector per step (loss part, squared-norm part, non-finite flag,
timings); ONE world all-gather into one tensor gives every rank the global loss and gradient norm (all
ranks need the norm to clip identically), and rank 0 the per-pipeline timing it reports. Reading it is
the step's one read of gathered data (``gather_stats``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from ethpipe.atomic import write_text_atomic
from ethpipe.plan import Plan

# Fields of the per-rank stats: computed on the device (read once per step), then timed on the host.
DEVICE_FIELDS = ("loss_part", "square_norm_part", "nonfinite_part")
HOST_FIELDS = ("fwd_s", "bwd_s", "idle_s", "sync_exposed_s", "peak_memory_bytes", "device_used_bytes")


def peak_memory_bytes(device: torch.device) -> int:
    """The rank's peak so far: the caching allocator's high-water mark on a GPU (a host-side counter, no
    synchronisation), the process's peak resident set on CPU (libraries included: not the plan's model)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def device_used_bytes(device: torch.device) -> int:
    """What the device shows in use now, beside the allocator's peak: on a GPU total - free
    (``torch.cuda.mem_get_info``: the CUDA context, NCCL's communicators and the allocator's cached blocks
    included, none of which ``peak_memory_bytes`` sees); on CPU the process's resident set now."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    try:
        with open("/proc/self/statm") as f:  # Linux: resident pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class StepStats:
    loss: float  # global mean token loss
    grad_norm: float  # before clipping (of the gradients as they were gathered: scaled ones under fp16)
    pipeline_compute_s: tuple[float, ...]  # mean over a pipeline's stages of F/B busy time
    pipeline_idle_s: tuple[float, ...]  # mean over a pipeline's stages of waiting time in the 1F1B phase
    grad_sync_exposed_s: float  # max over ranks of time blocked on block all-reduces after the last backward
    rank_busy_s: tuple[float, ...] = ()  # F/B busy time of every rank (the same on every rank: rebalancing input)
    num_nonfinite: int = 0  # ranks with a non-finite gradient (fp16 loss scaling skips the step if > 0)
    rank_peak_memory_bytes: tuple[int, ...] = ()  # every rank's peak so far (``peak_memory_bytes``)
    rank_device_used_bytes: tuple[int, ...] = ()  # every rank's device memory in use now (``device_used_bytes``)
    rank_fwd_s: tuple[float, ...] = ()  # every rank's forward time this step (device time on GPUs)
    rank_bwd_s: tuple[float, ...] = ()  # ... and backward time: what `calibrate --from-run` fits
    rank_idle_s: tuple[float, ...] = ()  # every rank's waiting time in the schedule (p2p, bubbles)


def gather_stats(plan: Plan, device_values: torch.Tensor, host_values: Callable[[], Sequence[float]],
                 device: torch.device) -> StepStats:
    """The step's stats on every rank, in ONE collective on the world's device group and one read of it.

    ``device_values`` (``DEVICE_FIELDS``, fp64 on the device) and ``host_values()`` (``HOST_FIELDS``: the
    step's timings) go in one fixed-size vector per rank, all-gathered with ``all_gather_single`` (one
    collective whatever the world size: no list of per-rank outputs, no host-side gloo ring over the world).
    On a GPU the timings come from the step's CUDA events, so the host first waits for the step's work (the
    events complete), then launches the all-gather and reads its result: the read after it waits for that
    one small collective only.
    """
    world = dist.get_world_size()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)  # the step's events are complete: its timings can be resolved
    host = torch.tensor(list(host_values()), dtype=torch.float64).to(device)
    local = torch.cat([device_values.reshape(-1), host])
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
    dist.all_gather_single(gathered, local)
    rows = gathered.view(world, -1).tolist()
    col = {f: [row[i] for row in rows] for i, f in enumerate(DEVICE_FIELDS + HOST_FIELDS)}
    col["busy_s"] = [f + b for f, b in zip(col["fwd_s"], col["bwd_s"])]  # F and B time, as Timeline.busy_s
    compute = tuple(sum(col["busy_s"][r] for r in pipe.ranks) / len(pipe.ranks) for pipe in plan.pipelines)
    idle = tuple(sum(col["idle_s"][r] for r in pipe.ranks) / len(pipe.ranks) for pipe in plan.pipelines)
    return StepStats(
        loss=sum(col["loss_part"]),
        grad_norm=math.sqrt(sum(col["square_norm_part"])),
        pipeline_compute_s=compute,
        pipeline_idle_s=idle,
        grad_sync_exposed_s=max(col["sync_exposed_s"]),
        rank_busy_s=tuple(col["busy_s"]),
        num_nonfinite=int(sum(col["nonfinite_part"])),
        rank_peak_memory_bytes=tuple(int(b) for b in col["peak_memory_bytes"]),
        rank_device_used_bytes=tuple(int(b) for b in col["device_used_bytes"]),
        rank_fwd_s=tuple(col["fwd_s"]), rank_bwd_s=tuple(col["bwd_s"]), rank_idle_s=tuple(col["idle_s"]),
    )


def step_record(step: int, stats: StepStats, iteration_time_s: float, tokens: int, lr: float,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One metrics line for the step of 0-based index ``step``; ``extra`` adds the data cursor, the split and any
    rebalancing decision. Its ``step`` is 1-based, as the console, the checkpoint folders and TensorBoard count
    (``step 1`` is the first step; a checkpoint ``step-000010`` holds the state after step 10)."""
    return {
        "step": step + 1,
        "loss": stats.loss,
        "tokens_per_s": tokens / iteration_time_s if iteration_time_s > 0 else 0.0,
        "iteration_time_s": iteration_time_s,
        "pipeline_compute_s": list(stats.pipeline_compute_s),
        "pipeline_idle_s": list(stats.pipeline_idle_s),
        "grad_sync_exposed_s": stats.grad_sync_exposed_s,
        "grad_norm": stats.grad_norm,
        "lr": lr,
        "peak_memory_bytes": list(stats.rank_peak_memory_bytes),
        "device_used_bytes": list(stats.rank_device_used_bytes),
        "rank_fwd_s": list(stats.rank_fwd_s),
        "rank_bwd_s": list(stats.rank_bwd_s),
        "rank_idle_s": list(stats.rank_idle_s),
        **(extra or {}),
    }


LOG_EVERY_S = 10.0  # piped runs: one console line at least this often (and after the last step)


def log_line(record: dict[str, Any], num_steps: int, predicted_step_s: float | None,
             capacity_bytes: Sequence[int] = ()) -> str:
    """One step as a plain console line: what a log file of a long run needs to be watched (as torchtitan
    prints: loss, grad norm, lr, memory, throughput, MFU). ``capacity_bytes``: each rank's device memory, for
    the fullest rank's share."""
    parts = [f"step {record['step']}/{num_steps}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("val_loss") is not None:
        parts.append(f"val loss {record['val_loss']:.4f}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm {record['grad_norm']:.3g}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.3g}")
    peaks = record.get("peak_memory_bytes") or []
    if peaks:
        fullest = max(range(len(peaks)), key=lambda r: peaks[r] / capacity_bytes[r] if capacity_bytes else peaks[r])
        share = (f" ({peaks[fullest] / capacity_bytes[fullest]:.0%} of rank {fullest}'s device)"
                 if capacity_bytes else "")
        parts.append(f"memory {peaks[fullest] / 2**30:.2f} GiB{share}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    step = f"step {record['iteration_time_s']:.3f} s"
    if predicted_step_s:
        step += f" (plan predicted {predicted_step_s:.3f} s)"
    parts.append(step)
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu']:.1%}")
    if record.get("loss_scale") is not None:
        parts.append(f"loss scale {record['loss_scale']:g}" + (" (skipped)" if record.get("skipped") else ""))
    return "  ".join(parts)


class MetricsWriter:
    """Rank 0's sink: JSON lines file (flushed per step) and an optional rich progress bar.

    A resumed run appends (``append``): the file keeps the lines of the run(s) before. A step that
    ran after the last checkpoint of a crashed attempt appears again when the resumed run redoes
    it; the later line is the one whose update the final weights contain.
    """

    def __init__(self, path: str | None, num_steps: int, progress: bool, append: bool = False,
                 log_every_s: float = LOG_EVERY_S, predicted_step_s: float | None = None,
                 interactive: bool | None = None, out: IO[str] | None = None, total_steps: int | None = None,
                 log_every_steps: int = 0, predicted_mfu: float | None = None, sinks: Sequence[Any] = (),
                 capacity_bytes: Sequence[int] = ()) -> None:
        """``sinks`` (dashboards) get every record; their owner closes them. ``capacity_bytes``: each rank's
        device memory (GPUs), for the console line's memory share."""
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w")  # noqa: SIM115 - closed in close()
        self._progress = None
        self._out = out if out is not None else sys.stdout
        interactive = self._out.isatty() if interactive is None else interactive
        # Piped (SLURM logs, `| tee`) a bar shows nothing until the end: one plain line every ``log_every_s``,
        # or every ``log_every_steps`` steps where asked (then on a terminal too, above the bar).
        self._lines = progress and (not interactive or log_every_steps > 0)
        self._num_steps, self._log_every_s, self._predicted_s = num_steps, log_every_s, predicted_step_s
        self._log_every_steps, self._predicted_mfu, self._sinks = log_every_steps, predicted_mfu, list(sinks)
        self._capacity = list(capacity_bytes)
        self._total = total_steps if total_steps is not None else num_steps  # a resumed run counts from its start
        self._last_line = -math.inf
        self._val_info = ""  # the bar keeps the last validation loss in view
        if progress and interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._progress.add_task("train", total=num_steps, info="")
            self._progress.start()

    def _due(self, now: float) -> bool:
        if len(self.records) == self._num_steps:
            return True
        if self._log_every_steps > 0:  # by the run's step (a resumed run keeps its rhythm)
            return int(self.records[-1]["step"]) % self._log_every_steps == 0
        return now - self._last_line >= self._log_every_s

    def write(self, record: dict[str, Any]) -> None:
        if self._predicted_s:  # the plan's prediction beside the measurement, and MFU from the same ratio
            record["predicted_step_s"] = self._predicted_s
            if self._predicted_mfu and record["iteration_time_s"] > 0:
                record["mfu"] = self._predicted_mfu * self._predicted_s / record["iteration_time_s"]
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for sink in self._sinks:
            sink.write(record)
        if self._progress is not None:
            info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
            if record.get("val_loss") is not None:
                self._val_info = f"  val loss {record['val_loss']:.4f} (step {record['step']})"
            info += self._val_info
            self._progress.update(self._task, advance=1, info=info)
        now = time.monotonic()
        if self._lines and (self._due(now) or record.get("val_loss") is not None):  # every validation is shown
            self._last_line = now
            line = log_line(record, self._total, self._predicted_s, self._capacity)
            if self._progress is not None:
                self._progress.console.print(line, highlight=False, markup=False)
            else:
                print(line, file=self._out, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._progress is not None:
            self._progress.stop()


def write_chrome_trace(path: str | Path, events_by_rank: list[list[tuple[str, float, float]]],
                       labels: list[str]) -> None:
    """Chrome/Perfetto trace: one track (tid) per rank in process 0, complete ("X") events in µs
    from the earliest event. The simulator writes the same layout from its predictions."""
    starts = [start for evs in events_by_rank for _, start, _ in evs]
    origin = min(starts) if starts else 0.0
    trace: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "ethpipe run"}}]
    for rank, label in enumerate(labels):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": label}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
    for rank, events in enumerate(events_by_rank):
        for name, start, end in events:
            trace.append({"name": name, "ph": "X", "pid": 0, "tid": rank, "ts": (start - origin) * 1e6,
                          "dur": max(0.0, end - start) * 1e6, "cat": name.split(" ")[0].rstrip("0123456789")})
    write_text_atomic(Path(path), json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}) + "\n")


def write_trace(plan: Plan, path: str, events: list[tuple[str, float, float]], rank: int,
                group: dist.ProcessGroup | None) -> None:
    """Every rank's trace events to rank 0 (one gather at the end of a run), written there as one Chrome trace."""
    gathered: list[Any] | None = [None] * plan.world_size if rank == 0 else None
    dist.gather_object(events, gathered, dst=0, group=group)
    if gathered is not None:
        labels = []
        for r in range(plan.world_size):
            p = plan.position_of(r)
            device = plan.pipelines[p.pipeline].stages[p.stage].device
            labels.append(f"rank {r} (pipeline {p.pipeline} stage {p.stage}, {device})")
        write_chrome_trace(path, gathered, labels)
