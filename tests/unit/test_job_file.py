"""One job file of sections for `plan`, `train` and `launch` (cli/run_config.py): each reads its sections, paths
are relative to the file, typos are one line naming the nearest valid section or key."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app

REPO = Path(__file__).resolve().parents[2]

JOB = """
[cluster]
file = "cluster.yaml"
[model]
name = "tiny"
[plan]
global-batch = 24
seq-len = 128
max-tp = 1
dtype = "fp32"
out = "plans/plan.json"
[train]
data = "tokens.bin"
steps = 4
[checkpoint]
dir = "ckpt"
save-every = 2
[metrics]
file = "m.jsonl"
[validation]
val-data = "tokens.val.bin"
eval-every = 2
[launch]
hosts = "hosts"
max-restarts = 2
"""


@pytest.fixture()
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "job"
    (folder / "plans").mkdir(parents=True)
    (folder / "cluster.yaml").write_text((REPO / "examples/clusters/cpu_demo.yaml").read_text())
    (folder / "hosts").write_text("n0\nn1\nn2\n")
    (folder / "job.toml").write_text(JOB)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a node's shell starts in another directory
    return folder / "job.toml"


def test_plan_and_launch_read_their_sections_relative_to_the_file(job: Path) -> None:
    res = CliRunner().invoke(app, ["plan", "--config", str(job)])
    assert res.exit_code == 0, res.output
    assert (job.parent / "plans" / "plan.json").is_file()
    res = CliRunner().invoke(app, ["launch", "--config", str(job)])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("ETHPIPE_NODE_RANK")]
    assert len(lines) == 3 and all(f"--config {job.resolve()}" in line for line in lines)
    assert all(f"--plan {(job.parent / 'plans' / 'plan.json').resolve()}" in line for line in lines)
    assert all("--max-restarts 2" in line and "--auto-resume" in line for line in lines)  # [checkpoint] dir set
    assert "# on n2:" in res.output  # [launch] hosts, read from beside the file


@pytest.mark.parametrize("text, message", [
    ("[trian]\nsteps = 3\n", "unknown section [trian]: did you mean [train]?"),
    ("[plan]\nglobal-bacth = 3\n", "unknown key 'global-bacth' in [plan]: did you mean 'global-batch'?"),
    ("[checkpoint]\nsave-evry = 3\n", "unknown key 'save-evry' in [checkpoint]: did you mean 'save-every'?"),
])
def test_a_typo_is_one_line_naming_the_nearest(job: Path, text: str, message: str) -> None:
    job.write_text(text)
    command = "plan" if "[plan]" in text else "train"
    res = CliRunner().invoke(app, [command, "--config", str(job)])
    assert res.exit_code == 2 and message in res.output, res.output


def test_the_printed_line_keeps_the_brackets(tmp_path: Path) -> None:
    """The console prints click's usage errors as text: `[train]` is not rich markup to be swallowed."""
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text("[trian]\nsteps = 3\n")
    proc = subprocess.run([sys.executable, "-m", "ethpipe", "train", "--config", str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "unknown section [trian]: did you mean [train]?" in proc.stderr
