"""The runtime on an accelerator (NCCL). Skipped cleanly where no CUDA device exists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tokens(path: Path) -> str:
    from ethpipe.runtime.data import prepare_tokens

    rng = np.random.default_rng(0)
    prepare_tokens([" ".join(rng.choice(["gpu", "pipeline", "data", "balance"], size=3000))], path)
    return str(path)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_gpu_run_matches_cpu_reference(tmp_path: Path, num_stages: int) -> None:
    """fp32 on the accelerator (TF32 off) reproduces the single-process CPU reference."""
    if torch.cuda.device_count() < num_stages:
        pytest.skip(f"needs {num_stages} CUDA devices")
    from safetensors.torch import load_file

    from ethpipe.model_spec import ModelSpec
    from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
    from ethpipe.runtime.launch import run_local
    from ethpipe.runtime.train import TrainConfig

    from tests.dist.reference import reference_train

    torch.backends.cuda.matmul.allow_tf32 = False
    spec = ModelSpec(name="g", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                     vocab_size=256, max_seq_len=64)
    per = 4 // num_stages
    stages = tuple(Stage((r,), "gpu", (r * per, (r + 1) * per)) for r in range(num_stages))
    pipes = (Pipeline(stages, (3, 2)),)
    plan = Plan("custom", "g", 5, 32, pipes, compute_blocks(pipes), model_spec=spec)
    data = _tokens(tmp_path / "t.bin")
    config = TrainConfig(data=data, steps=3, lr=1e-3, clip_grad=0.5, progress=False, timeout_s=120,
                         save_final=str(tmp_path / "w.safetensors"))
    records = run_local(plan, config, start_method="spawn")
    ref = reference_train(spec, data, 5, 32, 3, 1e-3, weight_decay=0.1, clip_grad=0.5, seed=0)
    got = load_file(tmp_path / "w.safetensors")
    for key, want in ref.state.items():
        torch.testing.assert_close(got[key], want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose([r["loss"] for r in records], ref.losses, rtol=1e-4)
