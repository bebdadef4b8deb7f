"""`ethpipe launch`: the exact per-node commands (or an sbatch script) that run a plan on its cluster."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import typer

from ethpipe.cli.app import app, console, user_errors
from ethpipe.cli.run_config import config_option, job_checkpoint_dir
from ethpipe.errors import UserError


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def launch(
    ctx: typer.Context,
    config_file: Optional[Path] = config_option(),
    plan: Path = typer.Option(..., "--plan", help="The plan to run (ethpipe plan --out)."),
    hosts: Optional[Path] = typer.Option(None, "--hosts", help="Hostfile: one host per node of the cluster file (its "
                                         "idle nodes are left out for you) or per node that runs ranks, in the cluster "
                                         "file's node order (the first that runs ranks is the rendezvous host). "
                                         "Default: the cluster file's 'hostname:' entries (`ethpipe cluster detect`)."),
    scheduler: str = typer.Option("none", "--scheduler", help="none (one command per node) | slurm (an sbatch "
                                                              "script)."),
    port: int = typer.Option(29500, "--port", help="Rendezvous port on the first host."),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="torchrun restarts a node's ranks this often "
                                     "after a failure; with --checkpoint-dir the ranks then resume (--auto-resume)."),
    time_limit: str = typer.Option("24:00:00", "--time", help="--scheduler slurm: the job's time limit (sbatch --time)."),
    job_name: str = typer.Option("ethpipe", "--job-name", help="--scheduler slurm: the job's name."),
    output: str = typer.Option("ethpipe-%j.out", "--slurm-output", help="--scheduler slurm: the job's log file "
                               "(sbatch --output; %j is the job id)."),
    shared_nodes: bool = typer.Option(False, "--shared-nodes", help="--scheduler slurm: do not ask for whole nodes "
                                      "(--exclusive is the default: other jobs would skew the plan's speeds)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the commands (or the script) here."),
) -> None:
    """Print the commands that start a plan on its nodes; arguments after `--` go to `ethpipe train`."""
    from ethpipe.cluster_launch import (
        SlurmOptions, cluster_node_count, commands, node_ranks, read_hosts, recorded_hosts, slurm_script,
    )
    from ethpipe.atomic import write_text_atomic
    from ethpipe.plan import Plan

    if scheduler not in ("none", "slurm"):
        raise UserError(f"--scheduler must be none or slurm, got {scheduler!r}")
    if not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", time_limit):
        raise UserError(f"--time must be a SLURM time limit (minutes, HH:MM:SS or D-HH:MM:SS), got {time_limit!r}")
    the_plan = Plan.load(plan)
    if the_plan.cluster is None:
        raise UserError(f"plan '{plan}' has no 'cluster' field: re-make it with `ethpipe plan`")
    nodes = node_ranks(the_plan)
    host_list = (read_hosts(hosts, nodes, cluster_node_count(the_plan)) if hosts is not None
                 else recorded_hosts(the_plan, nodes))
    train_args = list(ctx.args)
    checkpoints = any(a.split("=")[0] == "--checkpoint-dir" for a in train_args)
    if config_file is not None:  # each node's `ethpipe train` reads the same job file (its [train], [checkpoint]...)
        train_args = ["--config", str(config_file.resolve()), *train_args]
        checkpoints = checkpoints or job_checkpoint_dir(config_file) is not None
    if max_restarts and checkpoints and not any(a in ("--resume", "--auto-resume") for a in train_args):
        train_args.append("--auto-resume")  # a restarted node's ranks continue from the last checkpoint
    plan_path = str(plan.resolve())  # the same file from any directory a node's shell starts in
    if scheduler == "slurm":
        options = SlurmOptions(job_name, time_limit, output, not shared_nodes)
        text = slurm_script(the_plan, plan_path, host_list, train_args, port, options, max_restarts=max_restarts)
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
