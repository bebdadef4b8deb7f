"""Runtime on CPU: measured step time of the eth, uniform and layer-balanced plans under --emulate
(6 ranks: 2 emulated "fast" + 4 "slow" devices, tiny model), and ethpipe vs torch.distributed.pipelining
on the same homogeneous plans (``runtime_vs_torch.py``: 1F1B alone, and whole steps against Schedule1F1B
+ DDP), with the gradient sync's exposed time per sync variant.

The main table runs the plans the planner makes for each method, with exactly the profile, emulated
cost, plans and pacing targets of ``ethpipe demo`` (``ethpipe.demo``). A second table runs plans
written by hand after each method's definition (docs/design.md §2.1), paced by the same cost model, for
reference. Results: docs/benchmarks/runtime_cpu.{md,json}.

    .venv/bin/python benchmarks/runtime_cpu.py [--steps 12] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.optim  # imported before the workers fork
import yaml

from ethpipe import demo
from ethpipe.cli.demo_cmd import GLOBAL_BATCH, MODEL, PROFILE_SIZES, SEQ_LEN
from ethpipe.cost.model import CostModel
from ethpipe.cost.plan_memory import stage_peak_bytes
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.runtime.adapt.emulate import local_cores, with_emulation
from ethpipe.runtime.start.launch import run_local
from ethpipe.runtime.train import TrainConfig
from ethpipe.sim import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runtime_vs_torch  # noqa: E402  (the comparison with torch.distributed.pipelining)

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SPEEDS = {"fast": 1.0, "slow": 0.25}  # the demo cluster's device speeds, which the hand-written plans assume
PROFILE_ROUNDS, PROFILE_REPEATS = 2, 5  # as `ethpipe demo` (not --quick)
WARMUP_STEPS = 2  # steps left out of each run's median step time
ORDER = ("uniform", "layer-balanced", "eth")
EMULATION_TEXT = {
    "paced": "every forward/backward lasts its stage's time in the emulated cost model (this CPU's profile, "
             f"fastest of {PROFILE_ROUNDS} runs, x time_scale / speed), independent of the machine's load",
    "measured": "every forward/backward lasts its real CPU time x time_scale / speed",
}
EMULATION_NOTE = {  # what the measured step times and speed-ups are evidence of, per emulation mode
    "paced": "These measured numbers are paced: every forward/backward lasted the cost model's own predicted time, "
             "so they confirm the schedule, the communication and the runtime overheads of each plan, **not the "
             "compute model**; `docs/benchmarks/fidelity.md` also runs the measured mode, where compute is real.",
    "measured": "These measured numbers scale each forward/backward's real CPU time, so they include the compute "
                "model's error (the prediction comes from a per-layer profile of this CPU).",
}
IDEAL_UNITS = {"uniform": 192, "layer-balanced": 96, "eth": 80}  # hand-written plans' ideal 1F1B makespans


def _plan(method: str, pipelines: list[tuple[list[tuple[int, str, tuple[int, int]]], list[int]]]) -> Plan:
    pipes = tuple(Pipeline(tuple(Stage((r,), d, lay) for r, d, lay in stages), tuple(mbs)) for stages, mbs in pipelines)
    return Plan(method, MODEL, GLOBAL_BATCH, SEQ_LEN, pipes, compute_blocks(pipes), load_model_spec(MODEL),
                extra={"device_speeds": SPEEDS})


def hand_written_plans() -> dict[str, Plan]:
    """Ranks 0-1 fast, 2-5 slow (speed 0.25); tiny has 8 layers; global batch 24."""
    assert load_model_spec(MODEL).num_layers == 8 and GLOBAL_BATCH == 24, "the hand-written plans assume these"
    mixed = [(0, "fast"), (2, "slow"), (3, "slow")], [(1, "fast"), (4, "slow"), (5, "slow")]
    uniform = [([(r, d, lay) for (r, d), lay in zip(m, [(0, 3), (3, 6), (6, 8)])], [2] * 6) for m in mixed]
    balanced = [([(r, d, lay) for (r, d), lay in zip(m, [(0, 6), (6, 7), (7, 8)])], [2] * 6) for m in mixed]
    eth = [([(0, "fast", (0, 4)), (1, "fast", (4, 8))], [2] * 8),  # homogeneous pipelines, data by speed
           ([(2, "slow", (0, 4)), (3, "slow", (4, 8))], [1] * 4),
           ([(4, "slow", (0, 4)), (5, "slow", (4, 8))], [1] * 4)]
    return {"uniform": _plan("uniform", uniform), "layer-balanced": _plan("layer-balanced", balanced),
            "eth": _plan("eth", eth)}


@dataclass(frozen=True)
class Setup:
    plans: dict[str, dict[str, Plan]]  # table -> method -> plan carrying its emulation settings
    simulated_s: dict[str, dict[str, float]]
    time_scale: float
    profile_device: str
    block_sample_s: dict[int, float]  # one decoder block's fwd+bwd per sample at micro-batch 1 and 2 (profiled)
    memory_use: dict[str, dict[str, float]]  # table -> method -> peak stage memory / usable device memory


def memory_use(plan: Plan, cost: CostModel) -> float:
    """Worst stage's peak memory (1F1B in-flight activations) over its device's usable memory, as the
    planner checks it: the runtime on CPU does not enforce the emulated devices' memory."""
    return max(stage_peak_bytes(plan, cost, p, s) / cost.usable_memory_bytes(stage.device)
               for p, pipe in enumerate(plan.pipelines) for s, stage in enumerate(pipe.stages))


def build(paced: bool) -> Setup:
    """The demo's profile, emulated cost, plans and pacing (``ethpipe.demo``), plus the hand-written
    plans paced by the same cost model; both priced by the simulator with that cost model."""
    spec, cluster = load_model_spec(MODEL), demo.demo_cluster()
    speeds = demo.cluster_speeds(cluster, spec, SEQ_LEN)
    assert speeds == SPEEDS, f"demo cluster speeds changed: {speeds}"
    scale = demo.cluster_time_scale(cluster, speeds)
    profile = demo.measure_profile(spec, SEQ_LEN, PROFILE_SIZES, rounds=PROFILE_ROUNDS, repeats=PROFILE_REPEATS)
    profiles = demo.emulated_profiles(profile, speeds, scale)
    cost = demo.emulated_cost(cluster, spec, SEQ_LEN, profiles)
    made = demo.make_plans(cluster, spec, GLOBAL_BATCH, SEQ_LEN, profiles, scale, paced=paced)
    cluster_dict = yaml.safe_load(demo.demo_cluster_path().read_text())
    hand = {n: with_emulation(dataclasses.replace(p, cluster=cluster_dict), scale,
                              demo.pacing_targets(p, cost) if paced else None)
            for n, p in hand_written_plans().items()}
    plans = {"planner": {n: made[n] for n in ORDER}, "hand_written": {n: hand[n] for n in ORDER}}
    simulated = {t: {n: simulate(p, cost).iteration_time_s for n, p in ps.items()} for t, ps in plans.items()}
    block = profile.layers["block"]
    planner_cost = CostModel(cluster, spec, SEQ_LEN, profiles=profiles)  # as make_plan builds it
    return Setup(plans, simulated, scale, profile.device_name,
                 {b: (block[b].fwd_s + block[b].bwd_s) / b for b in (1, 2)},
                 {t: {n: memory_use(p, planner_cost) for n, p in ps.items()} for t, ps in plans.items()})


def bench_plans(plans: dict[str, dict[str, Plan]], data: str, steps: int,
                repeats: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Every plan ``repeats`` times, interleaved (order reversed every other round, so load drift hits
    all plans alike); median of the runs' median step times."""
    runs: dict[tuple[str, str], list[float]] = {}
    final_loss: dict[tuple[str, str], float] = {}
    flat = [((t, n), p) for t, ps in plans.items() for n, p in ps.items()]
    for r in range(repeats):
        order: Iterable[tuple[tuple[str, str], Plan]] = flat if r % 2 == 0 else reversed(flat)
        for key, plan in order:
            config = TrainConfig(data=data, steps=steps, emulate=True, progress=False, timeout_s=120.0, device="cpu")
            records = run_local(plan, config)
            runs.setdefault(key, []).append(demo.measured_step_s(records, warmup=WARMUP_STEPS))
            final_loss[key] = float(records[-1]["loss"])
            print(f"{key[0]:12s} {key[1]:15s} run {r}: {runs[key][-1] * 1e3:8.1f} ms/step", flush=True)
    out: dict[str, dict[str, dict[str, Any]]] = {t: {} for t in plans}
    for (t, n), times in runs.items():
        median = statistics.median(times)
        out[t][n] = {"plan": demo.plan_shape(plans[t][n]), "median_step_s": median,
                     "tokens_per_s": GLOBAL_BATCH * SEQ_LEN / median, "runs_s": times,
                     "spread": (max(times) - min(times)) / median, "final_loss": final_loss[(t, n)]}
    return out


def _runs_ms(values: list[float]) -> str:
    return "/".join(f"{v * 1e3:.0f}" for v in values)


def _sync_note(sync: dict[str, Any]) -> str:
    """What the sync variants' numbers say, from the numbers: the lowest exposed time, and whether any
    variant's step time is outside another's range of runs."""
    exposed = {n: v for n, v in sync["medians"].items() if not n.endswith(" step")}
    best, worst = min(exposed, key=exposed.__getitem__), max(exposed, key=exposed.__getitem__)
    steps = {n: sync["rounds"][n + " step"] for n in exposed}
    separated = any(max(steps[a]) < min(steps[b]) for a in steps for b in steps if a != b)
    return (f"Lowest exposed sync: {best} ({exposed[best] * 1e3:.1f} ms), highest: {worst} "
            f"({exposed[worst] * 1e3:.1f} ms). Step times "
            + ("do separate: some variant's runs all lie below another's." if separated else
               "do not separate: every variant's runs overlap every other's, so on this 2-core machine (4 ranks "
               "keeping both cores busy with compute) less exposed sync did not make a step shorter.")
            + " The default bucket size stays 25 MiB (DDP's): on GPUs every all-reduce adds NCCL's launch latency, "
              "so a 7B stage's 6.8 GB of gradients in 1 MiB buckets would be ~6800 collectives a step; tune with "
              "`--bucket-mib`.")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _over_memory(plans: dict[str, dict[str, Any]]) -> str:
    over = [n for n, v in plans.items() if v["memory_use"] > 1.0]
    return ", ".join(over) if over else "none"


def render(res: dict[str, Any]) -> str:
    """The markdown report, every number read from (or computed from) the results JSON."""
    main, hand = res["plans"], res["hand_written_plans"]
    base, eth = main["uniform"]["median_step_s"], main["eth"]["median_step_s"]
    rows = "\n".join(
        f"| {n} | {v['plan']} | {v['median_step_s'] * 1e3:.1f} | {v['tokens_per_s']:.0f} | "
        f"{_ratio(base, v['median_step_s'])} | {_ratio(v['median_step_s'], eth)} | {v['simulated_s'] * 1e3:.1f} | "
        f"{(v['simulated_s'] - v['median_step_s']) / v['median_step_s'] * 100:+.1f}% | {v['spread'] * 100:.1f}% | "
        f"{v['memory_use'] * 100:.0f}% | {v['final_loss']:.4f} |" for n, v in main.items())
    hbase = hand["uniform"]["median_step_s"]
    hrows = "\n".join(
        f"| {n} | {v['plan']} | {v['median_step_s'] * 1e3:.1f} | {v['tokens_per_s']:.0f} | "
        f"{_ratio(hbase, v['median_step_s'])} | {v['ideal_units']} | {v['simulated_s'] * 1e3:.1f} | "
        f"{v['spread'] * 100:.1f}% | {v['memory_use'] * 100:.0f}% |" for n, v in hand.items())
    lb, hlb, heth = main["layer-balanced"], hand["layer-balanced"], hand["eth"]
    fb, full, sync = res["vs_torch"]["fb_only"], res["vs_torch"]["full_step"], res["vs_torch"]["sync"]
    sync_rows = "\n".join(f"| {name} | {ms * 1e3:.1f} (runs {_runs_ms(sync['rounds'][name])}) | "
                          f"{sync['medians'][name + ' step'] * 1e3:.1f} (runs {_runs_ms(sync['rounds'][name + ' step'])}) |"
                          for name, ms in sync["medians"].items() if not name.endswith(" step"))
    sync_note = _sync_note(sync)
    per_sample = {int(b): s for b, s in res["block_sample_s"].items()}
    best = min(main, key=lambda n: main[n]["median_step_s"])
    return f"""# Runtime on CPU (measured)

Command: `{res['command']}`
Machine: {res['machine']}; load average (1 min) {res['load_average_before'][0]:.1f} before, {res['load_average_after'][0]:.1f} after (shared with other jobs while it ran)

6 ranks emulate the demo cluster (`ethpipe/data/cpu_demo.yaml`): ranks 0-1 "fast" (speed 1.0), 2-5 "slow"
(speed 0.25); {res['model']} model, global batch {res['global_batch']} x {res['seq_len']} tokens.
Emulation ({res['emulation']}; docs/runtime.md, "Emulation model"): {EMULATION_TEXT[res['emulation']]};
time scale {res['time_scale']:.1f} by the default rule (all ranks' real compute within a quarter of the
{res['cores']} cores), so every rank, the fast ones too, sleeps most of each action.
Each plan ran {res['repeats']} times, all plans interleaved (order reversed every other round); a run's step time is the
median of steps {WARMUP_STEPS}..{res['steps'] - 1}, the table shows the median over runs; spread = (max - min) / median.
"simulated ms" = `ethpipe.sim.simulate` of the plan priced by the same emulated cost model as the pacing;
sim error = (simulated - measured) / measured. "memory" = the worst stage's peak memory (1F1B in-flight
activations) over its emulated device's usable memory as `make_plan` checks it (its own cost model); the runtime
on CPU does not enforce it, so a plan over 100% runs here but would not fit the devices it emulates.

## Plans made by the planner (what `ethpipe demo` runs)

`ethpipe.demo.make_plans` (`make_plan(..., method, max_tp=1, profiles=...)`) with this run's profile of this CPU
({res['profile_device']}) mapped onto the emulated devices, pacing targets from the same cost model
(`ethpipe.demo.pacing_targets`). Plan: one `device:layers samples/micro-batches(b=sizes)` entry per pipeline.

| method | plan | ms/step | tokens/s | speed-up vs uniform | eth's speed-up over it | simulated ms | sim error | run spread | memory | final loss |
|---|---|---|---|---|---|---|---|---|---|---|
{rows}

eth / layer-balanced: measured **{_ratio(lb['median_step_s'], eth)}**, simulated {_ratio(lb['simulated_s'], main['eth']['simulated_s'])};
eth / uniform: measured **{_ratio(base, eth)}**, simulated {_ratio(main['uniform']['simulated_s'], main['eth']['simulated_s'])}.
{EMULATION_NOTE[res['emulation']]}

## Hand-written plans, for reference

Written after each method's definition (docs/design.md §2.1), not by the planner, paced by the same cost model:
uniform = one mixed shape (fast, slow, slow) x 2, layers 3/3/2, equal data; layer-balanced = same shape,
layers 6/1/1, equal data; eth = three homogeneous 2-stage pipelines (fast; slow; slow), layers 4/4, data by
speed with micro-batches of 2 on the fast pipeline and 1 on the slow ones. "ideal units" = ideal 1F1B makespan in
fast-layer-sample units, assuming a sample costs the same in any micro-batch size. `make_plan` rejects plans
over 100% memory; hand-written plans over it: {_over_memory(hand)}.

| method | plan | ms/step | tokens/s | speed-up vs uniform | ideal units | simulated ms | run spread | memory |
|---|---|---|---|---|---|---|---|---|
{hrows}

Hand-written eth / layer-balanced: measured **{_ratio(hlb['median_step_s'], heth['median_step_s'])}**, simulated
{_ratio(hlb['simulated_s'], heth['simulated_s'])}, ideal {_ratio(hlb['ideal_units'], heth['ideal_units'])}. The ideal leaves out that on this CPU one decoder
block's forward+backward costs {per_sample[1] * 1e3:.2f} ms per sample at micro-batch 1 and {per_sample[2] * 1e3:.2f} ms at 2
(profiled: {_ratio(per_sample[1], per_sample[2])} as much per sample at 1), and the hand-written eth's slow pipelines use micro-batches of 1.
The hand-written layer-balanced plan measured {hlb['median_step_s'] * 1e3:.1f} ms/step against the fastest planner plan's
{main[best]['median_step_s'] * 1e3:.1f} ms ({best}), but needs {hlb['memory_use'] * 100:.0f}% of its devices' memory (the planner's layer-balanced
plan {lb['memory_use'] * 100:.0f}%).
Planner's eth over hand-written eth (hand-written step time / planner's): measured {_ratio(heth['median_step_s'], eth)},
simulated {_ratio(heth['simulated_s'], main['eth']['simulated_s'])}.

## ethpipe vs `torch.distributed.pipelining` (same plan, same run; `benchmarks/runtime_vs_torch.py`)

**1F1B, forward and backward only**: one pipeline of {fb['stages']} stages of {res['model']}, {fb['microbatches']}
micro-batches of {fb['micro_batch_size']} x {res['seq_len']}, median of alternating iterations: ours {fb['ours'] * 1e3:.1f} ms,
`Schedule1F1B` {fb['torch'] * 1e3:.1f} ms, ratio ours/torch = **{fb['ratio_ours_over_torch']:.3f}**.

**Whole training steps**: {full['pipelines']} pipelines x {full['stages']} stages of {res['model']}, {full['microbatches']} micro-batches of
{full['micro_batch_size']} per pipeline, fp32. ethpipe: `ethpipe.runtime.train.train` (1F1B with batched p2p, the block
gradient sync fired from backward hooks, the one stats all-gather, AdamW). torch: `Schedule1F1B` per pipeline with
each stage in `DistributedDataParallel` over its two replicas (buckets reduced during the last micro-batch's
backward), a loss all-reduce for logging, the same AdamW. Median step time over {res['vs_torch']['rounds']} alternating rounds of
{res['vs_torch']['steps']} steps: ethpipe {full['ethpipe'] * 1e3:.1f} ms, torch {full['torch'] * 1e3:.1f} ms, ratio ethpipe/torch =
**{full['ratio_ethpipe_over_torch']:.3f}**. (4 processes share {res['cores']} cores here, so both include the same contention.)

**Gradient sync exposed** (the wait after the last backward, median over rank 0's steps, then over rounds), 2 pipelines x
2 stages of a {sync['num_layers']}-layer h={sync['hidden_size']} model (25 MB of fp32 gradients per stage), 4 micro-batches:

| sync | exposed ms (median; each run) | step ms (median; each run) |
|---|---|---|
{sync_rows}

{sync_note}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--emulation", choices=("paced", "measured"), default="paced",
                        help="paced: targets from the emulated cost model (as `ethpipe demo`); measured: CPU time x "
                        "scale / speed")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS or args.repeats < 1:
        raise SystemExit(f"--steps must exceed {WARMUP_STEPS} and --repeats be at least 1")
    command = (f".venv/bin/python benchmarks/runtime_cpu.py --steps {args.steps} --repeats {args.repeats} "
               f"--emulation {args.emulation}")
    load_before = os.getloadavg()
    setup = build(args.emulation == "paced")
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/tokens.bin"
        prepare_tokens(builtin_text(2_000_000), data)
        measured = bench_plans(setup.plans, data, args.steps, args.repeats)
    for table, methods in measured.items():
        for name, rec in methods.items():
            rec["simulated_s"] = setup.simulated_s[table][name]
            rec["memory_use"] = setup.memory_use[table][name]
            if table == "hand_written":
                rec["ideal_units"] = IDEAL_UNITS[name]
    vs_torch = runtime_vs_torch.measure()
    load_after = os.getloadavg()
    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, {local_cores()} cores, " \
              f"torch {torch.__version__}"
    result = {"command": command, "machine": machine, "cores": local_cores(), "load_average_before": load_before,
              "load_average_after": load_after, "emulation": args.emulation, "time_scale": setup.time_scale,
              "steps": args.steps, "repeats": args.repeats, "model": MODEL, "global_batch": GLOBAL_BATCH,
              "seq_len": SEQ_LEN, "profile_device": setup.profile_device,
              "block_sample_s": {str(b): s for b, s in setup.block_sample_s.items()},
              "plans": measured["planner"], "hand_written_plans": measured["hand_written"], "vs_torch": vs_torch}
    markdown = render(result)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "runtime_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "runtime_cpu.md").write_text(markdown)


if __name__ == "__main__":
    sys.exit(main())
