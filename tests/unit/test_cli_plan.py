import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethpipe.cli.app import app
from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.plan import Plan

DEMO = "examples/clusters/cpu_demo.yaml"
runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


def test_plan_writes_valid_plan_and_prints_table(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    res = _run("plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "32", "--seq-len", "64",
               "--max-tp", "1", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "balance efficiency" in res.output and "tokens/s" in res.output
    plan = Plan.load(out)
    assert plan.global_batch_size == 32 and plan.method == "eth"


def test_plan_json_to_stdout() -> None:
    res = _run("plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24", "--seq-len", "64",
               "--method", "uniform", "--json")
    assert res.exit_code == 0
    assert Plan.from_dict(json.loads(res.stdout)).method == "uniform"


def test_compare_writes_results_and_plot(tmp_path: Path) -> None:
    out, fig = tmp_path / "r.json", tmp_path / "fig.png"
    res = _run("compare", "--cluster", DEMO, "--model", "tiny", "--global-batch", "32", "--seq-len", "64",
               "--out", str(out), "--plot", str(fig))
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert set(data["methods"]) == {"eth", "eth (no ZeRO)", "eth 1F1B only", "uniform", "layer-balanced",
                                    "uniform (best type)", "layer-balanced (best type)"}  # two types: fast, slow
    assert data["methods"]["eth"]["eth_speedup"] == 1.0
    assert data["methods"]["eth (no ZeRO)"]["eth_speedup"] >= 1.0 - 1e-9  # eth is the faster of the two
    assert data["methods"]["eth 1F1B only"]["eth_speedup"] >= 1.0 - 1e-9  # ... and with every schedule allowed
    assert data["methods"]["eth 1F1B only"]["schedules"] == ["1f1b"]
    assert data["methods"]["uniform"]["schedules"] == ["1f1b"]  # the baselines run their own schedule
    one = _run("compare", "--cluster", DEMO, "--model", "tiny", "--global-batch", "32", "--seq-len", "64",
               "--schedules", "1f1b", "--out", str(out))
    assert one.exit_code == 0, one.output
    assert "eth 1F1B only" not in json.loads(out.read_text())["methods"]  # the same plan as eth then
    assert fig.read_bytes()[:4] == b"\x89PNG"
    vector = tmp_path / "fig.svg"
    res = _run("compare", "--cluster", DEMO, "--model", "tiny", "--global-batch", "32", "--seq-len", "64",
               "--plot", str(vector))
    assert res.exit_code == 0 and b"<svg" in vector.read_bytes()[:400]  # the format the name asks for


def test_catalog_lists_gpus_and_models() -> None:
    res = _run("catalog")
    assert res.exit_code == 0 and "a100_80gb_sxm" in res.output and "llama2-70b" in res.output


@pytest.mark.parametrize("args, needle", [
    (["--cluster", "missing.yaml", "--model", "tiny"], "not found"),
    (["--cluster", DEMO, "--model", "gpt-9"], "unknown model"),
    (["--cluster", DEMO, "--model", "tiny", "--method", "best"], "unknown method"),
    (["--cluster", DEMO, "--model", "llama2-70b"], "llama2-70b needs"),
    (["--cluster", "examples/clusters/a100_v100.yaml", "--model", "tiny", "--max-tp", "1", "--global-batch", "1"],
     "smaller than the"),
    (["--cluster", DEMO, "--model", "tiny", "--profile", "x.json"], "--profile-as"),
    (["--cluster", DEMO, "--model", "tiny", "--attention", "flash2"], "attention must be one of auto, materialised"),
    (["--cluster", DEMO, "--model", "tiny", "--global-batch", "100000000"],  # extra zeros: one line, not an OOM
     "--global-batch 100000000 is 16666666 samples per device, above 65536"),
])
def test_errors_one_line_exit_2_no_file(tmp_path: Path, args, needle) -> None:
    out = tmp_path / "plan.json"
    full = ["plan", "--global-batch", "24", "--seq-len", "64", *args, "--out", str(out)]
    res = _run(*full)
    assert res.exit_code == 2
    lines = [line for line in res.output.strip().splitlines() if line]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.output
    assert not out.exists()


def test_console_script_error_path(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - {gpu: h900, num_nodes: 1, gpus_per_node: 1, nic_gbit_s: 1}\n")
    res = subprocess.run([sys.executable, "-m", "ethpipe", "plan", "--cluster", str(bad), "--model", "tiny",
                          "--global-batch", "4", "--seq-len", "64"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "h900" in res.stderr


def test_piped_tables_keep_their_full_width() -> None:
    """Piped (a SLURM log, `| tee`) nothing is cut at 80 columns: no ellipsis, every table row on one line."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    for args in (["catalog"], ["compare", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24",
                               "--seq-len", "128", "--max-tp", "1", "--dtype", "fp32"]):
        out = subprocess.run([sys.executable, "-m", "ethpipe", *args], capture_output=True, text=True, env=env,
                             check=True).stdout
        rows = [line for line in out.splitlines() if line.startswith("│")]
        assert rows and "…" not in out, args
        assert all(line.endswith("│") for line in rows), args  # a wrapped cell would end a line early
        blocks: list[set[int]] = [set()]  # each table's rows have one width
        for line in out.splitlines():
            if line.startswith("│"):
                blocks[-1].add(len(line))
            elif blocks[-1]:
                blocks.append(set())
        assert all(len(widths) <= 1 for widths in blocks), args
        assert max(len(line) for line in out.splitlines()) > 80, args  # wider than rich's piped default


def test_a_plan_priced_partly_from_profiles_says_so_and_fully_profiled_does_not(tmp_path: Path) -> None:
    from tests.unit.test_demo import _profile

    _profile().save(tmp_path / "cpu.json")
    args = ("plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24", "--seq-len", "64", "--max-tp", "1")
    part = _run(*args, "--profile", str(tmp_path / "cpu.json"), "--profile-as", "fast")
    assert part.exit_code == 0, part.output
    assert "note: fast priced from --profile, slow from the analytic model" in part.output
    assert "--profile FILE --profile-as slow" in part.output
    both = _run(*args, "--profile", str(tmp_path / "cpu.json"), "--profile-as", "fast",
                "--profile", str(tmp_path / "cpu.json"), "--profile-as", "slow")
    assert both.exit_code == 0 and "note:" not in both.output


def test_torch_spellings_of_a_precision_are_taken(tmp_path: Path) -> None:
    for spelled, meant in (("bfloat16", "bf16"), ("float32", "fp32"), ("torch.float16", "fp16")):
        out = tmp_path / f"{spelled}.json"
        res = _run("plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24", "--seq-len", "64",
                   "--max-tp", "1", "--dtype", spelled, "--out", str(out))
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["dtype"] == meant
