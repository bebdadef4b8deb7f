"""The GPU check's CPU-side logic: GPU-name matching, measuring vs pricing, the report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from ethpipe.cost.hardware import load_calibration

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.parametrize("name,want", [
    ("NVIDIA H200", "h200_sxm"),
    ("NVIDIA H100 80GB HBM3", "h100_sxm"),
    ("NVIDIA A100-SXM4-40GB", "a100_40gb_sxm"),
    ("NVIDIA A100-SXM4-80GB", "a100_80gb_sxm"),
    ("Tesla V100-SXM2-16GB", "v100_16gb_sxm2"),
    ("Tesla V100-PCIE-16GB", "v100_16gb_pcie"),
    ("Tesla V100-SXM2-32GB", "v100_32gb_sxm2"),
    ("NVIDIA L4", "l4"),
    ("Some Unknown Accelerator", None),
])
def test_device_names_match_catalog_ids(name: str, want: str | None) -> None:
    assert gpu_check.match_gpu(name) == want


def test_cpu_dry_run_writes_every_mode_and_layer(tmp_path: Path) -> None:
    (tmp_path / "gpu_profiles").mkdir()
    (tmp_path / "gpu_profiles" / "earlier_run.json").write_text("{}")  # another run's: must not be fitted
    result = gpu_check.main(["--device", "cpu", "--gpu-id", "a100_80gb_sxm", "--widths", "64", "--seq-len", "32",
                             "--micro-batches", "1,2", "--repeats", "1", "--skip-tests", "--out-dir", str(tmp_path),
                             "--throughput-width", "64", "--throughput-layers", "1"])
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert {(r["dtype"], r["tf32"], r["attention"]) for r in rows} == set(gpu_check.MODES)
    assert {r["kind"] for r in rows} == {"embedding", "block", "head"} and {r["micro_batch"] for r in rows} == {1, 2}
    assert all(m > 0 and p > 0 and math.isfinite(p) for r in rows for m, p in zip(r["measured_ms"], r["predicted_ms"]))
    report = (tmp_path / "gpu.md").read_text()
    assert report.count("| 64 |") == len(rows) and "not run" in report and result["gpu_id"] == "a100_80gb_sxm"
    # The profiles are kept for `ethpipe calibrate`, and the family's constants fitted to them load as a catalog.
    assert len(list((tmp_path / "gpu_profiles").glob("*.json"))) == len(gpu_check.MODES)
    fitted = load_calibration(tmp_path / "gpu_calibration.yaml")
    assert fitted.constants("ampere")[0].source.startswith("benchmarks/gpu_check.py on ")
    assert result["fit"]["num_passes"] == 2 * 2 * 2 * len(gpu_check.MODES)  # (block, head) x mbs x (fwd, bwd)
    assert "## Constants fitted to these profiles (ampere" in report
    (throughput,) = result["throughput"]  # the dry run's one mode: no --compile off CUDA
    assert not throughput["compile"] and throughput["ethpipe_tokens_per_s"] > 0 and throughput["plain_tokens_per_s"] > 0
    assert "## One-stage throughput" in report
