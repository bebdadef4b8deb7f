"""`ethpipe cluster detect`: write the cluster file of this node (or of a torchrun/srun world) from the hardware.

The query layer and the mapper/writer live in ``ethpipe.cluster_detect``; this module adds the command and its
transport: under torchrun or srun, local rank 0 of every node sends its node's facts over a gloo group and
rank 0 writes one file with the nodes in node-rank order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from ethpipe.cli.app import app, console, user_errors
from ethpipe.errors import UserError

cluster_app = typer.Typer(help="Describe the cluster you run on (`ethpipe cluster detect`).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
GATHER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    node_rank: int
    init_method: str  # "env://" (torchrun) or "tcp://host:port" (srun)


def _env_int(env: Mapping[str, str], key: str, default: int = 0) -> int:
    try:
        return int(env.get(key, default))
    except ValueError:
        raise UserError(f"environment variable {key}={env.get(key)!r} is not an integer") from None


def _first_slurm_host(nodelist: str) -> str:
    """'gpu[01-04],cpu7' -> 'gpu01' (no scontrol needed for the rendezvous host)."""
    import re

    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    return match.group(1) + (match.group(2) or "") if match else ""


def world_from_env(env: Mapping[str, str]) -> World | None:
    """The torchrun (RANK/WORLD_SIZE) or srun (SLURM_PROCID/SLURM_NTASKS) world; None for a single process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, size = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
        local, node = _env_int(env, "LOCAL_RANK"), _env_int(env, "GROUP_RANK", _env_int(env, "NODE_RANK"))
        init = "env://"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, size = _env_int(env, "SLURM_PROCID"), _env_int(env, "SLURM_NTASKS")
        local, node = _env_int(env, "SLURM_LOCALID"), _env_int(env, "SLURM_NODEID")
        host = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_STEP_NODELIST")
                                                           or env.get("SLURM_JOB_NODELIST") or "")
        if not host:
            raise UserError("under srun but no MASTER_ADDR and no readable SLURM node list: set MASTER_ADDR "
                            "(or pass --local)")
        init = f"tcp://{host}:{_env_int(env, 'MASTER_PORT', 29500)}"
    else:
        return None
    if size < 1 or not 0 <= rank < size:
        raise UserError(f"rank {rank} is not in a world of {size} processes")
    return World(rank, size, local, node, init) if size > 1 else None


def gather_world(facts: Any, world: World, timeout_s: float = GATHER_TIMEOUT_S) -> list[Any] | None:
    """Every node's facts (local rank 0 of each node sends its own), in node-rank order on rank 0; None elsewhere."""
    from datetime import timedelta

    import torch.distributed as dist

    mine = (world.node_rank, facts) if world.local_rank == 0 else None
    gathered: list[Any] = [None] * world.size
    try:
        dist.init_process_group("gloo", init_method=world.init_method, rank=world.rank, world_size=world.size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            dist.all_gather_object(gathered, mine)
        finally:
            dist.destroy_process_group()
    except (RuntimeError, ValueError) as err:  # DistBackendError / DistNetworkError are RuntimeErrors
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"could not gather the {world.size} processes' node descriptions ({first}): start one "
                        "process per node under srun/torchrun, or pass --local") from None
    if world.rank != 0:
        return None
    nodes = sorted((g for g in gathered if g is not None), key=lambda g: g[0])
    if len({n for n, _ in nodes}) != len(nodes):
        raise UserError(f"two processes claim one node rank ({[n for n, _ in nodes]}): set GROUP_RANK / "
                        "SLURM_NODEID per node")
    return [f for _, f in nodes]


def _check_out(out: Path, force: bool) -> None:
    """Refuse before writing (single node: before querying) where the file must not or cannot be written."""
    if out.is_dir():
        raise UserError(f"--out '{out}' is a directory: give a file name such as {out / 'cluster.yaml'}")
    if out.exists() and not force:
        raise UserError(f"'{out}' exists: pass --force to overwrite it, or another --out")
    if not out.parent.is_dir():
        raise UserError(f"directory '{out.parent}' of --out does not exist")


@cluster_app.command("detect")
@user_errors
def detect(
    out: Annotated[Path, typer.Option("--out", help="The cluster file to write.")] = Path("cluster.yaml"),
    name: Annotated[str | None, typer.Option("--name", help="The cluster's name, for the file's header.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    local: Annotated[bool, typer.Option("--local", help="Describe this node only, even under torchrun/srun.")] = False,
    sysfs_root: Annotated[Path, typer.Option("--sysfs-root", help="Where sysfs is mounted (NIC speeds come from its "
                                                                  "class/net and class/infiniband).")] = Path("/sys"),
) -> None:
    """Describe this node (under torchrun/srun: every node, one file written by rank 0) as a cluster file."""
    from ethpipe.cluster import load_cluster
    from ethpipe.cluster_detect import cluster_yaml, detect_cluster, gather_facts
    from ethpipe.atomic import write_text_atomic

    if name is not None and (not name.strip() or "\n" in name):
        raise UserError("--name must be a non-empty single line")
    world = None if local else world_from_env(os.environ)
    if world is None:
        _check_out(out, force)
    facts = gather_facts(sysfs_root) if world is None or world.local_rank == 0 else None
    nodes = [facts] if world is None else gather_world(facts, world)
    if nodes is None:  # not rank 0: rank 0 writes the file
        return
    if world is not None:
        _check_out(out, force)  # only after the gather: a rank 0 that left early would leave the others waiting
    detected = detect_cluster(nodes)
    for message in detected.messages:
        console.print(message, highlight=False, markup=False)
    write_text_atomic(out, cluster_yaml(detected, name))
    load_cluster(out)  # the file must load with the repo's own loader
    fills, entries = sum(len(f) for f in detected.fill_in), len(detected.spec["nodes"])
    console.print(f"wrote {out}: {entries} node entr{'y' if entries == 1 else 'ies'}"
                  + (f", {fills} value(s) marked FILL IN to check" if fills else ""), highlight=False, markup=False)
