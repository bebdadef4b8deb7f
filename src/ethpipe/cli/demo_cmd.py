"""`ethpipe demo`: ETH vs uniform vs layer-balanced, planned, simulated and really trained on this CPU.

Six local processes emulate a mixed cluster (2 fast + 4 slow devices, ``ethpipe/data/cpu_demo.yaml``).
The demo profiles this CPU, plans the tiny model with each method, trains each plan on real
text with ``--emulate`` and prints measured against predicted step times. Everything goes to a
temporary directory first and is moved to ``--out`` only when the whole demo succeeded.
"""

from __future__ import annotations

import json
import math
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ethpipe.plan_text import plan_shape
from ethpipe.cli.app import app, console, heading, user_errors
from ethpipe.errors import UserError

MODEL, GLOBAL_BATCH, SEQ_LEN = "tiny", 24, 128
QUICK_SEQ_LEN = 64  # --quick: half the compute per step
PROFILE_SIZES = (1, 2, 4)
DEMO_LR = 1e-3


def _settings(steps: Optional[int], baseline_steps: Optional[int], quick: bool) -> tuple[int, int]:
    main = steps if steps is not None else (4 if quick else 30)
    base = baseline_steps if baseline_steps is not None else (2 if quick else max(4, main // 3))
    if main < 2 or base < 2:
        raise UserError(f"--steps and --baseline-steps must be at least 2, got {main} and {base}")
    return main, base


def _loss_line(losses: list[float]) -> str:
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
    return "  ".join(f"step {i + 1}: {losses[i]:.3f}" for i in marks)  # 1-based, as training prints them


def _machine() -> str:
    from ethpipe.runtime.adapt.emulate import local_cores

    return f"{platform.platform()}, {local_cores()} cores, python {platform.python_version()}"


def _timeline(plan: Any, trace_path: Path, png: Path, title: str) -> None:
    """Gantt chart of the last measured step, pipelines grouped like the simulator's."""
    from ethpipe.demo import last_step_events
    from ethpipe.sim.timeline import draw_timeline
    from ethpipe.sim.trace import Trace, TraceEvent, rank_thread_name, read_trace

    measured = read_trace(trace_path)
    by_rank: dict[int, list[TraceEvent]] = {}
    for e in measured.events:
        by_rank.setdefault(e.tid, []).append(e)
    events, threads = [], {}
    for rank, evs in last_step_events(by_rank).items():
        pos = plan.position_of(rank)
        device = plan.pipelines[pos.pipeline].stages[pos.stage].device
        threads[(pos.pipeline, rank)] = rank_thread_name((rank,), device)
        events += [TraceEvent(e.name, e.cat, pos.pipeline, rank, e.start_s, e.dur_s, e.args) for e in evs]
    names = {p: f"pipeline {p}" for p in range(len(plan.pipelines))}
    draw_timeline(Trace(tuple(events), names, threads, {"source": "measured"}), png, title=title)


@app.command()
@user_errors
def demo(
    steps: Annotated[Optional[int], typer.Option(
        "--steps", help="Training steps of the ETH plan [default: 30; 4 with --quick].")] = None,
    baseline_steps: Annotated[Optional[int], typer.Option(
        "--baseline-steps",
        help="Steps of the uniform and layer-balanced plans [default: steps/3, at least 4; 2 with --quick].")] = None,
    out: Annotated[Optional[Path], typer.Option(
        "--out", help="Keep plans, metrics, traces, timeline PNGs and demo.json here.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A short run (a smoke test, ~30 s).")] = False,
) -> None:
    """Plan, simulate and really train the tiny model on an emulated mixed cluster of 6 local CPU
    processes (2 fast + 4 slow devices) with the ETH, uniform and layer-balanced plans, and
    compare measured step times with the simulator's predictions."""
    main_steps, base_steps = _settings(steps, baseline_steps, quick)
    if out is not None and out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' exists and is not a directory: give a directory")
    with tempfile.TemporaryDirectory(prefix="ethpipe-demo-") as tmp:
        seq_len = QUICK_SEQ_LEN if quick else SEQ_LEN
        result = _run(Path(tmp), main_steps, base_steps, seq_len, quick, save=out is not None)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            for path in sorted(Path(tmp).iterdir()):
                if path.name.startswith("tokens.bin"):
                    continue
                shutil.move(str(path), out / path.name)
            console.print(f"wrote plans, metrics, traces, timeline PNGs and demo.json to {out}/")
    console.print(f"ETH measured speed-up: {result['speedup']['uniform']:.2f}x over uniform, "
                  f"{result['speedup']['layer-balanced']:.2f}x over layer-balanced")


def _run(tmp: Path, main_steps: int, base_steps: int, seq_len: int, quick: bool, save: bool) -> dict[str, Any]:
    from ethpipe import demo as d
    from ethpipe.model_load import load_model_spec
    from ethpipe.tokens.texts import builtin_text, prepare_tokens
    from ethpipe.runtime.start.launch import run_local
    from ethpipe.runtime.train import TrainConfig

    heading("[bold]ethpipe demo[/]: ETH vs uniform vs layer-balanced on an emulated mixed cluster")
    spec, cluster = load_model_spec(MODEL), d.demo_cluster()
    speeds = d.cluster_speeds(cluster, spec, seq_len)
    scale = d.cluster_time_scale(cluster, speeds)
    counts: dict[str, int] = {}
    for dev in cluster.devices:
        counts[dev.gpu.id] = counts.get(dev.gpu.id, 0) + 1
    console.print("cluster: " + ", ".join(f"{n} x {t} (speed {speeds[t]:.2f})" for t, n in counts.items())
                  + f", {cluster.devices[0].gpu.memory_gib * 1024:.0f} MiB each; every device is a local process")
    console.print(f"emulation: each forward/backward is paced to the profiled time x {scale:.1f} / speed "
                  f"(time scale {scale:.1f} keeps {len(cluster.devices)} processes off each other's cores)")
    data = tmp / "tokens.bin"
    with console.status("preparing real text offline (docstrings of Python's standard library)"):
        num_tokens = prepare_tokens(builtin_text(200_000 if quick else 600_000), data)
    console.print(f"data: {num_tokens:,} byte-level tokens of real English text")
    with console.status(f"profiling {MODEL} on this CPU (one thread)"):
        profile = d.measure_profile(spec, seq_len, PROFILE_SIZES, rounds=2, repeats=3 if quick else 5)
    block = profile.layers["block"][1]
    console.print(f"profile: {profile.device_name}; one decoder block at micro-batch 1: "
                  f"{block.fwd_s * 1e3:.2f} ms forward, {block.bwd_s * 1e3:.2f} ms backward")
    profiles = d.emulated_profiles(profile, speeds, scale)
    plans = d.make_plans(cluster, spec, GLOBAL_BATCH, seq_len, profiles, scale)
    cost = d.emulated_cost(cluster, spec, seq_len, profiles)
    rows: dict[str, dict[str, Any]] = {}
    for method, plan in plans.items():
        n = main_steps if method == "eth" else base_steps
        pred = d.predict(plan, cost)
        # The plan's [...] is text, not markup; one line whatever the terminal's width, for logs and greps.
        console.print(f"\n[bold]{method}[/] plan: {escape(plan_shape(plan))}", soft_wrap=True)
        console.print(f"training {n} steps on {plan.world_size} processes "
                      f"(predicted {pred.simulated_s * 1e3:.0f} ms/step)")
        config = TrainConfig(
            data=str(data), steps=n, lr=DEMO_LR, emulate=True, device="cpu", progress=True,
            metrics=str(tmp / f"metrics-{method}.jsonl") if save else None,
            trace=str(tmp / f"trace-{method}.json") if save else None,
        )
        records = run_local(plan, config)
        losses = [float(r["loss"]) for r in records]
        console.print(f"loss {_loss_line(losses)}")
        measured = d.measured_step_s(records)
        rows[method] = {
            "plan": plan_shape(plan), "steps": n, "losses": losses,
            "measured_step_s": measured, "tokens_per_s": GLOBAL_BATCH * seq_len / measured,
            "simulated_step_s": pred.simulated_s, "estimate_step_s": pred.estimate_s,
            "error": (pred.simulated_s - measured) / measured,
            "step_times_s": [float(r["iteration_time_s"]) for r in records],
        }
        if save:
            plan.save(tmp / f"plan-{method}.json")
            _timeline(plan, tmp / f"trace-{method}.json", tmp / f"timeline-{method}.png",
                      f"{method}: last measured step ({measured * 1e3:.0f} ms median)")
    result = _summary(rows, scale, speeds, profile.device_name, seq_len)
    _print_table(rows, result)
    if save:
        (tmp / "demo.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _summary(rows: dict[str, dict[str, Any]], scale: float, speeds: dict[str, float], device: str,
             seq_len: int) -> dict[str, Any]:
    eth = rows["eth"]["measured_step_s"]
    common = min(r["steps"] for r in rows.values()) - 1
    spread = max(abs(r["losses"][common] - rows["eth"]["losses"][common]) for r in rows.values())
    return {
        "command": "ethpipe " + " ".join(sys.argv[1:]) if sys.argv else "ethpipe demo",
        "machine": _machine(), "model": MODEL, "global_batch_size": GLOBAL_BATCH, "seq_len": seq_len,
        "time_scale": scale, "device_speeds": speeds, "profile_device": device,
        "methods": rows,
        "speedup": {m: r["measured_step_s"] / eth for m, r in rows.items() if m != "eth"},
        "predicted_speedup": {m: r["simulated_step_s"] / rows["eth"]["simulated_step_s"]
                              for m, r in rows.items() if m != "eth"},
        "loss_spread_at_common_step": {"step": common, "max_abs_diff": spread},
    }


def _print_table(rows: dict[str, dict[str, Any]], result: dict[str, Any]) -> None:
    table = Table(title=f"{MODEL}, batch {GLOBAL_BATCH} x {result['seq_len']} tokens, 2 fast + 4 slow emulated devices")
    for col in ("method", "steps", "tok/s", "step ms", "sim. ms", "error", "ETH gain", "final loss"):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for method, r in rows.items():
        gain = "-" if method == "eth" else f"{result['speedup'][method]:.2f}x"
        table.add_row(method, str(r["steps"]), f"{r['tokens_per_s']:,.0f}", f"{r['measured_step_s'] * 1e3:.0f}",
                      f"{r['simulated_step_s'] * 1e3:.0f}", f"{r['error'] * 100:+.1f}%", gain, f"{r['losses'][-1]:.3f}")
    console.print()
    console.print(table)
    console.print("step ms: measured median step time; sim. ms: the simulator's prediction from this CPU's profile; "
                  "error: (sim - measured) / measured; ETH gain: the method's step time / ETH's")
    common = result["loss_spread_at_common_step"]
    ok = "identical" if common["max_abs_diff"] < 1e-4 and math.isfinite(common["max_abs_diff"]) else "DIFFERENT"
    console.print(f"losses at step {common['step']} are {ok} across plans (max difference "
                  f"{common['max_abs_diff']:.1e}): every plan trains the same model, exactly")
