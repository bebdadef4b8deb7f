"""The memory model's activation term is what ethpipe's runtime really keeps for backward.

Counted with ``torch.autograd.graph.saved_tensors_hooks`` (each storage once, parameters left
out) over one stage's forward, in fp32 and under bf16 autocast, for several widths, and compared
exactly with ``memory.runtime_*`` (+ ``autocast_weight_bytes``: the 16-bit weight copies autocast
keeps); TP splits are measured in benchmarks/tp_cpu.py with the same formulas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch

from ethpipe.cost import memory
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import build_stage


def _spec(family: str, hidden: int, head_dim: int, ffn: int) -> ModelSpec:
    spec = ModelSpec(name=family, num_layers=3, hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     ffn_hidden_size=ffn, vocab_size=200, max_seq_len=64)
    if family in ("gpt", "opt"):
        spec = dataclasses.replace(spec, num_kv_heads=4, activation="gelu" if family == "gpt" else "relu",
                                   norm="layernorm", position="learned", attention_bias=True, mlp_bias=True,
                                   position_offset=2 if family == "opt" else 0)
    return spec


def _saved_bytes(spec: ModelSpec, last: bool, autocast: bool, seq_len: int, batch: int,
                 recompute: bool = False, fp32_residual: bool = False) -> int:
    """Non-parameter storages autograd keeps over one forward of layers 1-2 (+ the head)."""
    module = build_stage(spec, (1, 3), first=False, last=last, recompute=recompute, fp32_residual=fp32_residual)
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.dtype.is_floating_point and storage.data_ptr() not in weights:
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    x = torch.randn(batch, seq_len, spec.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), region:
        out = module(x)
        if last:
            logits = out.float()
            with torch.autocast("cpu", enabled=False):
                module.loss_sum(logits, torch.randint(0, spec.vocab_size, (batch, seq_len)))
    return sum(seen.values())


@pytest.mark.parametrize("family,autocast", list(itertools.product(("llama", "gpt", "opt"), (False, True))))
def test_runtime_inventory_is_exact(family: str, autocast: bool) -> None:
    s, b, d = 16, 2, 2 if autocast else 4
    for hidden, head_dim, ffn in ((64, 16, 96), (96, 32, 160)):
        spec = _spec(family, hidden, head_dim, ffn)
        rope = s * spec.head_dim_resolved * d if spec.position == "rope" else 0  # cos/sin tables, once per stage
        copies = 2 * memory.autocast_weight_bytes(spec.params_per_layer() - _norm_and_bias_params(spec), d, 1)
        blocks = 2 * memory.runtime_block_activation_bytes(spec, s, d, 1) * b + rope + copies
        assert _saved_bytes(spec, False, autocast, s, b) == blocks, (hidden, head_dim, ffn)
        head = memory.runtime_head_activation_bytes(spec, s, d, 1) * b
        head += memory.autocast_weight_bytes(spec.vocab_size * spec.hidden_size, d, 1)
        assert _saved_bytes(spec, True, autocast, s, b) == pytest.approx(blocks + head, abs=8 * b)  # + the scalar loss


def _norm_and_bias_params(spec: ModelSpec) -> int:
    """Per layer, the parameters autocast does not cast (norms, biases: 1-D)."""
    module = build_stage(spec, (0, 1), first=False, last=False)
    return sum(p.numel() for p in module.parameters() if p.dim() < 2)


@pytest.mark.parametrize("autocast", [False, True])
def test_recompute_keeps_each_blocks_input(autocast: bool) -> None:
    """Activation recomputation keeps only each block's input: the residual stream, in the compute dtype (16-bit
    under autocast: what the memory model's recompute term counts per layer and sample)."""
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost.model import CostModel

    s, b = 16, 2
    spec = _spec("llama", 64, 16, 96)
    cluster = cluster_from_dict({"nodes": [{"gpu": {"id": "x", "memory_gib": 1, "peak_tflops": 1}, "num_nodes": 1,
                                            "gpus_per_node": 1, "nic_gbit_s": 1}]})
    d = 2 if autocast else 4
    cost = CostModel(cluster, spec, s, dtype_bytes=d, dtype="bf16" if autocast else "fp32")
    _, with_rc = cost.memory_terms(1, b, 1, True, first=False, last=False)
    _, without = cost.memory_terms(1, b, 0, True, first=False, last=False)  # states and weight copies only
    assert _saved_bytes(spec, False, autocast, s, b, recompute=True) == 2 * (with_rc - without)
    assert with_rc - without == memory.block_input_bytes(spec, s, d) * b


def test_fp32_residual_keeps_the_stream_in_fp32() -> None:
    """``--fp32-residual``: the same saved tensors without recompute (the norms widen their input to fp32 either
    way), and a recomputing block keeps its input in fp32: twice the 16-bit stream's bytes."""
    s, b = 16, 2
    for family in ("llama", "gpt"):
        spec = _spec(family, 64, 16, 96)
        assert _saved_bytes(spec, False, True, s, b, fp32_residual=True) == _saved_bytes(spec, False, True, s, b)
        wide = _saved_bytes(spec, False, True, s, b, recompute=True, fp32_residual=True)
        assert wide == 2 * _saved_bytes(spec, False, True, s, b, recompute=True) == 2 * memory.block_input_bytes(spec, s, 4) * b
