"""The runtime on an accelerator (NCCL). Skipped cleanly where no CUDA device exists.

The same portable exactness scheme as on CPU (tests/dist/exactness.py): fp64 runs compared with
the fp64 single-process CPU reference; fp16 compared with the fp32 reference at tolerances
derived from fp16's unit roundoff (tests/dist/test_precision.py). Tensor parallelism needs one
device per rank (NCCL refuses two ranks on one GPU), so those tests skip below two devices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tokens(path: Path) -> str:
    from ethpipe.tokens.texts import prepare_tokens

    rng = np.random.default_rng(0)
    prepare_tokens([" ".join(rng.choice(["gpu", "pipeline", "data", "balance"], size=3000))], path)
    return str(path)


def _spec():  # type: ignore[no-untyped-def]
    from ethpipe.model_spec import ModelSpec

    return ModelSpec(name="g", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                     vocab_size=256, max_seq_len=64)


def _plan(stages_ranks: list[tuple[int, ...]], sizes: tuple[int, ...]):  # type: ignore[no-untyped-def]
    from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks

    per = 4 // len(stages_ranks)
    stages = tuple(Stage(r, "gpu", (i * per, (i + 1) * per), len(r)) for i, r in enumerate(stages_ranks))
    pipes = (Pipeline(stages, sizes),)
    return Plan("custom", "g", sum(sizes), 32, pipes, compute_blocks(pipes), model_spec=_spec())


def _run(tmp_path: Path, plan, dtype: str):  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    from ethpipe.runtime.start.launch import run_local
    from ethpipe.runtime.train import TrainConfig

    data = _tokens(tmp_path / "t.bin")
    config = TrainConfig(data=data, steps=3, lr=1e-3, clip_grad=0.5, progress=False, timeout_s=120, dtype=dtype,
                         save_final=str(tmp_path / "w.safetensors"))
    records = run_local(plan, config, start_method="spawn")
    return data, records, load_file(tmp_path / "w.safetensors")


@pytest.mark.parametrize("stages_ranks", [[(0,)], [(0,), (1,)], [(0, 1)], [(0, 1), (2,)]],
                         ids=["one-stage", "two-stages", "tp2", "tp2-then-tp1"])
def test_gpu_fp64_run_matches_the_reference(tmp_path: Path, stages_ranks: list[tuple[int, ...]]) -> None:
    world = sum(len(r) for r in stages_ranks)
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    from tests.dist.exactness import assert_matches_reference
    from tests.dist.reference import reference_train

    plan = _plan(stages_ranks, (3, 2))
    data, records, got = _run(tmp_path, plan, "fp64")
    ref = reference_train(_spec(), data, 5, 32, 3, 1e-3, weight_decay=0.1, clip_grad=0.5, seed=0)
    assert_matches_reference("gpu", got, records, ref)


def test_gpu_fp16_follows_the_fp32_reference(tmp_path: Path) -> None:
    from ethpipe.runtime.model.decoder import build_full_model
    from tests.dist.reference import reference_train

    plan = _plan([(0,)], (3, 2))
    data, records, got = _run(tmp_path, plan, "fp16")
    ref = reference_train(_spec(), data, 5, 32, 3, 1e-3, weight_decay=0.1, clip_grad=0.5, seed=0,
                          dtype=torch.float32)
    u = 2.0**-11
    np.testing.assert_allclose([r["loss"] for r in records], ref.losses, rtol=u)
    np.testing.assert_allclose([r["grad_norm"] for r in records], ref.grad_norms, rtol=4 * u)
    init = build_full_model(_spec(), seed=0).state_dict()
    error = sum(float((got[k].float() - ref.state[k]).pow(2).sum()) for k in ref.state) ** 0.5
    update = sum(float((ref.state[k] - init[k]).pow(2).sum()) for k in ref.state) ** 0.5
    assert error <= 0.25 * update
    assert not any(r["skipped"] for r in records)


@pytest.mark.parametrize("attention", ["auto", "materialised"])
def test_gpu_attention_backend_keeps_what_the_plan_budgeted(attention: str) -> None:
    """What a causal fp16 SDPA forward keeps for backward: auto (fused kernels) no s x s matrix; materialised
    (the math path, reducing in fp16) one fp16 matrix per head, not the fp32 one an upcast would keep."""
    import torch.nn.functional as F

    from ethpipe.plan import Plan
    from ethpipe.runtime.model.kernel_modes import apply_attention, set_sdpa_backends

    plan = Plan.__new__(Plan)
    object.__setattr__(plan, "extra", {"attention": attention})
    try:
        assert apply_attention(plan, torch.device("cuda")) == attention
        q, k, v = (torch.randn(1, 8, 2048, 64, device="cuda", dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        scores = 8 * 2048 * 2048 * 2
        if attention == "materialised":
            assert scores <= kept < 1.5 * scores, kept
        else:
            assert kept < 0.25 * scores, kept
        out.sum().backward()
    finally:
        set_sdpa_backends(True)


def test_gpu_default_launch_spawns_and_checks_the_real_device(tmp_path: Path) -> None:
    """run_local without a start method spawns (CUDA cannot be forked); the placement check reads this GPU's
    name and memory: a plan made for its catalog type runs, one made for another type is refused in one line."""
    from ethpipe.errors import UserError
    from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
    from ethpipe.runtime.start.launch import default_start_method, run_local, uses_accelerator
    from ethpipe.runtime.start.placement import DeviceInfo, check_placement, identify_gpu, local_device_info
    from ethpipe.runtime.train import TrainConfig

    info = local_device_info(torch.device("cuda", 0))
    gpu_id = identify_gpu(info.name, info.total_memory_bytes)
    assert gpu_id is not None, f"this GPU ({info.name}) has no catalog id"
    config = TrainConfig(data=_tokens(tmp_path / "t.bin"), steps=1, progress=False, timeout_s=120)
    assert uses_accelerator(config) and default_start_method(True) == "spawn"

    def plan_for(device: str) -> Plan:
        pipes = (Pipeline((Stage((0,), device, (0, 4)),), (2, 2)),)
        return Plan("custom", "g", 4, 32, pipes, compute_blocks(pipes), model_spec=_spec())

    records = run_local(plan_for(gpu_id), config)
    assert len(records) == 1 and np.isfinite(records[0]["loss"])
    other = "l4" if gpu_id != "l4" else "h100_sxm"
    with pytest.raises(UserError, match=f"rank 0 on host .* runs on {info.name}.*{other}"):
        check_placement(plan_for(other), [info])
    check_placement(plan_for(gpu_id), [DeviceInfo(info.host, "cuda", info.name, info.total_memory_bytes)])


def test_gpu_two_stage_pipeline_with_32_mib_messages_and_a_several_gb_final_save(tmp_path: Path) -> None:
    """Two GPUs: a 1.5B-parameter model in two stages, 32 MiB activations (fp32, 2048 x 4096) and 4
    micro-batches: NCCL's unbuffered sends would hang the old executor order here. The final save (5.9 GB)
    moves one tensor at a time over the host."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from safetensors import safe_open

    from ethpipe.model_spec import ModelSpec
    from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
    from ethpipe.runtime.start.launch import run_local
    from ethpipe.runtime.train import TrainConfig

    spec = ModelSpec(name="big", num_layers=6, hidden_size=4096, num_heads=32, num_kv_heads=32,
                     ffn_hidden_size=11008, vocab_size=32000, max_seq_len=2048)
    pipes = (Pipeline((Stage((0,), "gpu", (0, 3)), Stage((1,), "gpu", (3, 6))), (1, 1, 1, 1)),)
    plan = Plan("custom", "big", 4, 2048, pipes, compute_blocks(pipes), model_spec=spec)
    data = tmp_path / "t.bin"
    from ethpipe.tokens.texts import prepare_tokens

    prepare_tokens(["pipeline " * 20000], data)
    out = tmp_path / "w.safetensors"
    config = TrainConfig(data=str(data), steps=2, lr=1e-4, progress=False, timeout_s=300, save_final=str(out))
    records = run_local(plan, config)
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    assert out.stat().st_size > 5e9
    with safe_open(str(out), framework="pt") as f:
        assert "layers.5.mlp.w2.weight" in f.keys() and "tok_emb.weight" in f.keys()


def test_the_device_memory_in_use_covers_the_allocators_and_more() -> None:
    """`device_used_bytes` (total - free) sees the CUDA context and the allocator's cache beside its tensors."""
    import torch

    from ethpipe.runtime.observe.metrics import device_used_bytes

    device = torch.device("cuda", 0)
    block = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device)
    used = device_used_bytes(device)
    assert used >= torch.cuda.memory_reserved(device) >= block.numel()
    del block


def test_gpu_gqa_runs_the_memory_efficient_kernel_with_expanded_kv() -> None:
    """64 query heads over 8 KV heads in fp16, SDPA restricted to the memory-efficient kernel (what a V100 or
    T4 gets): the runtime's attention (K/V expanded) runs there, keeps no s x s scores, and matches the GQA
    result of the default kernels; what it keeps is what the cost model budgets for Q, K, V, O and the LSE."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ethpipe.runtime.model.attention import causal_attention

    s, d = 2048, 64
    q = torch.randn(1, 64, s, d, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 8, s, d, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = causal_attention(q, k, v, expand=True)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    scores = 64 * s * s * 4  # the fp32 scores the math kernel would keep
    qkv_out = 4 * 64 * s * d * 2  # expanded K, V, the output and Q's width, fp16
    assert kept < qkv_out + 64 * s * 4 + 2 ** 20 < 0.1 * scores, kept
    out.float().sum().backward()
    ref = causal_attention(q.detach(), k.detach(), v.detach(), expand=False)  # default kernels, GQA inside SDPA
    torch.testing.assert_close(out.detach(), ref, rtol=2e-3, atol=2e-3)


def test_gpu_checkpoint_save_and_resume_take_no_more_device_memory_than_a_tensor(tmp_path: Path) -> None:
    """One rank, one stage of a 1 GiB (fp32) model on the GPU: DCP's save stages through the host one tensor at a
    time (the allocator's peak grows by at most one tensor, the largest: 128 MiB, plus 64 MiB over what the stage
    and its AdamW states hold); a resume into a fresh stage loads in place: it adds the AdamW states it fills
    (2 x the parameters) and no more than that slack."""
    import torch.distributed as dist

    from ethpipe.model_spec import ModelSpec
    from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
    from ethpipe.runtime.checkpoint.layout import DataCursor, find_resume
    from ethpipe.runtime.checkpoint.state import load_checkpoint, save_checkpoint
    from ethpipe.runtime.model.decoder import build_stage

    spec = ModelSpec(name="ckpt-mem", num_layers=4, hidden_size=2048, num_heads=16, num_kv_heads=16,
                     ffn_hidden_size=8192, vocab_size=16384, max_seq_len=64)
    pipes = (Pipeline((Stage((0,), "gpu", (0, 4)),), (1,)),)
    plan = Plan("custom", spec.name, 1, 16, pipes, compute_blocks(pipes), model_spec=spec)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        module = build_stage(spec, (0, 4), True, True, device=device)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in module.parameters():
            p.grad = None
        largest = max(p.numel() * p.element_size() for p in module.parameters())
        slack = largest + 64 * 2 ** 20
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        save_checkpoint(tmp_path / "ck", 1, module, opt, plan, spec, DataCursor(1, False, 0, 100), 2, device)
        assert torch.cuda.max_memory_allocated(device) - held <= slack
        point = find_resume(tmp_path / "ck", spec, 16, False, 0, 100)
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        del module, opt
        fresh = build_stage(spec, (0, 4), True, True, device=device, init=False)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        load_checkpoint(point, fresh, fresh_opt, device)
        assert torch.cuda.max_memory_allocated(device) - held <= 2 * params + slack
    finally:
        dist.destroy_process_group()
