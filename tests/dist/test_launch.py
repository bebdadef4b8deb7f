"""`ethpipe launch` prints per-node commands that, run as printed, train the plan with every rank on its node.

The demo cluster (3 nodes of 2 types, 6 ranks) on local processes: three torchrun agents on 127.0.0.1, one
per printed line, train a plan for 3 steps. The SLURM script passes `bash -n`; a hostfile with the wrong
number of hosts gets one line; a rank started on the wrong node is refused by `ethpipe train`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cluster_launch import NODE_RANK_ENV, check_node
from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.tokens.texts import prepare_tokens

pytestmark = [pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "examples" / "clusters" / "cpu_demo.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(tmp: Path) -> Path:
    out = tmp / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24",
                                   "--seq-len", "128", "--max-tp", "1", "--dtype", "fp32", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "nodes: node 0 (2 x fast): ranks 0-1; nodes 1-2 (2 x slow each): ranks 2-5" in res.output
    return out


def test_the_printed_commands_train_the_plan_on_local_processes(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    assert Plan.load(plan).world_size == 6
    data = tmp_path / "tokens.bin"
    prepare_tokens([" ".join(np.random.default_rng(1).choice(["node", "rank", "host", "."], size=12000))], str(data))
    hosts = tmp_path / "hosts"
    hosts.write_text("# the cluster file's node order\n127.0.0.1\n127.0.0.1\n127.0.0.1\n")
    runner = CliRunner()
    res = runner.invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts), "--port", str(_free_port()), "--",
                              "--data", str(data), "--steps", "3", "--device", "cpu", "--no-progress",
                              "--timeout-s", "60", "--metrics", str(tmp_path / "m.jsonl")])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line and not line.startswith("#")]
    assert [line.split(f"{NODE_RANK_ENV}=")[1][0] for line in lines] == ["0", "1", "2"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(line, shell=True, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for line in lines]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[:3000] for o in outputs)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]

    script = runner.invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts), "--scheduler", "slurm", "--",
                                 "--data", "tokens.bin", "--steps", "3"])
    assert script.exit_code == 0 and "#SBATCH --nodes=3" in script.output
    subprocess.run(["bash", "-n"], input=script.output, text=True, check=True)

    hosts.write_text("a\nb\n")
    bad = runner.invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts)])
    assert bad.exit_code == 2
    assert "lists 2 hosts but the plan runs on 3 nodes" in bad.output and len(bad.output.strip().splitlines()) == 1


def test_a_rank_on_the_wrong_node_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = Plan.load(_plan(tmp_path))
    monkeypatch.setenv(NODE_RANK_ENV, "1")
    check_node(plan, 2)  # ranks 2-3 are node 1
    with pytest.raises(UserError, match=f"rank 0 runs on the node started with {NODE_RANK_ENV}=1 but the plan puts "
                                        "it on node rank 0"):
        check_node(plan, 0)


def test_torchrun_agents_with_the_data_missing_on_one_node_all_end_within_30_s_with_one_cause(
        tmp_path: Path) -> None:
    """The launch lines run as printed, node 1 started where the token file is not: every agent ends within 30 s
    (not --timeout-s), the cause is printed once, by the rank that has it."""
    plan = _plan(tmp_path)
    shared, bare = tmp_path / "shared", tmp_path / "bare"
    shared.mkdir()
    bare.mkdir()
    prepare_tokens([" ".join(np.random.default_rng(1).choice(["node", "rank", "."], size=12000))],
                   str(shared / "tokens.bin"))
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.1\n127.0.0.1\n")
    res = CliRunner().invoke(app, ["launch", "--plan", str(plan), "--hosts", str(hosts), "--port", str(_free_port()),
                                   "--max-restarts", "0",  # one failure's cause, not the restarts after it
                                   "--", "--data", "tokens.bin", "--steps", "3", "--device", "cpu", "--no-progress",
                                   "--timeout-s", "300"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line and not line.startswith("#")]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    procs = [subprocess.Popen(line, shell=True, cwd=bare if node == 1 else shared, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node, line in enumerate(lines)]
    try:
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    elapsed_s = time.monotonic() - started
    assert elapsed_s < 30.0 and all(p.returncode != 0 for p in procs), (elapsed_s, outputs)
    causes = [line for out in outputs for line in out.splitlines() if line.startswith("error:")]
    assert len(causes) == 1 and "rank 2 on " in causes[0] and "tokens.bin' not found" in causes[0], outputs
    assert causes[0] in outputs[1]  # printed on the node that lacks the file
