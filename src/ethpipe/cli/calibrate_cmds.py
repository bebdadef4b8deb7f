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


@app.command()
@user_errors
def calibrate(
    profiles: Annotated[list[Path], typer.Argument(help="Profiles from `ethpipe profile` (any model, any GPU type).")],
    gpu: Annotated[list[str], typer.Option("--gpu", help="Catalog GPU id of each profile (one, or one per profile).")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the constants (YAML).")],
    catalog: Annotated[Optional[Path], typer.Option("--catalog", help="Earlier constants to start from.")] = None,
) -> None:
    """Fit per-architecture constants so `ethpipe plan --catalog OUT` predicts other models and lengths."""
    import yaml

    from ethpipe.catalog import get_gpu
    from ethpipe.cost.calibrate import fit, observations, relative_errors
    from ethpipe.cost.hardware import CONSTANT_NAMES, DEFAULT_CONSTANTS, load_calibration
    from ethpipe.cost.profile import load_profile
    from ethpipe.plan import write_text_atomic

    if len(gpu) not in (1, len(profiles)):
        raise UserError(f"--gpu given {len(gpu)} times for {len(profiles)} profiles: give one, or one per profile")
    gpus = [get_gpu(g) for g in (gpu * len(profiles) if len(gpu) == 1 else gpu)]
    obs = [o for path, g in zip(profiles, gpus) for o in observations(load_profile(path), g)]
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
    if any_dim:
        console.print("constants not under 'fitted' (dim) are not informed by these profiles: plans use the shipped "
                      "(or --catalog) family's value where it has one, else the fit's centre shown")
    console.print(f"constants written to {out}")
