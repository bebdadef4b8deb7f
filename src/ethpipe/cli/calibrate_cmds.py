"""`ethpipe calibrate`: fit the compute model's per-architecture constants to measured profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from ethpipe.cli.app import app, console, user_errors
from ethpipe.errors import UserError

HEADER = """# Compute-model constants fitted by `ethpipe calibrate` (use with `ethpipe plan --catalog THIS_FILE`).
# Per GPU architecture family: fractions of the datasheet peaks (tensor_eff: bf16/fp16 tensor cores,
# tf32_eff: TF32 tensor cores, simd_eff: fp32 CUDA cores, mem_eff: memory bandwidth), the least time of a
# kernel (launch_s) and the per-layer overhead (layer_s), in seconds; `fitted` lists the constants the
# profiles inform (the others sit at the fit's centre, near the shipped fallback).
"""


def check_profile_device(path: Path, device_kind: str, device_name: str, gpu_id: str) -> None:
    """A profile calibrates the GPU it was measured on: one from a CPU, or from a device whose name is of another
    GPU model, would write wrong constants for ``gpu_id`` (a name that identifies none, or leaves the form factor
    open, passes)."""
    from ethpipe.catalog import get_gpu
    from ethpipe.runtime.start.placement import identify_gpu, names_model

    fix = f"profile on a {gpu_id} (`ethpipe profile --device cuda` there), or pass --allow-other-device"
    if device_kind != "cuda":
        raise UserError(f"{path} was measured on {device_name!r}, not on a {gpu_id} (--gpu): {fix}")
    name = device_name.split(":", 1)[-1].strip()
    found = identify_gpu(name)
    if found is not None and found != gpu_id and not names_model(get_gpu(gpu_id), name):
        raise UserError(f"{path} was measured on {device_name!r}, a {found}, not a {gpu_id} (--gpu): give "
                        f"--gpu {found}, or {fix}")


def _calibrate_from_run(metrics: Path, plan_path: Path, out: Path) -> None:
    """`calibrate --from-run`: fit the run, print predicted vs measured per stage before and after, write."""
    import json

    import yaml

    from ethpipe.cli.learn import fit_run, fitted_speeds
    from ethpipe.cost.run_fit import check_records
    from ethpipe.plan import Plan, write_text_atomic
    from ethpipe.plan_text import layers_text

    if not metrics.is_file():
        raise UserError(f"metrics file '{metrics}' not found: give the --metrics file of an `ethpipe train` run")
    try:
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise UserError(f"metrics file '{metrics}' is not JSON lines: {err}") from None
    check_records(records, f"metrics file '{metrics}'")
    plan = Plan.load(plan_path)
    fit = fit_run(plan, _last_attempt(records), source=f"ethpipe calibrate --from-run {metrics.name}")
    table = Table(title="predicted vs measured per stage (median compute per step)")
    for col in ("pipe", "stage", "device", "layers", "measured s", "before", "after"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for b, a in zip(fit.before, fit.after):
        stage = plan.pipelines[b["pipeline"]].stages[b["stage"]]
        table.add_row(str(b["pipeline"]), str(b["stage"]), b["device"], layers_text(stage.layer_ranges, stage.sublayers),
                      f"{b['measured_s']:.4f}",
                      f"{b['predicted_s']:.4f} ({100 * b['error']:+.1f}%)",
                      f"{a['predicted_s']:.4f} ({100 * a['error']:+.1f}%)")
    console.print(table)
    speeds = fitted_speeds(plan, fit.calibration)
    for t, sc in fit.scales.items():
        console.print(f"{t}: measured = model x {sc.fwd_scale:.3f} (forward), x {sc.bwd_scale:.3f} (backward) over "
                      f"{sc.num_observations} stage observations; relative speed {speeds[t]:.3f}", highlight=False)
    write_text_atomic(out, HEADER + yaml.safe_dump(fit.calibration.to_dict(), sort_keys=False))
    console.print(f"constants written to {out}: `ethpipe plan --catalog {out}` or `ethpipe replan --plan "
                  f"{plan_path} --catalog {out}`", highlight=False)


def _last_attempt(records: list[dict]) -> list[dict]:
    """One record per step, under the plan the run started with: a resumed run's file repeats the steps a crashed
    attempt ran after its checkpoint (the later line counts), and the steps after a `--replan-after` switch ran
    another plan (left out: fit them with that plan's own file)."""
    by_step = {int(r["step"]): r for r in records}
    out = []
    for k in sorted(by_step):
        out.append(by_step[k])
        if (by_step[k].get("replan") or {}).get("switched"):
            console.print(f"the run switched plans after step {k}: fitting steps {out[0]['step']}..{k} (the plan "
                          "given)", highlight=False)
            break
    return out


@app.command()
@user_errors
def calibrate(
    out: Annotated[Path, typer.Option("--out", help="Where to write the constants (YAML).")],
    profiles: Annotated[Optional[list[Path]], typer.Argument(
        help="Profiles from `ethpipe profile` (any model, any GPU type).")] = None,
    gpu: Annotated[Optional[list[str]], typer.Option(
        "--gpu", help="Catalog GPU id of each profile (one, or one per profile).")] = None,
    from_run: Annotated[Optional[Path], typer.Option(
        "--from-run", help="Instead of profiles: the --metrics file of an `ethpipe train` run (needs --plan): fit "
                           "each device type's measured forward/backward compute against the plan's model.")] = None,
    run_plan: Annotated[Optional[Path], typer.Option("--plan", help="With --from-run: the plan the run trained.")] = None,
    catalog: Annotated[Optional[Path], typer.Option("--catalog", help="Earlier constants to start from.")] = None,
    allow_other_device: Annotated[bool, typer.Option(
        "--allow-other-device", help="Fit even where a profile's recorded device is not its --gpu (a CPU, or "
                                     "another GPU model): the constants then describe the wrong hardware.")] = False,
) -> None:
    """Fit per-architecture constants so `ethpipe plan --catalog OUT` predicts other models and lengths; or, with
    --from-run, per-device-type scales from a training run's own measurements."""
    import yaml

    if from_run is not None:
        if profiles or gpu:
            raise UserError("give profiles (with --gpu) or --from-run METRICS --plan PLAN, not both")
        if run_plan is None:
            raise UserError("--from-run needs --plan: the plan the run trained with")
        _calibrate_from_run(from_run, run_plan, out)
        return
    if not profiles or not gpu:
        raise UserError("give PROFILE... with --gpu ID (from `ethpipe profile`), or --from-run METRICS --plan PLAN")

    from ethpipe.catalog import get_gpu
    from ethpipe.cost.calibrate import fit, observations, relative_errors
    from ethpipe.cost.hardware import CONSTANT_NAMES, DEFAULT_CONSTANTS, load_calibration
    from ethpipe.cost.profile import load_profile
    from ethpipe.atomic import write_text_atomic

    if len(gpu) not in (1, len(profiles)):  # profiles and gpu are given from here on
        raise UserError(f"--gpu given {len(gpu)} times for {len(profiles)} profiles: give one, or one per profile")
    gpus = [get_gpu(g) for g in (gpu * len(profiles) if len(gpu) == 1 else gpu)]
    loaded = [load_profile(path) for path in profiles]
    if not allow_other_device:
        for path, prof, g in zip(profiles, loaded, gpus):
            check_profile_device(path, prof.device_kind, prof.device_name, g.id)
    obs = [o for prof, g in zip(loaded, gpus) for o in observations(prof, g)]
    if not obs:
        raise UserError("the profiles hold no measured layer times: re-run `ethpipe profile`")
    names = ", ".join(p.name for p in profiles)
    # Centred on the shipped fit's fallback: a few profiles of one GPU then move only what they inform.
    base = load_calibration(catalog)
    fitted = fit(obs, source=f"ethpipe calibrate on {names}", prior=base.fallback or DEFAULT_CONSTANTS)
    result = base.merged(fitted) if catalog else fitted
    write_text_atomic(out, HEADER + yaml.safe_dump(result.to_dict(), sort_keys=False))
    table = Table(title=f"fitted on {len(obs)} layer passes")
    for col in ("architecture", "16-bit eff", "tf32 eff", "simd eff", "mem eff", "launch us", "layer us", "fitted", "median err"):
        table.add_column(col, justify="left" if col in ("architecture", "fitted") else "right")
    any_dim = False
    for arch, c in fitted.architectures.items():
        errs = sorted(abs(e) for e in relative_errors([o for o in obs if o.arch == arch], fitted))
        values = [*(f"{e:.3f}" for e in c.unit_effs()), f"{c.mem_eff:.3f}", f"{c.launch_s * 1e6:.1f}",
                  f"{c.layer_s * 1e6:.0f}"]
        values = [v if name in c.fitted else f"[dim]{v}[/dim]" for name, v in zip(CONSTANT_NAMES, values)]
        any_dim |= len(c.fitted) < len(CONSTANT_NAMES)
        table.add_row(arch, *values, ",".join(c.fitted), f"{100 * errs[len(errs) // 2]:.1f}%")
    console.print(table)
    for gpu_id, factor in sorted(fitted.gpus.items()):
        console.print(f"{gpu_id}: sustains x{factor.compute_scale:.2f} of its family's compute "
                      f"({factor.num_observations} timings, median |error| {factor.median_abs_error or 0:.1%})",
                      highlight=False)
    if any_dim:
        console.print("constants not under 'fitted' (dim) are not informed by these profiles: plans use the shipped "
                      "(or --catalog) family's value where it has one, else the fit's centre shown")
    console.print(f"constants written to {out}")
