"""`ethpipe demo --quick` end to end, as the README runs it: a real subprocess, all three plans trained."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

METHODS = ("eth", "uniform", "layer-balanced")


def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    env = {**os.environ, "COLUMNS": "120", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "ethpipe", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=220, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "demo.json").read_text())
    assert set(result["methods"]) == set(METHODS)
    for method, row in result["methods"].items():
        assert row["steps"] == len(row["losses"]) == len(row["step_times_s"])
        for key in ("measured_step_s", "simulated_step_s", "estimate_step_s", "tokens_per_s"):
            assert row[key] > 0 and math.isfinite(row[key]), (method, key)
        assert row["error"] == pytest.approx((row["simulated_step_s"] - row["measured_step_s"]) / row["measured_step_s"])
        assert method in proc.stdout
        assert f"plan: {row['plan']}" in proc.stdout  # the plan's [stages] printed as text, not eaten as markup
        # Outputs a user can open: plan, metrics (one line per step), trace, timeline picture.
        assert json.loads((out / f"plan-{method}.json").read_text())["emulation"]["compute_s"]
        assert len((out / f"metrics-{method}.jsonl").read_text().splitlines()) == row["steps"]
        assert json.loads((out / f"trace-{method}.json").read_text())["traceEvents"]
        assert (out / f"timeline-{method}.png").read_bytes()[:4] == b"\x89PNG"
    eth = result["methods"]["eth"]["losses"]
    assert eth[-1] < eth[0]  # real text, a few AdamW steps: the loss goes down
    # Every plan trains the same model exactly: the same loss at every step they share.
    assert result["loss_spread_at_common_step"]["max_abs_diff"] < 1e-4
    for method in ("uniform", "layer-balanced"):
        expected = result["methods"][method]["measured_step_s"] / result["methods"]["eth"]["measured_step_s"]
        assert result["speedup"][method] == pytest.approx(expected)
    assert "ETH measured speed-up" in proc.stdout
    assert not (out / "tokens.bin").exists()
