"""`--config FILE.toml`: the command's own options from a file (click's default map), the command line on top."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app

ARGS = ["--cluster", "examples/clusters/cpu_demo.yaml", "--model", "tiny", "--global-batch", "24",
        "--seq-len", "128", "--max-tp", "1", "--dtype", "fp32", "--no-shard-optimizer"]
TOML = """cluster = "examples/clusters/cpu_demo.yaml"
model = "tiny"
global-batch = 24
seq_len = 128          # underscores read alike
max-tp = 1
dtype = "fp32"
no-shard-optimizer = true
"""


def _plan(args: list[str]) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    plan["predicted"].pop("planning_time_s")
    plan.pop("search", None)  # the planner's record of itself (timings)
    return plan


def test_a_config_file_reproduces_the_command_line_plan_and_the_command_line_overrides_it(tmp_path: Path) -> None:
    (tmp_path / "plan.toml").write_text(TOML)
    from_cli = _plan(ARGS)
    from_file = _plan(["--config", str(tmp_path / "plan.toml")])
    assert from_file == from_cli
    overridden = _plan(["--config", str(tmp_path / "plan.toml"), "--global-batch", "12", "--shard-optimizer"])
    assert overridden["global_batch_size"] == 12
    assert overridden == _plan([*ARGS[:5], "12", *ARGS[6:-1], "--shard-optimizer"])


def test_bad_config_files_get_one_line(tmp_path: Path) -> None:
    cases = {"unknown.toml": ("bogus = 1\n", "unknown key 'bogus'"),
             "typo.toml": ("globalbatch = 24\n", "unknown key 'globalbatch': did you mean 'global_batch'?"),
             "syntax.toml": ("model = \n", "is not valid TOML"),
             "type.toml": (TOML.replace("global-batch = 24", 'global-batch = "many"'), "'--global-batch'")}
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        code, out = _ethpipe(["plan", "--config", str(tmp_path / name)])
        assert code == 2 and len(out.strip().splitlines()) == 1 and out.startswith("error:"), out
        assert expected in out, out
        assert out.count("--help") <= 1, out  # one hint, not two
    code, out = _ethpipe(["plan", "--config", str(tmp_path / "nope.toml")])
    assert code == 2 and "cannot read" in out


def _ethpipe(args: list[str]) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "ethpipe", *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr
