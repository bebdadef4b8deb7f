"""One job file from `plan` to a validated, resumed run (docs/cluster.md's walkthrough, on the CPU demo cluster).

`ethpipe plan --config job.toml`, then `ethpipe train --config job.toml` (4 steps, a checkpoint and a validation
loss every 2), then the same file with `--steps 6 --resume`: the resumed run continues at step 5 and validates at
step 6; every path is relative to the job file and the commands run from another directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.tokens.split import split_validation

pytestmark = [pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
JOB = """[cluster]
file = "cluster.yaml"
[model]
name = "tiny"
[plan]
global-batch = 24
seq-len = 64
max-tp = 1
dtype = "fp32"
out = "plan.json"
[train]
data = "tokens.bin"
steps = 4
no-progress = true
[checkpoint]
dir = "ckpt"
save-every = 2
[metrics]
file = "m.jsonl"
[validation]
val-data = "tokens.val.bin"
eval-every = 2
eval-batches = 1
"""


def _ethpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ethpipe", *args], capture_output=True, text=True, timeout=240,
                          cwd=cwd, env=env)


def test_one_job_file_plans_trains_validates_and_resumes(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "cluster.yaml").write_text((REPO / "examples/clusters/cpu_demo.yaml").read_text())
    prepare_tokens(builtin_text(300_000), job / "tokens.bin")
    split_validation(job / "tokens.bin", 0.1)
    (job / "job.toml").write_text(JOB)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args in (("plan", "--config", str(job / "job.toml")), ("train", "--config", str(job / "job.toml")),
                 ("train", "--config", str(job / "job.toml"), "--steps", "6", "--resume")):
        proc = _ethpipe(*args, cwd=elsewhere)
        assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (job / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # the resumed run appended steps 5 and 6
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6]
    assert sorted(p.name for p in (job / "ckpt").glob("step-*")) == ["step-00000002", "step-00000004", "step-00000006"]
    assert not list(elsewhere.iterdir())  # nothing written where the commands ran
