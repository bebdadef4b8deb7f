"""`ethpipe simulate` / `ethpipe profile`: outputs, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks

CLUSTER = {"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100},
                     {"gpu": "h100_sxm", "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 100}]}


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    pipes = (
        Pipeline((Stage((0,), "a100_80gb_sxm", (0, 4)), Stage((1,), "a100_80gb_sxm", (4, 8))), (2, 2, 1)),
        Pipeline((Stage((2,), "h100_sxm", (0, 8)),), (2, 2, 2)),
    )
    plan = Plan("eth", "tiny", 11, 64, pipes, compute_blocks(pipes), cluster=CLUSTER)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def _run(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, list(args))


def test_simulate_writes_trace_timeline_and_json(plan_file: Path, tmp_path: Path) -> None:
    trace, png = tmp_path / "out" / "trace.json", tmp_path / "out" / "timeline.png"
    result = _run("simulate", str(plan_file), "--trace", str(trace), "--timeline", str(png), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["iteration_time_s"] > 0 and len(report["ranks"]) == 3
    assert report["critical_path"][-1]["name"] == "optimizer"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X" and e["name"] == "F2") == 3  # one per stage
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_table_and_flat_sync(plan_file: Path) -> None:
    blockwise = _run("simulate", str(plan_file))
    assert blockwise.exit_code == 0 and "iteration time" in blockwise.stdout and "block-wise" in blockwise.stdout
    assert "nodes: node 0 (2 x a100_80gb_sxm): ranks 0-1; node 1 (1 x h100_sxm): ranks 2-2" in blockwise.stdout
    flat = _run("simulate", str(plan_file), "--flat-sync", "--json")
    block = _run("simulate", str(plan_file), "--json")
    assert json.loads(flat.stdout)["iteration_time_s"] >= json.loads(block.stdout)["iteration_time_s"]


@pytest.mark.parametrize(("content", "message"), [
    (None, "not found"),
    ("{oops", "not valid JSON"),
    ('{"version": 1}', "plan field"),
])
def test_simulate_bad_plans_exit_2_with_one_line(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    trace = tmp_path / "trace.json"
    result = _run("simulate", str(path), "--trace", str(trace))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output
    assert not trace.exists()


def test_simulate_profile_pairs_are_checked(plan_file: Path, tmp_path: Path) -> None:
    result = _run("simulate", str(plan_file), "--profile", str(tmp_path / "p.json"))
    assert result.exit_code == 2 and "--profile-as" in result.stderr
    result = _run("simulate", str(plan_file), "--profile", str(tmp_path / "p.json"), "--profile-as", "h100_sxm")
    assert result.exit_code == 2 and "not found" in result.stderr


def test_profile_command_writes_a_loadable_profile(plan_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "prof.json"
    result = _run("profile", "--model", "tiny", "--seq-len", "64", "--micro-batch-sizes", "1,2",
                  "--repeats", "1", "--warmup", "0", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert set(json.loads(out.read_text())["layers"]["block"]) == {"1", "2"}
    sim = _run("simulate", str(plan_file), "--profile", str(out), "--profile-as", "h100_sxm", "--json")
    assert sim.exit_code == 0, sim.output
    assert json.loads(sim.stdout)["iteration_time_s"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (("--micro-batch-sizes", "1,x"), "--micro-batch-sizes"),
    (("--device", "tpu"), "--device"),
    (("--model", "no-such-model"), "no-such-model"),
])
def test_profile_errors_exit_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    base = {"--model": "tiny", "--seq-len": "16", "--out": str(tmp_path / "p.json")}
    base.update(dict(zip(args[::2], args[1::2])))
    result = _run("profile", *[x for kv in base.items() for x in kv])
    assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_the_nodes_line_groups_alike_consecutive_nodes() -> None:
    """At 1024 GPUs the line listed 128 nodes one by one; alike consecutive nodes are one entry."""
    from ethpipe.cli.plan_lines import nodes_line
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.model_load import load_model_spec
    from ethpipe.planner import make_plan

    cluster = cluster_from_dict({"nodes": [{"gpu": "h100_sxm", "num_nodes": 16, "gpus_per_node": 8, "nic_gbit_s": 400},
                                           {"gpu": "a100_80gb_sxm", "num_nodes": 16, "gpus_per_node": 8,
                                            "nic_gbit_s": 400}]})
    plan = make_plan(cluster, load_model_spec("gpt3-1.3b"), 256, 2048)
    line = nodes_line(plan)
    assert line.count(";") < 4 and "each)" in line, line
