"""What a GPU job gets from the launcher: spawned workers and the NCCL/allocator settings it needs."""

from __future__ import annotations

import sys

from ethpipe.runtime.start.launch import GPU_ENVIRONMENT, default_start_method, set_gpu_environment


def test_gpu_settings_are_set_unless_the_user_set_them() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    applied = set_gpu_environment(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's choice stays
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in applied
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TORCH_FR_BUFFER_SIZE"] == GPU_ENVIRONMENT["TORCH_FR_BUFFER_SIZE"]
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert set(applied) == set(GPU_ENVIRONMENT) - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    legacy = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}  # the older name of the same setting
    assert "PYTORCH_ALLOC_CONF" not in set_gpu_environment(legacy) and "PYTORCH_ALLOC_CONF" not in legacy


def test_accelerator_ranks_are_spawned_never_forked() -> None:
    assert default_start_method(accelerator=True) == "spawn"
    assert default_start_method(accelerator=False) == ("fork" if sys.platform.startswith("linux") else "spawn")


def test_launch_takes_the_hosts_the_cluster_file_names(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from ethpipe.cli import commands  # noqa: F401
    from ethpipe.cli.app import app

    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n"
                       "  - {hostname: gpu-a, gpu: a100_80gb_sxm, num_nodes: 1, gpus_per_node: 2, nic_gbit_s: 100}\n"
                       "  - {hostname: gpu-b, gpu: a100_80gb_sxm, num_nodes: 1, gpus_per_node: 2, nic_gbit_s: 100}\n")
    runner = CliRunner()
    made = runner.invoke(app, ["plan", "--cluster", str(cluster), "--model", "gpt3-1.3b", "--global-batch", "64",
                               "--seq-len", "1024", "--out", str(tmp_path / "p.json")])
    assert made.exit_code == 0, made.output
    res = runner.invoke(app, ["launch", "--plan", str(tmp_path / "p.json"), "--", "--data", "t.bin"])
    assert res.exit_code == 0, res.output
    ons = [line for line in res.output.splitlines() if line.startswith("# on ")]
    assert [line.split()[2].rstrip(":") for line in ons] == ["gpu-a", "gpu-b"]
    assert "--master-addr gpu-a" in res.output
    lines = [line for line in res.output.splitlines() if not line.startswith("#")]
    assert all(f"--plan {tmp_path / 'p.json'}" in line and "--max-restarts 3" in line for line in lines)  # absolute
    assert all("--auto-resume" not in line for line in lines)  # nothing to resume from without a checkpoint dir
    monkeypatch.chdir(tmp_path)  # a relative --plan is printed absolute: nodes' shells start elsewhere
    resumable = runner.invoke(app, ["launch", "--plan", "p.json", "--", "--data", "t.bin", "--checkpoint-dir", "ckpt"])
    assert f"--plan {tmp_path / 'p.json'} " in resumable.output
    assert all(line.endswith("--checkpoint-dir ckpt --auto-resume")
               for line in resumable.output.splitlines() if not line.startswith("#")), resumable.output
    cluster.write_text(cluster.read_text().replace("hostname: gpu-b, ", ""))
    runner.invoke(app, ["plan", "--cluster", str(cluster), "--model", "gpt3-1.3b", "--global-batch", "64",
                        "--seq-len", "1024", "--out", str(tmp_path / "p.json")])
    bad = runner.invoke(app, ["launch", "--plan", str(tmp_path / "p.json")])
    assert bad.exit_code == 2 and "names no host for node 1" in bad.output
