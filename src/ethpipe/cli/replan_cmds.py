"""`ethpipe replan`: a new plan for a changed cluster (node lost or joined), same model and batch.

Checkpoints are keyed by global names and load under any plan, so a job continues on the new
plan with `ethpipe train --plan NEW --checkpoint-dir DIR --resume`; under torchrun,
`ethpipe train --replan-cluster CLUSTER --auto-resume` does it on every restart whose world
differs from the plan's. This is CLI-layer code: the runtime never imports the planner.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from ethpipe.cli.app import app, console, user_errors
from ethpipe.cli.replanning import describe_changes, recorded_calibration, replan
from ethpipe.cluster import load_cluster
from ethpipe.cost.hardware import shipped_calibration
from ethpipe.errors import UserError
from ethpipe.plan import Plan


@app.command("replan")
@user_errors
def replan_cmd(
    plan: Path = typer.Option(..., "--plan", help="The plan the job ran with (model, batch and seq_len are kept)."),
    cluster: Optional[Path] = typer.Option(None, "--cluster", help="The changed cluster (YAML or JSON); default: "
                                           "the plan's own devices (with --catalog: re-plan for measured speeds)."),
    catalog: Optional[Path] = typer.Option(None, "--catalog", help="Constants to price with instead of the plan's "
                                           "(`ethpipe calibrate --from-run ... --out FITTED.yaml`)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the new plan here."),
) -> None:
    """Re-plan a job for a changed cluster and print what changed; resume with
    `ethpipe train --plan NEW --checkpoint-dir DIR --resume` (checkpoints load under any plan)."""
    old = Plan.load(plan)
    if cluster is None and catalog is None:
        raise UserError("give --cluster (a changed cluster) or --catalog (measured constants), or both")
    if cluster is None and old.cluster is None:
        raise UserError(f"plan '{plan}' has no 'cluster' field: give --cluster")
    clu = load_cluster(cluster) if cluster is not None else old.active_cluster()
    calibration = None
    if catalog is not None:
        from ethpipe.cost.hardware import load_calibration

        calibration = (recorded_calibration(old) or shipped_calibration()).merged(load_calibration(catalog))
    start = time.perf_counter()
    from ethpipe.runtime.adapt.emulate import emulation_profiles

    new = replan(old, clu, allow_idle=cluster is not None, calibration=calibration, profiles=emulation_profiles(old))
    took_s = time.perf_counter() - start
    if out is not None:
        new.save(out)
    repriced = None
    if calibration is not None:
        from ethpipe.cli.learn import priced_with

        repriced = priced_with(old, calibration)
    for line in describe_changes(old, new, repriced):  # with --catalog: both prices from the same constants
        console.print(line, highlight=False, markup=False)  # a plan's [stages] are text
    console.print(f"planned in {took_s:.3f} s" + (f"; written to {out}" if out is not None else ""), highlight=False)
