"""What a GPU job gets from the launcher: spawned workers and the NCCL/allocator settings it needs."""

from __future__ import annotations

import sys

from ethpipe.runtime.launch import GPU_ENVIRONMENT, default_start_method, set_gpu_environment


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
