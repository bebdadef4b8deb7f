"""`ethpipe launch --scheduler slurm` on a cluster of nodes with different GPU counts, and hostfiles with idle nodes.

The script must get each node's GPUs through SLURM's own binding (no hand-set ``CUDA_VISIBLE_DEVICES``, which on a
gres-managed cluster names devices the task cannot see): a heterogeneous job whose components ask
``--gpus-per-node`` for exactly the ranks each node runs; it passes ``bash -n`` and carries a time limit, a log
file and whole nodes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cluster_launch import node_ranks
from ethpipe.plan import Plan

CLUSTER = """nodes:
  - {gpu: h100_sxm, num_nodes: 2, gpus_per_node: 8, nic_gbit_s: 400}
  - {gpu: a100_80gb_sxm, num_nodes: 1, gpus_per_node: 4, nic_gbit_s: 200}
"""


def _plan(tmp: Path, cluster: str, *extra: str) -> Path:
    (tmp / "cluster.yaml").write_text(cluster)
    out = tmp / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--cluster", str(tmp / "cluster.yaml"), "--model", "llama2-7b",
                                   "--global-batch", "64", "--seq-len", "2048", "--no-idle", "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    return out


def _components(script: str) -> list[tuple[int, list[str]]]:
    """(gpus per node, hosts) of each job component, from its ``#SBATCH --nodes=...`` line."""
    out = []
    for line in script.splitlines():
        if line.startswith("#SBATCH --nodes="):
            gpus = re.search(r"--gpus-per-node=(\d+)", line)
            assert gpus, line
            out.append((int(gpus.group(1)), re.search(r"--nodelist=(\S+)", line).group(1).split(",")))  # type: ignore[union-attr]
    return out


def test_the_sbatch_script_binds_each_nodes_gpus_through_slurm(tmp_path: Path) -> None:
    plan = _plan(tmp_path, CLUSTER)
    hosts = tmp_path / "hosts"
    hosts.write_text("h0\nh1\na0\n")
    res = CliRunner().invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts), "--scheduler", "slurm",
                                   "--time", "2-00:00:00", "--", "--data", "tokens.bin", "--checkpoint-dir", "ck"])
    assert res.exit_code == 0, res.output
    script = res.output
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert not [line for line in script.splitlines() if "CUDA_VISIBLE_DEVICES=" in line]  # only the comment names it
    assert "#SBATCH --time=2-00:00:00" in script and "#SBATCH --output=ethpipe-%j.out" in script
    assert script.count("#SBATCH hetjob") == 1 and "srun --het-group=0-1 --kill-on-bad-exit=1" in script
    components = _components(script)
    assert all("--exclusive" in line for line in script.splitlines() if line.startswith("#SBATCH --nodes="))
    given = {host: gpus for gpus, group in components for host in group}
    nodes = node_ranks(Plan.load(plan))
    assert [given[h] for h in ("h0", "h1", "a0")] == [n.num_ranks for n in nodes] == [8, 8, 4]
    for host, node in zip(("h0", "h1", "a0"), nodes):  # each host's line starts its own node rank, restarts on
        line = next(x for x in script.splitlines() if x.strip().startswith(f"{host})"))
        assert f"--nproc-per-node {node.num_ranks}" in line and "--max-restarts 3" in line
        assert "--auto-resume" in line and f"--plan {plan.resolve()}" in line


def test_one_gpu_count_is_one_job_and_a_bad_time_is_one_line(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "nodes:\n  - {gpu: h100_sxm, num_nodes: 2, gpus_per_node: 8, nic_gbit_s: 400}\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("h0\nh1\n")
    res = CliRunner().invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts), "--scheduler", "slurm",
                                   "--shared-nodes"])
    assert res.exit_code == 0 and "hetjob" not in res.output and "--het-group" not in res.output
    assert _components(res.output) == [(8, ["h0", "h1"])] and "--exclusive" not in res.output
    bad = CliRunner().invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts), "--scheduler", "slurm",
                                   "--time", "two days"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1 and "--time must be" in bad.output


def test_a_hostfile_may_list_the_idle_nodes_too(tmp_path: Path) -> None:
    """A cluster whose last node the planner leaves idle: the hostfile of every node of the cluster file is taken
    (the idle node's host left out), as is the one of the nodes that run ranks; another count is one line."""
    cluster = ("nodes:\n  - {gpu: h100_sxm, num_nodes: 2, gpus_per_node: 8, nic_gbit_s: 400}\n"
               "  - {gpu: t4, num_nodes: 1, gpus_per_node: 1, nic_gbit_s: 1}\n")
    (tmp_path / "cluster.yaml").write_text(cluster)
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--cluster", str(tmp_path / "cluster.yaml"), "--model", "llama2-7b",
                                   "--global-batch", "64", "--seq-len", "2048", "--dtype", "fp16", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert Plan.load(out).idle_devices, "precondition: the T4 node is idle"
    hosts = tmp_path / "hosts"
    for text in ("h0\nh1\nt0\n", "h0\nh1\n"):
        hosts.write_text(text)
        res = CliRunner().invoke(app, ["launch", "--plan", str(out), "--hosts", str(hosts)])
        assert res.exit_code == 0, res.output
        assert "# on h0:" in res.output and "# on h1:" in res.output and "t0" not in res.output
    hosts.write_text("h0\n")
    bad = CliRunner().invoke(app, ["launch", "--plan", str(out), "--hosts", str(hosts)])
    assert bad.exit_code == 2 and "or all 3 of the cluster file" in bad.output
