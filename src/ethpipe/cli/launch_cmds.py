"""`ethpipe launch`: the exact per-node commands (or an sbatch script) that run a plan on its cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ethpipe.cli.app import app, console, user_errors
from ethpipe.errors import UserError


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def launch(
    ctx: typer.Context,
    plan: Path = typer.Option(..., "--plan", help="The plan to run (ethpipe plan --out)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile: one host per node of the plan, in the "
                                         "cluster file's node order (the first is the rendezvous host). Default: the "
                                         "cluster file's 'hostname:' entries (`ethpipe cluster detect` writes them)."),
    scheduler: str = typer.Option("none", "--scheduler", help="none (one command per node) | slurm (an sbatch "
                                                              "script)."),
    port: int = typer.Option(29500, "--port", help="Rendezvous port on the first host."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="torchrun restarts a node's ranks this often "
                                     "after a failure; with --checkpoint-dir the ranks then resume (--auto-resume)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the commands (or the script) here."),
) -> None:
    """Print the commands that start a plan on its nodes; arguments after `--` go to `ethpipe train`."""
    from ethpipe.cluster_launch import commands, node_ranks, read_hosts, recorded_hosts, slurm_script
    from ethpipe.atomic import write_text_atomic
    from ethpipe.plan import Plan

    if scheduler not in ("none", "slurm"):
        raise UserError(f"--scheduler must be none or slurm, got {scheduler!r}")
    the_plan = Plan.load(plan)
    if the_plan.cluster is None:
        raise UserError(f"plan '{plan}' has no 'cluster' field: re-make it with `ethpipe plan`")
    nodes = node_ranks(the_plan)
    host_list = read_hosts(hosts, nodes) if hosts is not None else recorded_hosts(the_plan, nodes)
    train_args = list(ctx.args)
    if max_restarts and any(a.split("=")[0] == "--checkpoint-dir" for a in train_args) and not any(
            a in ("--resume", "--auto-resume") for a in train_args):
        train_args.append("--auto-resume")  # a restarted node's ranks continue from the last checkpoint
    plan_path = str(plan.resolve())  # the same file from any directory a node's shell starts in
    if scheduler == "slurm":
        text = slurm_script(the_plan, plan_path, host_list, train_args, port, max_restarts=max_restarts)
    else:
        lines = ["# ethpipe launch: run each line on its host (static rendezvous, node ranks in the plan's order)"]
        for host, node, command in commands(the_plan, plan_path, host_list, train_args, port, max_restarts):
            lines.append(f"# on {host}: node {node.cluster_node} of the cluster file, {node.num_ranks} x {node.gpu}, "
                         f"ranks {node.ranks.start}-{node.ranks.stop - 1}")
            lines.append(command)
        text = "\n".join(lines) + "\n"
    if out is not None:
        write_text_atomic(out, text)
        console.print(f"written to {out}", highlight=False)
    else:
        print(text, end="")
