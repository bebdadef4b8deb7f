"""Grouped-query attention keeps a fused SDPA kernel on every device and dtype, and is priced as it runs.

torch 2.13's SDPA takes ``enable_gqa`` in its flash kernel only (CUDA sm80+, 16-bit); elsewhere on a GPU the
runtime expands K and V to the query heads so the memory-efficient kernel runs (``runtime/model/attention.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ethpipe.cost import memory, ops
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model import attention as attn
from ethpipe.runtime.model import decoder

CUDA = torch.device("cuda", 0)
GQA = ModelSpec(name="gqa", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, ffn_hidden_size=128,
                vocab_size=64, max_seq_len=32)


@pytest.mark.parametrize("capability", [(6, 0), (7, 0), (7, 5), (8, 0), (8, 9), (9, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_is_expanded_exactly_where_flash_does_not_run(capability: tuple[int, int], dtype: torch.dtype) -> None:
    flash = dtype != torch.float32 and capability >= (8, 0)
    assert attn.expand_kv(CUDA, dtype, 8, 2, capability) is (not flash)
    assert attn.expand_kv(CUDA, dtype, 8, 8, capability) is False  # MHA: SDPA takes it as it is
    arch = {(6, 0): "pascal", (7, 0): "volta", (7, 5): "turing", (8, 0): "ampere", (8, 9): "ada",
            (9, 0): "hopper"}[capability]
    priced = ops.attention_impl(arch, {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype])
    assert (priced == "flash") is flash  # the runtime's choice and the cost model's agree


def test_cpu_keeps_gqa_inside_sdpa() -> None:
    assert not attn.expand_kv(torch.device("cpu"), torch.float32, 8, 2)


def test_expanded_kv_gives_the_same_attention_in_fp64() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 16, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(attn.causal_attention(q, k, v, True), attn.causal_attention(q, k, v, False),
                               rtol=1e-12, atol=1e-12)


def test_no_attention_call_on_a_pre_sm80_gpu_or_in_fp32_passes_unexpanded_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's attention, as if on a V100 (fp16) or any GPU in fp32: SDPA sees K and V at the query heads
    and no enable_gqa; on an sm80+ GPU in 16-bit it sees them at their own heads (flash)."""
    seen: list[tuple[int, int, bool]] = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, is_causal, enable_gqa):  # noqa: ANN001, ANN202
        seen.append((q.shape[1], k.shape[1], enable_gqa))
        return real_sdpa(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", record)
    block = decoder.Attention(GQA)
    x = torch.randn(1, 8, GQA.hidden_size)
    for capability, dtype_of_gpu, expanded in (((7, 0), torch.float16, True), ((9, 0), torch.float32, True),
                                               ((9, 0), torch.bfloat16, False)):
        monkeypatch.setattr(decoder, "expand_kv",
                            lambda device, dtype, h, kv, c=capability, d=dtype_of_gpu: attn.expand_kv(CUDA, d, h, kv, c))
        seen.clear()
        block(x, None)
        assert seen == [(8, 8, False)] if expanded else [(8, 2, True)], (capability, dtype_of_gpu, seen)


def test_the_price_has_the_expansion_where_it_runs() -> None:
    args = dict(model=GQA, seq_len=32, micro_batch=2, tp=1, elem_bytes=2)
    for backward in (False, True):
        eff = {k.name: k for k in ops.block_kernels(**args, attention="efficient", backward=backward)}
        flash = {k.name: k for k in ops.block_kernels(**args, attention="flash", backward=backward)}
        tokens, q, kv = 64, GQA.q_dim, GQA.kv_dim
        assert "kv_expand" in eff and "kv_expand" not in flash
        assert eff["efficient_attn"].num_bytes == tokens * 4 * q * 2 * (2 if backward else 1)  # K, V at q width
        assert flash["flash_attn"].num_bytes == tokens * (2 * q + 2 * kv) * 2 * (2 if backward else 1)
    mha = dataclasses.replace(GQA, num_kv_heads=GQA.num_heads)
    assert "kv_expand" not in {k.name for k in ops.block_kernels(**{**args, "model": mha}, attention="efficient",
                                                                  backward=False)}
    wider = memory.runtime_block_activation_bytes(GQA, 32, 2, 1, gqa_expanded=True)
    assert wider - memory.runtime_block_activation_bytes(GQA, 32, 2, 1) == 32 * 2 * 2 * (GQA.q_dim - GQA.kv_dim)


def test_a_v100_stage_budgets_the_expanded_kv_an_a100_does_not() -> None:
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost.model import CostModel

    cluster = cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 100}
                                           for g in ("v100_32gb_sxm2", "a100_80gb_sxm")]})
    model = CostModel(cluster, GQA, 32, dtype_bytes=2, dtype="fp16")
    per_sample = {g: model._activation_bytes(g, "block", 1, 1) for g in ("v100_32gb_sxm2", "a100_80gb_sxm")}
    assert per_sample["v100_32gb_sxm2"] - per_sample["a100_80gb_sxm"] == 32 * 2 * 2 * (GQA.q_dim - GQA.kv_dim)
