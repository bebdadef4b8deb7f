"""Chrome / Perfetto trace JSON: written from simulations and from real runs, read back by both.

One format for predicted and measured timelines, so they can be opened side by side in
https://ui.perfetto.dev or chrome://tracing and compared by ``read_trace``. Layout: one
process per pipeline (``pid`` = pipeline index), one thread per rank (``tid`` = rank; a tp>1
stage is one thread named after its ranks), complete events (``"ph": "X"``, microseconds)
with ``cat`` one of compute|p2p|allreduce|optimizer. A rank's slices never overlap (receives
are blocking and sync follows the last backward), so every track is well nested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ethpipe.errors import UserError
from ethpipe.plan import Plan, write_text_atomic
from ethpipe.sim.report import SimReport

CATEGORIES = ("compute", "p2p", "allreduce", "optimizer", "allgather")
_US = 1e6


@dataclass(frozen=True)
class TraceEvent:
    name: str  # "F3", "B3", "recv F3", "allreduce block 2", "optimizer"
    cat: str  # one of CATEGORIES
    pid: int  # pipeline
    tid: int  # rank (the first rank of a tp>1 stage)
    start_s: float
    dur_s: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]
    process_names: dict[int, str]  # pid -> "pipeline 0"
    thread_names: dict[tuple[int, int], str]  # (pid, tid) -> "rank 3 (a100_80gb_sxm)"
    other: dict[str, Any] = field(default_factory=dict)  # e.g. {"source": "simulated", "iteration_time_s": ...}

    @property
    def span_s(self) -> float:
        """From the first event's start to the last event's end."""
        if not self.events:
            return 0.0
        return max(e.end_s for e in self.events) - min(e.start_s for e in self.events)


def rank_thread_name(ranks: tuple[int, ...], device: str) -> str:
    """Track label shared by the simulator and the runtime: 'rank 3 (a100)' / 'ranks 0-7 (h100, tp=8)'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]} ({device})"
    return f"ranks {ranks[0]}-{ranks[-1]} ({device}, tp={len(ranks)})"


def trace_from_report(plan: Plan, report: SimReport) -> Trace:
    """The simulated iteration as a Trace (threads labelled exactly like the runtime's)."""
    process_names = {p: f"pipeline {p}" for p in range(len(plan.pipelines))}
    thread_names: dict[tuple[int, int], str] = {}
    for p, pipe in enumerate(plan.pipelines):
        for stage in pipe.stages:
            thread_names[(p, stage.ranks[0])] = rank_thread_name(stage.ranks, stage.device)
    events = []
    for e in report.events:
        args: dict[str, Any] = {"stage": e.stage}
        if e.microbatch >= 0:
            args["microbatch"] = e.microbatch
        if e.block >= 0:
            args["block"] = e.block
        events.append(TraceEvent(e.name, e.kind, e.pipeline, e.ranks[0], e.start_s, e.dur_s, args))
    other = {"source": "simulated", "iteration_time_s": report.iteration_time_s, "flat_sync": report.flat_sync}
    return Trace(tuple(events), process_names, thread_names, other)


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for pid, name in sorted(trace.process_names.items()):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (pid, tid), name in sorted(trace.thread_names.items()):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for e in trace.events:
        out.append({
            "name": e.name, "ph": "X", "cat": e.cat, "pid": e.pid, "tid": e.tid,
            "ts": round(e.start_s * _US, 3), "dur": round(e.dur_s * _US, 3), "args": e.args,
        })
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": trace.other}


def write_trace(path: str | Path, trace: Trace) -> None:
    """Atomic write (compact JSON: large plans make large traces)."""
    write_text_atomic(Path(path), json.dumps(trace_to_dict(trace), separators=(",", ":")) + "\n")


def read_trace(path: str | Path) -> Trace:
    """Load a predicted or measured trace; one-line UserError on anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"trace file '{path}' not found: write one with `ethpipe simulate PLAN --trace {path}`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"trace file '{path}' is not valid JSON: {err}") from None
    return trace_from_dict(data, str(path))


def trace_from_dict(data: Any, where: str = "trace") -> Trace:
    raw = data.get("traceEvents") if isinstance(data, dict) else data  # the bare-array form is legal too
    if not isinstance(raw, list):
        raise UserError(f"{where}: field 'traceEvents' must be a list of events")
    events: list[TraceEvent] = []
    process_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    for i, ev in enumerate(raw):
        try:
            ph = ev["ph"]
            if ph == "M" and ev["name"] == "process_name":
                process_names[int(ev["pid"])] = str(ev["args"]["name"])
            elif ph == "M" and ev["name"] == "thread_name":
                thread_names[(int(ev["pid"]), int(ev["tid"]))] = str(ev["args"]["name"])
            elif ph == "X":
                events.append(TraceEvent(
                    str(ev["name"]), str(ev.get("cat", "")), int(ev["pid"]), int(ev["tid"]),
                    float(ev["ts"]) / _US, float(ev["dur"]) / _US, dict(ev.get("args", {})),
                ))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"{where}: traceEvents[{i}] is malformed (missing or bad {err})") from None
    other = data.get("otherData", {}) if isinstance(data, dict) else {}
    return Trace(tuple(events), process_names, thread_names, dict(other) if isinstance(other, dict) else {})
