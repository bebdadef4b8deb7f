"""`ethpipe simulate` and `ethpipe profile` (simulator, timelines and measured profiles)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ethpipe.units import index_ranges
from ethpipe.plan_text import micro_batches_text, pipeline_groups, pipeline_text
from ethpipe.cli.app import app, console, user_errors
from ethpipe.errors import UserError



def load_profiles(paths: list[Path], as_types: list[str]) -> dict[str, object] | None:
    """Pair each ``--profile`` with its ``--profile-as`` device type (in order)."""
    from ethpipe.cost.profile import load_profile

    if not paths and not as_types:
        return None
    if len(paths) != len(as_types):
        raise UserError(
            f"got {len(paths)} --profile and {len(as_types)} --profile-as: give one --profile-as TYPE per --profile"
        )
    if len(set(as_types)) != len(as_types):
        raise UserError("--profile-as names a device type twice: give one profile per device type")
    return {t: load_profile(p) for p, t in zip(paths, as_types)}


@app.command()
@user_errors
def simulate(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="plan JSON written by `ethpipe plan`")],
    trace: Annotated[Path | None, typer.Option(help="write a Chrome/Perfetto trace JSON here")] = None,
    timeline: Annotated[Path | None, typer.Option(help="write a Gantt-chart PNG here")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON on stdout")] = False,
    flat_sync: Annotated[bool, typer.Option(help="sync all gradients after the slowest pipeline flushes")] = False,
    profile: Annotated[list[Path] | None, typer.Option(help="measured profile (repeatable)")] = None,
    profile_as: Annotated[list[str] | None, typer.Option(help="plan device type of each --profile")] = None,
    catalog: Annotated[Path | None, typer.Option(
        "--catalog", help="re-price with these compute constants (`ethpipe calibrate --out`) instead of the ones "
                          "the plan records")] = None,
) -> None:
    """Replay one training iteration of a plan event by event and report where the time goes."""
    import dataclasses

    from ethpipe.cost.hardware import load_calibration
    from ethpipe.cost.model import CostModel
    from ethpipe.plan import Plan
    from ethpipe.sim import simulate as run_simulation
    from ethpipe.sim.timeline import draw_timeline
    from ethpipe.sim.trace import trace_from_report, write_trace

    plan = Plan.load(plan_path)
    cost = CostModel.for_plan(plan, profiles=load_profiles(profile or [], profile_as or []))  # type: ignore[arg-type]
    if catalog is not None:
        cost = dataclasses.replace(cost, calibration=load_calibration(catalog))
    report = run_simulation(plan, cost, flat_sync=flat_sync)
    if trace is not None or timeline is not None:
        sim_trace = trace_from_report(plan, report)
        if trace is not None:
            write_trace(trace, sim_trace)
        if timeline is not None:
            mode = "flat sync" if flat_sync else "block-wise sync"
            title = (f"{plan_path.name}: {plan.method}, {plan.world_size} ranks, {len(plan.pipelines)} pipelines, "
                     f"{mode}: iteration {report.iteration_time_s * 1e3:.2f} ms")
            draw_timeline(sim_trace, timeline, title=title)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    _print_report(plan, report)


def _print_report(plan: object, report: object) -> None:
    from ethpipe.plan import Plan
    from ethpipe.sim.report import SimReport

    assert isinstance(plan, Plan) and isinstance(report, SimReport)
    console.print(f"iteration time  {report.iteration_time_s * 1e3:.3f} ms   ({report.tokens_per_s:,.0f} tokens/s)")
    predicted = (plan.predicted or {}).get("iteration_time_s")
    if isinstance(predicted, (int, float)) and predicted > 0:
        err = (report.iteration_time_s - predicted) / predicted * 100
        console.print(f"planner estimate {predicted * 1e3:.3f} ms   (simulator {err:+.1f}%)")
    console.print(f"exposed gradient sync {report.exposed_comm_s * 1e3:.3f} ms "
                  f"({'flat' if report.flat_sync else 'block-wise'})")
    if plan.idle_devices:
        console.print(f"{len(plan.idle_devices)} cluster devices idle (no rank, not simulated): "
                      f"{plan.idle_devices[0].reason}", highlight=False)
    if plan.cluster is not None:  # where each rank runs (what `ethpipe launch` starts on which node)
        from ethpipe.cli.plan_lines import nodes_line

        console.print(nodes_line(plan), highlight=False)
    groups = pipeline_groups(plan.pipelines)
    pipes = Table("pipelines", "stages", "samples each", "micro-batches", "flush (ms)", title="pipelines",
                  caption="identical pipelines share a row (flush: the slowest of them)")
    for indices, pipe in groups:
        pipes.add_row(index_ranges(indices), pipeline_text(pipe), str(pipe.num_samples), micro_batches_text(pipe),
                      f"{max(report.pipeline_flush_s[p] for p in indices) * 1e3:.3f}")
    console.print(pipes)
    ranks = Table("ranks", "pipelines", "stage", "device", "busy %", "bubble ms", "sync wait ms", "memory GiB",
                  title="ranks", caption="the stage's ranks of a pipeline group: mean busy, worst bubble, wait, memory")
    it = report.iteration_time_s or 1.0
    at: dict[tuple[int, int], list[Any]] = {}  # (pipeline, stage) -> its ranks' reports, in one pass
    for r in report.ranks:
        at.setdefault((r.pipeline, r.stage), []).append(r)
    for indices, pipe in groups:
        for s in range(pipe.depth):
            members = [r for p in indices for r in at[(p, s)]]
            ranks.add_row(index_ranges([r.rank for r in members]), index_ranges(indices), str(s), members[0].device,
                          f"{100 * sum(r.busy_s for r in members) / len(members) / it:.1f}",
                          f"{max(r.bubble_s for r in members) * 1e3:.3f}",
                          f"{max(r.sync_wait_s for r in members) * 1e3:.3f}",
                          f"{max(r.peak_memory_bytes for r in members) / 2**30:.2f}")
    console.print(ranks)
    busy = sum(r.busy_s for r in report.ranks) / (len(report.ranks) * (report.iteration_time_s or 1.0))
    console.print(f"mean busy {100 * busy:.1f}%; critical path: {len(report.critical_path)} events, "
                  f"ends with {', '.join(e.name for e in report.critical_path[-3:])}")


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise UserError(f"--micro-batch-sizes must be comma-separated positive integers like 1,2,4, got '{text}'")
    return sizes


@app.command("profile")
@user_errors
def profile_cmd(
    model: Annotated[str, typer.Option(help="model preset name or spec file")],
    seq_len: Annotated[int, typer.Option(help="sequence length to profile at")],
    out: Annotated[Path, typer.Option(help="where to write the profile JSON")],
    micro_batch_sizes: Annotated[str, typer.Option(help="comma-separated, e.g. 1,2,4")] = "1,2,4",
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16")] = "fp32",
    repeats: Annotated[int, typer.Option(help="timed repeats (the median is kept)")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed warm-up runs")] = 2,
    threads: Annotated[int, typer.Option(help="torch compute threads (the CPU runtime uses 1 per rank)")] = 1,
    tf32: Annotated[bool, typer.Option("--tf32/--no-tf32", help="cuda fp32: matmuls on TF32 tensor cores (as a "
                                                                "default plan runs them); recorded")] = True,
    attention: Annotated[str, typer.Option(help="auto (SDPA's fused kernels, the runtime's default) or "
                                                "materialised (SDPA's math path); recorded")] = "auto",
) -> None:
    """Measure per-layer forward/backward times and memory on this machine for `plan --profile`."""
    from ethpipe.model_load import load_model_spec
    from ethpipe.profiler import ProfileSettings, profile_model

    spec = load_model_spec(model)
    settings = ProfileSettings(seq_len=seq_len, micro_batch_sizes=_parse_sizes(micro_batch_sizes), device=device,
                               dtype=dtype, repeats=repeats, warmup=warmup, num_threads=threads, tf32=tf32,
                               attention=attention)
    with console.status(f"profiling {spec.name} at seq_len {seq_len} on {device}"):
        result = profile_model(spec, settings)
    result.save(out)
    table = Table("layer", "micro-batch", "fwd ms", "bwd ms", "activations MiB", title=result.device_name)
    for kind, points in result.layers.items():
        for b, t in sorted(points.items()):
            mem = result.peak_memory_bytes.get(kind, {}).get(b, 0)
            table.add_row(kind, str(b), f"{t.fwd_s * 1e3:.3f}", f"{t.bwd_s * 1e3:.3f}", f"{mem / 2**20:.2f}")
    console.print(table)
    console.print(f"optimizer {result.optimizer_s_per_param * 1e9:.3f} ns/param; wrote {out}")
