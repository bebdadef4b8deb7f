"""`ethpipe calibrate` refuses a profile measured on another device than its --gpu (a CPU, another model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ethpipe.cli.calibrate_cmds import check_profile_device
from ethpipe.errors import UserError


def test_a_profile_of_another_gpu_model_is_refused_and_an_unknown_name_passes() -> None:
    check_profile_device(Path("p.json"), "cuda", "cuda: NVIDIA H100 80GB HBM3", "h100_sxm")
    check_profile_device(Path("p.json"), "cuda", "cuda: GH-96 (Sailor)", "gh200_96gb")  # names no catalog GPU
    with pytest.raises(UserError, match="a a100_40gb_sxm, not a h100_sxm.*--gpu a100_40gb_sxm"):
        check_profile_device(Path("p.json"), "cuda", "cuda: NVIDIA A100-SXM4-40GB", "h100_sxm")
    with pytest.raises(UserError, match="not on a l4"):
        check_profile_device(Path("p.json"), "cpu", "cpu: AMD EPYC", "l4")


def test_calibrate_refuses_a_cpu_profile_for_a_gpu_unless_told(tmp_path: Path) -> None:
    def ethpipe(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ethpipe", *args], capture_output=True, text=True, timeout=120)

    profile = tmp_path / "cpu.json"
    assert ethpipe("profile", "--model", "tiny", "--seq-len", "32", "--out", str(profile)).returncode == 0
    refused = ethpipe("calibrate", str(profile), "--gpu", "h100_sxm", "--out", str(tmp_path / "c.yaml"))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "--allow-other-device" in refused.stderr and not (tmp_path / "c.yaml").exists()
    allowed = ethpipe("calibrate", str(profile), "--gpu", "h100_sxm", "--out", str(tmp_path / "c.yaml"),
                      "--allow-other-device")
    assert allowed.returncode == 0, allowed.stderr
    assert (tmp_path / "c.yaml").exists()
