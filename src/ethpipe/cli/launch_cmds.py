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
    out: Optional[Path] = typer.Option(None, "--out", help="Write the commands (or the script) here."),
) -> None:
    """Print the commands that start a plan on its nodes; arguments after `--` go to `ethpipe train`."""
    from ethpipe.cluster_launch import commands, node_ranks, read_hosts, recorded_hosts, slurm_script
    from ethpipe.plan import Plan, write_text_atomic

    if scheduler not in ("none", "slurm"):
        raise UserError(f"--scheduler must be none or slurm, got {scheduler!r}")
    the_plan = Plan.load(plan)
    if the_plan.cluster is None:
        raise UserError(f"plan '{plan}' has no 'cluster' field: re-make it with `ethpipe plan`")
    nodes = node_ranks(the_plan)
    host_list = read_hosts(hosts, nodes) if hosts is not None else recorded_hosts(the_plan, nodes)
    train_args = list(ctx.args)
    if scheduler == "slurm":
        text = slurm_script(the_plan, str(plan), host_list, train_args, port)
    else:
        lines = ["# ethpipe launch: run each line on its host (static rendezvous, node ranks in the plan's order)"]
        for host, node, command in commands(the_plan, str(plan), host_list, train_args, port):
            lines.append(f"# on {host}: node {node.cluster_node} of the cluster file, {node.num_ranks} x {node.gpu}, "
                         f"ranks {node.ranks.start}-{node.ranks.stop - 1}")
            lines.append(command)
        text = "\n".join(lines) + "\n"
    if out is not None:
        write_text_atomic(out, text)
        console.print(f"written to {out}", highlight=False)
    else:
        print(text, end="")
