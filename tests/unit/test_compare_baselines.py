"""`ethpipe compare` prices what a Megatron user would run too: each baseline on the best homogeneous subset (the
one GPU type fastest alone), and states eth's speed-up over the best of all baselines."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cluster import load_cluster
from ethpipe.planner.baselines.homogeneous import homogeneous_subsets


def test_each_type_alone_is_a_subset() -> None:
    cluster = load_cluster("examples/clusters/h100_a100_l4.yaml")
    subsets = homogeneous_subsets(cluster)
    assert list(subsets) == ["h100_sxm", "a100_40gb_sxm", "l4"]
    assert [s.num_devices for s in subsets.values()] == [16, 32, 16]
    assert all({d.gpu.id for d in s.devices} == {gpu} and len(s.idle_devices) == 64 - s.num_devices
               for gpu, s in subsets.items())


def test_compare_states_the_speedup_over_the_best_baseline(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    res = CliRunner().invoke(app, ["compare", "--cluster", "examples/clusters/h100_a100_l4.yaml", "--model",
                                   "llama2-7b", "--global-batch", "64", "--seq-len", "4096", "--out", str(out),
                                   "--plot", str(tmp_path / "c.png")], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    rows = result["methods"]
    best_type = rows["uniform (best type)"]
    assert best_type["devices"] == "16 h100_sxm" and best_type["num_idle_devices"] == 48  # the H100s alone
    baselines = [m for m in rows if m.startswith(("uniform", "layer-balanced"))]
    assert len(baselines) == 4 and all(rows[m]["eth_speedup"] >= 1.0 for m in rows)  # eth never slower
    best = min(baselines, key=lambda m: rows[m]["iteration_time_s"])
    assert result["best_baseline"] == best and result["eth_speedup_over_best_baseline"] == rows[best]["eth_speedup"]
    assert f"over the best baseline, {best}" in res.output
    assert rows["uniform (best type)"]["eth_speedup"] < rows["uniform"]["eth_speedup"]  # the honest figure is lower
