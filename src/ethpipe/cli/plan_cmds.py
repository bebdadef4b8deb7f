"""`ethpipe plan`, `ethpipe compare`, `ethpipe catalog`: the planner's command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ethpipe.atomic import atomic_path
from ethpipe.cli.app import app, console, user_errors
from ethpipe.cli.plan_lines import idle_lines, nodes_line, reduce_bound_line, sharding_line, sublayer_line
from ethpipe.cli.run_config import config_option
from ethpipe.plan_text import micro_batches_text, pipeline_groups, pipeline_text
from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.precision import canonical_dtype
from ethpipe.units import index_ranges

UNSHARDED = "eth (no ZeRO)"  # compare's row: eth planned with --no-shard-optimizer
ONE_F_ONE_B = "eth 1F1B only"  # compare's row: eth planned with --schedules 1f1b

ClusterOpt = Annotated[Path, typer.Option("--cluster", help="Cluster spec (YAML or JSON).")]
ModelOpt = Annotated[str, typer.Option("--model", help="Preset name, spec YAML, or HF config.json.")]
BatchOpt = Annotated[int, typer.Option("--global-batch", help="Samples per iteration.")]
SeqOpt = Annotated[int, typer.Option("--seq-len", help="Tokens per sample.")]
TpOpt = Annotated[int, typer.Option("--max-tp", help="Largest tensor-parallel degree the planner may choose (within a "
                                                     "node; 1: pipelines and data parallelism only).")]
RecomputeOpt = Annotated[str, typer.Option("--recompute", help="auto | never | always.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", callback=canonical_dtype,
                                       help="Training precision the plan is priced for: auto (bf16 where every device "
                                            "the plan runs on has it, else fp16) | bf16 | fp16 | fp32 (torch's "
                                            "spellings too: bfloat16, float16, float32; match `ethpipe train --dtype`).")]
ProfileOpt = Annotated[Optional[list[Path]], typer.Option("--profile", help="Measured profile (repeatable).")]
ProfileAsOpt = Annotated[Optional[list[str]], typer.Option("--profile-as", help="Device type of each --profile.")]
Tf32Opt = Annotated[bool, typer.Option("--tf32/--no-tf32", help="fp32 plans: matmuls on TF32 tensor cores where the "
                                                            "GPU has them (PyTorch/Megatron training default: on).")]
AttentionOpt = Annotated[str, typer.Option("--attention", help="auto (the fused kernels PyTorch SDPA runs: flash or "
                                                             "memory-efficient) | materialised (the unfused s x s "
                                                             "scores of a Megatron-style runtime).")]
GradReduceOpt = Annotated[str, typer.Option(
    "--grad-reduce", help="What the block gradient sync sums in: fp32 (default) | bf16 (half the sync's bytes, one "
                          "bf16 copy of each synced gradient in memory, each sum within (P + 1) 2^-8 of its P "
                          "terms' absolute sum: docs/runtime.md).")]
SchedulesOpt = Annotated[Optional[str], typer.Option(
    "--schedules", help="Pipeline schedules each pipeline may run, comma-separated: 1f1b, zb-h1 (zero-bubble H1: "
                        "weight gradients deferred into the bubble), interleaved (2-4 model chunks per stage, the fastest; a "
                        "pipeline that cannot interleave keeps 1f1b). Default: all for eth, 1f1b for the baselines.")]
CatalogOpt = Annotated[Optional[Path], typer.Option("--catalog", help="Calibrated constants from `ethpipe calibrate "
                                                                     "--out` (over the shipped ones).")]
GIB = 2**30


def _inputs(cluster: Path, model: str, profile: list[Path] | None, profile_as: list[str] | None):
    from ethpipe.cluster import load_cluster
    from ethpipe.cost.profile import load_profile
    from ethpipe.model_load import load_model_spec

    profile, profile_as = profile or [], profile_as or []
    if len(profile) != len(profile_as):
        raise UserError(f"--profile given {len(profile)} times but --profile-as {len(profile_as)} times: pair each "
                        "profile with the device type it measures")
    spec, clu = load_model_spec(model), load_cluster(cluster)
    paths = dict(zip(profile_as, profile))  # a type given twice: its last profile, as before
    loaded = {t: load_profile(path) for t, path in paths.items()}
    for (t, prof), path in zip(loaded.items(), paths.values()):
        if prof.layer_code == "ethpipe_fp32_rope" and prof.dtype in ("bf16", "fp16"):
            console.print(f"note: profile '{path}' ({t}) was measured before RoPE rotated in the compute dtype: its "
                          "16-bit layer times are slower than this runtime's; re-run `ethpipe profile` for exact prices",
                          highlight=False)
    return clu, spec, loaded or None


def parse_schedules(text: str | None) -> tuple[str, ...] | None:
    """``--schedules a,b`` -> ("a", "b"); None: the method's default (``make_plan`` checks the names)."""
    if text is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise UserError("--schedules needs at least one schedule: e.g. --schedules 1f1b,zb-h1")
    return names


def _summary(plan: Any) -> Table:
    pred = plan.predicted
    mem = {d["rank"]: d for d in pred["devices"]}
    table = Table(title=f"{plan.method} plan: {plan.model}, batch {plan.global_batch_size} x {plan.seq_len} tokens",
                  caption="stage: device[ tpT] Lfirst-last layer (* = recompute; 7a / 7m: layer 7's attention / MLP half); "
                          "identical pipelines share a row")
    for col in ("pipelines", "stages", "samples each", "micro-batches", "schedule", "time s", "min headroom"):
        table.add_column(col, justify="left" if col == "stages" else "right")
    times = pred["pipeline_times_s"]
    for indices, pipe in pipeline_groups(plan.pipelines):
        head = min(1 - mem[r]["memory_bytes"] / mem[r]["memory_capacity_bytes"] for p in indices
                   for r in plan.pipelines[p].ranks)
        t = max(times[p] for p in indices)
        table.add_row(index_ranges(indices), pipeline_text(pipe), str(pipe.num_samples), micro_batches_text(pipe),
                      pipe.schedule, f"{t:.3f}", f"{100 * head:.0f}%")
    return table


def _metrics_line(plan: Any) -> str:
    p = plan.predicted
    return (f"iteration {p['iteration_time_s']:.3f} s  |  {p['tokens_per_s']:,.0f} tokens/s  |  balance efficiency "
            f"{p['balance_efficiency']:.3f}  |  MFU {p['mfu']:.3f}  |  grad sync exposed {p['grad_sync_exposed_s']:.3f} s"
            f"  |  planned in {p['planning_time_s']:.3f} s")


def partly_profiled_line(cluster: Any, profiles: dict[str, Any] | None) -> str | None:
    """Profiles for some device types and the analytic model for the others are two different yardsticks: a
    CPU profile beside analytic GPUs makes the profiled type look slow and leaves it idle. Say so."""
    if not profiles:
        return None
    rest = [t for t in cluster.gpu_types if t not in profiles]
    if not rest:
        return None
    return (f"note: {', '.join(sorted(profiles))} priced from --profile, {', '.join(rest)} from the analytic model: "
            f"their speeds are compared across two yardsticks; profile {'it' if len(rest) == 1 else 'each'} on its "
            f"device (`ethpipe profile --device cuda ...`) and pass --profile FILE --profile-as "
            f"{rest[0]}{' (one pair per type)' if len(rest) > 1 else ''}")


@app.command()
@user_errors
def plan(ctx: typer.Context, cluster: ClusterOpt, model: ModelOpt, global_batch: BatchOpt, seq_len: SeqOpt,
         method: Annotated[str, typer.Option("--method", help="eth | uniform | layer-balanced.")] = "eth",
         max_tp: TpOpt = 8, recompute: RecomputeOpt = "auto", profile: ProfileOpt = None, profile_as: ProfileAsOpt = None,
         dtype: DtypeOpt = "auto", tf32: Tf32Opt = True, catalog: CatalogOpt = None, attention: AttentionOpt = "auto",
         robust: Annotated[bool, typer.Option("--robust", help="eth: of the best few candidates, the one with the "
                                                              "best worst case under +-30% per-type speed "
                                                              "(data re-split allowed).")] = False,
         shard_optimizer: Annotated[bool, typer.Option(
             "--shard-optimizer/--no-shard-optimizer",
             help="eth: also plan with the AdamW state sharded across pipelines (ZeRO-1) and keep it where that "
                  "is faster; --no-shard-optimizer: every rank keeps its stage's whole state.")] = True,
         schedules: SchedulesOpt = None, grad_reduce: GradReduceOpt = "fp32",
         no_idle: Annotated[bool, typer.Option("--no-idle", help="Use every device, also where the planner would "
                                                                "leave some idle (docs/plan-format.md, \"Idle "
                                                                "devices\").")] = False,
         sublayer_cuts: Annotated[bool, typer.Option(
             "--sublayer-cuts/--no-sublayer-cuts",
             help="eth: let a stage end between a layer's attention and its MLP where that is faster (printed "
                  "L7m-11a); --no-sublayer-cuts: whole layers only.")] = True,
         out: Annotated[Optional[Path], typer.Option("--out", help="Write the plan JSON here.")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="Print the plan JSON instead of the table.")] = False,
         config_file: Annotated[Optional[Path], config_option(annotated=True)] = None,
         ) -> None:
    """Plan a training iteration and print (or write) the plan."""
    from ethpipe.cost.hardware import load_calibration
    from ethpipe.planner import PlannerOptions, make_plan

    clu, spec, profiles = _inputs(cluster, model, profile, profile_as)
    calibration = load_calibration(catalog)

    def planned(reduce: str) -> Plan:
        return make_plan(clu, spec, global_batch, seq_len, method, max_tp=max_tp, profiles=profiles,
                         recompute=recompute, dtype=dtype, tf32=tf32, calibration=calibration,
                         robust=robust, attention=attention, shard_optimizer=shard_optimizer,
                         schedules=parse_schedules(schedules),
                         options=PlannerOptions(allow_idle=not no_idle, sublayer_cuts=sublayer_cuts),
                         grad_reduce=reduce)

    result = planned(grad_reduce)
    if grad_reduce != "fp32":  # an opt-in lever: say whether it pays here (the fp32 plan, planned the same way)
        fp32_s = planned("fp32").predicted["iteration_time_s"]
        search = {**(result.extra.get("search") or {}), "grad_reduce": {"fp32_iteration_s": fp32_s}}
        result = dataclasses.replace(result, extra={**result.extra, "search": search})
    if out is not None:
        result.save(out)
    if as_json:
        print(result.to_json())
        return
    console.print(_summary(result))
    console.print(_metrics_line(result))
    if result.predicted.get("mfu", 0.0) > 1.0:  # measured faster than the stated peak: the peak is the wrong one
        console.print("MFU above 1: the devices ran faster (profiles) than the cluster file's peak_tflops allow; "
                      "write their real dense 16-bit peak there", highlight=False)
    for line in idle_lines(result):
        console.print(line, highlight=False)
    console.print(sharding_line(result), highlight=False)
    if grad_reduce != "fp32":
        console.print(reduce_bound_line(result), highlight=False)
    console.print(nodes_line(result), highlight=False)
    cuts = sublayer_line(result)
    if cuts:
        console.print(cuts, highlight=False)
    factors = result.predicted.get("efficiency_factors")
    if factors:
        from ethpipe.planner.efficiency import format_factors

        console.print(f"balance efficiency = product of: {format_factors(factors)}", highlight=False)
    if "worst_case_time_s" in result.predicted:
        console.print(f"worst case {result.predicted['worst_case_time_s']:.3f} s ({result.predicted['worst_scenario']}, "
                      "data re-split allowed)", highlight=False)
    for note in (result.extra.get("compute_model") or {}).get("devices", {}).values():
        console.print(f"compute model: {note}", highlight=False)
    search = result.extra.get("search") or {}
    if "interleaved" in (search.get("schedules") or []):
        for kept in search.get("kept_schedule") or []:
            console.print(f"pipelines {index_ranges(kept['pipelines'])} kept {kept['schedule']}, not interleaved: "
                          f"{kept['reason']}", highlight=False)
    note = partly_profiled_line(clu, profiles)
    if note:
        console.print(note, highlight=False)
    if out is not None:
        console.print(f"plan written to {out}")


@app.command()
@user_errors
def compare(cluster: ClusterOpt, model: ModelOpt, global_batch: BatchOpt, seq_len: SeqOpt, max_tp: TpOpt = 8,
            recompute: RecomputeOpt = "auto", profile: ProfileOpt = None, profile_as: ProfileAsOpt = None,
            dtype: DtypeOpt = "auto", tf32: Tf32Opt = True, catalog: CatalogOpt = None, attention: AttentionOpt = "auto",
            schedules: SchedulesOpt = None, grad_reduce: GradReduceOpt = "fp32",
            out: Annotated[Optional[Path], typer.Option("--out", help="Write results JSON here.")] = None,
            plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a bar chart (PNG/SVG/PDF).")] = None,
            ) -> None:
    """Plan with eth, uniform and layer-balanced in one cost model and compare them (and eth without ZeRO, eth
    with 1F1B only: what each lever buys). The baselines run 1F1B unless --schedules says otherwise."""
    from ethpipe.cost.hardware import load_calibration
    from ethpipe.cost.model import CostModel
    from ethpipe.planner import METHODS, make_plan
    from ethpipe.planner.baselines.homogeneous import best_homogeneous
    from ethpipe.planner.robust import robust_record
    from ethpipe.atomic import write_text_atomic

    if plot is not None and plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--plot '{plot}' must end in .png, .svg or .pdf")
    clu, spec, profiles = _inputs(cluster, model, profile, profile_as)
    calibration = load_calibration(catalog)
    chosen = parse_schedules(schedules)

    def planned(method: str, **kwargs: Any) -> Plan:
        kwargs.setdefault("schedules", chosen)
        return make_plan(clu, spec, global_batch, seq_len, method, max_tp=max_tp, profiles=profiles, recompute=recompute,
                         dtype=dtype, tf32=tf32, calibration=calibration, attention=attention, grad_reduce=grad_reduce,
                         **kwargs)

    plans = {m: planned(m) for m in METHODS}
    plans = {"eth": plans["eth"], UNSHARDED: planned("eth", shard_optimizer=False),
             **({ONE_F_ONE_B: planned("eth", schedules=("1f1b",))} if chosen != ("1f1b",) else {}),
             **{m: p for m, p in plans.items() if m != "eth"}}  # eth may shard the optimizer; the baselines do not
    if len(clu.gpu_types) > 1:  # what a Megatron user runs: the baseline on the one type that is fastest alone
        for base in (m for m in METHODS if m != "eth"):
            best = best_homogeneous(clu, lambda sub, base=base: make_plan(
                sub, spec, global_batch, seq_len, base, max_tp=max_tp, profiles=profiles, recompute=recompute,
                dtype=dtype, tf32=tf32, calibration=calibration, attention=attention, schedules=chosen,
                grad_reduce=grad_reduce), base)
            if best is not None:
                plans[f"{base} (best type)"] = best
    baselines = {m: p for m, p in plans.items() if m not in ("eth", UNSHARDED, ONE_F_ONE_B)}
    worst = {m: robust_record(p, CostModel.for_plan(p, profiles)) for m, p in plans.items()}
    eth_time = plans["eth"].predicted["iteration_time_s"]
    rows = {m: {k: p.predicted[k] for k in ("iteration_time_s", "tokens_per_s", "balance_efficiency", "mfu",
                                           "grad_sync_exposed_s", "planning_time_s")}
            | {"eth_speedup": p.predicted["iteration_time_s"] / eth_time, "num_pipelines": len(p.pipelines),
               "num_idle_devices": len(p.idle_devices), "devices": _devices_used(p),
               "schedules": sorted({pipe.schedule for pipe in p.pipelines}),
               "efficiency_factors": p.predicted.get("efficiency_factors", {}),
               "worst_case_time_s": worst[m]["worst_case_time_s"], "worst_scenario": worst[m]["worst_scenario"]}
            for m, p in plans.items()}
    table = Table(title=f"{spec.name} on {clu.num_devices} devices, batch {global_batch} x {seq_len}")
    for col in ("method", "pipelines", "schedules", "iteration s", "worst case s", "tokens/s", "eth speedup",
                "balance eff.", "largest losses", "MFU", "planning s"):
        table.add_column(col, justify="left" if col in ("method", "schedules", "largest losses") else "right")
    for m, r in rows.items():
        losses = sorted(r["efficiency_factors"].items(), key=lambda kv: kv[1])[:2]
        table.add_row(m, str(r["num_pipelines"]), ",".join(r["schedules"]), f"{r['iteration_time_s']:.3f}",
                      f"{r['worst_case_time_s']:.3f}",
                      f"{r['tokens_per_s']:,.0f}", f"{r['eth_speedup']:.2f}x", f"{r['balance_efficiency']:.3f}",
                      ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in losses), f"{r['mfu']:.3f}",
                      f"{r['planning_time_s']:.3f}")
    best_name = min(baselines, key=lambda m: plans[m].predicted["iteration_time_s"])
    headline = (f"eth {rows[best_name]['eth_speedup']:.2f}x over the best baseline, {best_name} "
                f"({rows[best_name]['devices']}); {rows['uniform']['eth_speedup']:.2f}x over uniform on every device")
    result = {"model": spec.name, "num_devices": clu.num_devices, "global_batch_size": global_batch,
              "seq_len": seq_len, "cluster": clu.source, "methods": rows, "best_baseline": best_name,
              "eth_speedup_over_best_baseline": rows[best_name]["eth_speedup"]}
    if plot is not None:
        _plot(rows, plot, f"{spec.name}, {clu.num_devices} devices, batch {global_batch}x{seq_len}")
    if out is not None:
        write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    console.print(table)
    console.print(headline, highlight=False)


def _devices_used(plan: Plan) -> str:
    """'16 h100_sxm + 32 a100_80gb_sxm': the devices a plan gives ranks to, by type."""
    from collections import Counter

    counts = Counter(s.device for p in plan.pipelines for s in p.stages for _ in s.ranks)
    return " + ".join(f"{n} {t}" for t, n in sorted(counts.items()))


def _plot(rows: dict[str, dict[str, float]], path: Path, title: str) -> None:
    """Horizontal bars, one row per method (long method names never overlap), the first method on top; a bare
    Figure (no pyplot state)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    names = [f"{n}\n{rows[n]['devices']}" if rows[n].get("devices") else n for n in rows]  # each with its devices
    fig = Figure(figsize=(10, 1.2 + 0.7 * len(names)))
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    colors = ["#2a9d8f" if n == "eth" else "#8d99ae" for n in rows]
    ax1.barh(names, [r["tokens_per_s"] for r in rows.values()], color=colors)
    ax1.set_xlabel("predicted tokens/s")
    ax1.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e3:,.0f}k" if v else "0"))
    ax1.locator_params(axis="x", nbins=5)
    ax1.invert_yaxis()
    ax2.barh(names, [r["balance_efficiency"] for r in rows.values()], color=colors)
    ax2.set_xlabel("balance efficiency")
    ax2.set_xlim(0, 1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix[1:].lower())  # png, svg or pdf, as the name says


def _key_column(table: Table, header: str, keys: Any) -> None:
    """A column of ids the user copies into specs: never wrapped or cut, whatever the terminal width."""
    table.add_column(header, no_wrap=True, min_width=max(len(header), *(len(k) for k in keys)))


@app.command()
@user_errors
def catalog() -> None:
    """List the built-in GPUs and model presets."""
    from ethpipe.catalog import gpu_catalog
    from ethpipe.model_spec import model_presets, published_param_counts

    gpus = Table(title="GPUs (use the id in a cluster spec)")
    _key_column(gpus, "id", gpu_catalog())
    for col in ("name", "memory GiB", "peak TFLOP/s", "efficiency", "intra-node GB/s"):
        gpus.add_column(col, justify="left" if col == "name" else "right", overflow="fold")
    for g in gpu_catalog().values():
        gpus.add_row(g.id, g.name, f"{g.memory_gib:.0f}", f"{g.peak_tflops:.1f}", f"{g.efficiency:.2f}",
                     f"{g.intra_node_gbps:.0f}")
    published = published_param_counts()
    models = Table(title="Model presets (use the name with --model)")
    _key_column(models, "name", model_presets())
    for col in ("params (B)", "published (B)", "layers", "hidden", "heads/kv", "ffn", "vocab"):
        models.add_column(col, justify="right", overflow="fold")
    for m in model_presets().values():
        pub = f"{published[m.name] / 1e9:.3f}" if m.name in published else "-"
        models.add_row(m.name, f"{m.num_params() / 1e9:.3f}", pub, str(m.num_layers), str(m.hidden_size),
                       f"{m.num_heads}/{m.num_kv_heads}", str(m.ffn_hidden_size), str(m.vocab_size))
    console.print(gpus)
    console.print(models)
