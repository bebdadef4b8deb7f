"""From a plan to the per-node commands that run it: which ranks each node hosts, and the torchrun lines.

Ranks are the plan's active devices in cluster-file order (docs/plan-format.md, "Idle devices"), so node
``k`` of the cluster file hosts a contiguous range of ranks, and the torchrun world must number its nodes
in that order. torchrun's c10d rendezvous numbers nodes by the order they join (the first agent to arrive
gets ranks 0..); the static rendezvous with ``--node-rank`` in the plan's node order is the one that puts
every rank on the node it was planned for. Nodes whose devices are all idle run nothing; a node with idle
devices hides them with ``CUDA_VISIBLE_DEVICES``. Every command sets ``ETHPIPE_NODE_RANK``, which
``ethpipe train`` checks against the plan (``check_node``) so a node started with the wrong rank ends the
job in seconds with one line instead of training a stage on the wrong GPUs.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ethpipe.errors import UserError
from ethpipe.plan import Plan

NODE_RANK_ENV = "ETHPIPE_NODE_RANK"
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeRanks:
    """One node of the torchrun world: its node index in the cluster file, its ranks, its local devices."""

    cluster_node: int
    gpu: str
    first_rank: int
    num_ranks: int
    local_devices: tuple[int, ...]  # indices on the node of the devices its ranks use (CUDA_VISIBLE_DEVICES)
    accelerator: bool = True  # a GPU (a catalog or vendor entry), not a pseudo-device of a CPU run

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.num_ranks)


def node_ranks(plan: Plan) -> list[NodeRanks]:
    """The plan's nodes that run ranks, in rank order (= cluster-file order)."""
    active = plan.active_cluster()
    out: list[NodeRanks] = []
    full_local = {i: d.local_rank for i, d in enumerate(_full_devices(plan))}
    for rank, (device, index) in enumerate(zip(active.devices, active.device_indices)):
        if out and out[-1].cluster_node == device.node:
            last = out[-1]
            out[-1] = NodeRanks(last.cluster_node, last.gpu, last.first_rank, last.num_ranks + 1,
                                last.local_devices + (full_local[index],), last.accelerator)
        else:
            out.append(NodeRanks(device.node, device.gpu.id, rank, 1, (full_local[index],), bool(device.gpu.vendor)))
    return out


def cluster_node_count(plan: Plan) -> int:
    """How many nodes the plan's cluster file lists (idle ones included)."""
    return len({d.node for d in _full_devices(plan)})


def _full_devices(plan: Plan) -> tuple:
    from ethpipe.cluster import cluster_from_dict

    assert plan.cluster is not None
    return cluster_from_dict(plan.cluster).devices


def read_hosts(path: str | Path, nodes: list[NodeRanks], num_cluster_nodes: int | None = None) -> list[str]:
    """The hosts of the nodes that run ranks, in plan order, from a hostfile (one host per line, ``#`` comments
    and blank lines ignored) that lists either every node of the cluster file (the idle ones are left out here:
    the plan knows them) or only the nodes that run ranks."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"hostfile '{path}' not found: write one host name per line, in the cluster file's node order")
    hosts = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    hosts = [h for h in hosts if h]
    if num_cluster_nodes is not None and len(hosts) == num_cluster_nodes != len(nodes):
        return [hosts[n.cluster_node] for n in nodes]
    if len(hosts) != len(nodes):
        want = ", ".join(f"node {n.cluster_node}: {n.num_ranks} x {n.gpu}" for n in nodes)
        every = f" or all {num_cluster_nodes} of the cluster file" if num_cluster_nodes not in (None, len(nodes)) else ""
        raise UserError(f"hostfile '{path}' lists {len(hosts)} hosts but the plan runs on {len(nodes)} nodes ({want}): "
                        f"give one host per node that runs ranks{every}, in the cluster file's node order")
    return hosts


def recorded_hosts(plan: Plan, nodes: list[NodeRanks]) -> list[str]:
    """The hosts the cluster file names (``hostname:``, as `ethpipe cluster detect` writes), in plan order."""
    names: list[str | None] = []
    for group in (plan.cluster or {}).get("nodes", []):
        names += [group.get("hostname")] * int(group.get("num_nodes", 1))
    missing = [n.cluster_node for n in nodes if names[n.cluster_node] is None]
    named = [names[n.cluster_node] for n in nodes if names[n.cluster_node] is not None]
    twice = sorted({h for h in named if named.count(h) > 1})
    if twice:
        raise UserError(f"host '{twice[0]}' names several node entries of the cluster file (a node with two GPU types): "
                        "give --hosts FILE, and start that node's GPU types as separate nodes")
    if missing:
        raise UserError(f"the plan's cluster file names no host for node {missing[0]}: give --hosts FILE (one host "
                        "per node, in the cluster file's order) or a 'hostname:' on every node entry")
    return [str(names[n.cluster_node]) for n in nodes]


def node_command(plan_path: str, node_rank: int, node: NodeRanks, num_nodes: int, master: str, port: int,
                 train_args: list[str], max_restarts: int = 0, bind_devices: bool = True) -> str:
    """The shell line that starts one node's ranks (``bind_devices``: pick its devices with
    ``CUDA_VISIBLE_DEVICES``; False where a scheduler binds them, as SLURM's GPU allocation does)."""
    env = f"{NODE_RANK_ENV}={node_rank}"
    if bind_devices:
        env += f" CUDA_VISIBLE_DEVICES={','.join(map(str, node.local_devices))}"
    torchrun = (f"torchrun --nnodes {num_nodes} --node-rank {node_rank} --nproc-per-node {node.num_ranks} "
                f"--master-addr {shlex.quote(master)} --master-port {port}"
                + (f" --max-restarts {max_restarts}" if max_restarts else ""))
    train = " ".join(["-m", "ethpipe", "train", "--plan", shlex.quote(plan_path), *map(shlex.quote, train_args)])
    return f"{env} {torchrun} {train}"


def commands(plan: Plan, plan_path: str, hosts: list[str], train_args: list[str], port: int = DEFAULT_PORT,
             max_restarts: int = 0, bind_devices: bool = True) -> list[tuple[str, NodeRanks, str]]:
    """(host, node, command) per node, in node-rank order."""
    nodes = node_ranks(plan)
    assert len(hosts) == len(nodes)
    return [(host, node, node_command(plan_path, k, node, len(nodes), hosts[0], port, train_args, max_restarts,
                                      bind_devices))
            for k, (host, node) in enumerate(zip(hosts, nodes))]


@dataclass(frozen=True)
class SlurmOptions:
    """What an sbatch script asks SLURM for besides the nodes (``ethpipe launch --scheduler slurm``)."""

    job_name: str = "ethpipe"
    time_limit: str = "24:00:00"  # --time: a site's default limit is often minutes
    output: str = "ethpipe-%j.out"  # --output (%j: the job id)
    exclusive: bool = True  # whole nodes: another job's processes would skew the plan's measured speeds


def slurm_script(plan: Plan, plan_path: str, hosts: list[str], train_args: list[str], port: int = DEFAULT_PORT,
                 options: SlurmOptions = SlurmOptions(), max_restarts: int = 0) -> str:
    """An sbatch script: one task per node, each node's command picked by its SLURM node name (SLURM orders
    ``SLURM_NODEID`` its own way, so the node rank comes from the plan's host order, not from it).

    Each node's GPUs come from SLURM's own binding (``--gpus-per-node``: the task sees the GPUs SLURM allocated
    it, renumbered from 0; nothing is pinned by hand). Nodes that run different numbers of ranks are the
    components of a heterogeneous job (``#SBATCH hetjob``: one per run of consecutive nodes with the same
    count), started by one ``srun --het-group`` over all of them."""
    runs: list[tuple[int, bool, list[str]]] = []  # (ranks per node, GPUs?, hosts)
    for host, node in zip(hosts, node_ranks(plan)):
        if runs and runs[-1][:2] == (node.num_ranks, node.accelerator):
            runs[-1][2].append(host)
        else:
            runs.append((node.num_ranks, node.accelerator, [host]))
    lines = ["#!/bin/bash", f"#SBATCH --job-name={options.job_name}", f"#SBATCH --time={options.time_limit}",
             f"#SBATCH --output={options.output}"]
    for k, (count, gpus, group) in enumerate(runs):
        if k:
            lines.append("#SBATCH hetjob")
        lines.append(f"#SBATCH --nodes={len(group)} --ntasks-per-node=1"
                     + (f" --gpus-per-node={count}" if gpus else f" --cpus-per-task={count}")
                     + (" --exclusive" if options.exclusive else "") + f" --nodelist={','.join(group)}")
    lines += ["set -euo pipefail",
              "# generated by `ethpipe launch --scheduler slurm`: node ranks follow the plan's node order; each",
              "# node's GPUs are the ones SLURM allocated it (--gpus-per-node), so nothing sets CUDA_VISIBLE_DEVICES", "",
              "srun" + (f" --het-group=0-{len(runs) - 1}" if len(runs) > 1 else "") + " --kill-on-bad-exit=1 bash -c '",
              'case "${SLURMD_NODENAME:-$(hostname -s)}" in']
    for host, node, command in commands(plan, plan_path, hosts, train_args, port, max_restarts, bind_devices=False):
        lines.append(f"  {host}) exec env {command.replace(chr(39), chr(39) + chr(92) + chr(39) + chr(39))} ;;  "
                     f"# ranks {node.ranks.start}-{node.ranks.stop - 1}")
    lines += ['  *) echo "ethpipe launch: node $(hostname -s) is not in the plan" >&2; exit 2 ;;', "esac'", ""]
    return "\n".join(lines)


def check_node(plan: Plan, rank: int) -> None:
    """Under ``ethpipe launch`` (``ETHPIPE_NODE_RANK`` set): this rank runs on the node the plan put it on."""
    text = os.environ.get(NODE_RANK_ENV)
    if text is None or plan.cluster is None:
        return
    nodes = node_ranks(plan)
    planned = next(k for k, n in enumerate(nodes) if rank in n.ranks)
    if int(text) != planned:
        raise UserError(f"rank {rank} runs on the node started with {NODE_RANK_ENV}={text} but the plan puts it on "
                        f"node rank {planned} ({nodes[planned].num_ranks} x {nodes[planned].gpu}): start every node "
                        "with the command `ethpipe launch` printed for it")
