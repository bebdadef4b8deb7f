"""The memory model's activation term is what ethpipe's runtime really keeps for backward.

Counted with ``torch.autograd.graph.saved_tensors_hooks`` (each storage once, parameters left
out) over one stage's forward in fp32, and compared exactly with ``memory.runtime_*``; TP splits
are measured in benchmarks/tp_cpu.py (the same formulas, 0.2% off at tp 2 and 4).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ethpipe.cost import memory
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model import build_stage

LLAMA = ModelSpec(name="l", num_layers=3, hidden_size=64, num_heads=8, num_kv_heads=4, ffn_hidden_size=96,
                  vocab_size=200, max_seq_len=64)
SPECS = {
    "llama-gqa": LLAMA,
    "llama-mha": dataclasses.replace(LLAMA, num_kv_heads=8),
    "gpt": dataclasses.replace(LLAMA, num_kv_heads=8, activation="gelu", norm="layernorm", position="learned",
                               attention_bias=True, mlp_bias=True),
}


def _saved_bytes(spec: ModelSpec, layers: tuple[int, int], last: bool, seq_len: int, batch: int) -> int:
    module = build_stage(spec, layers, first=False, last=last)
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.dtype.is_floating_point and storage.data_ptr() not in weights:
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    x = torch.randn(batch, seq_len, spec.hidden_size, requires_grad=True)
    targets = torch.randint(0, spec.vocab_size, (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
        (module.loss_sum(out, targets) if last else out.sum()).backward()
    return sum(seen.values())


@pytest.mark.parametrize("name", list(SPECS))
def test_runtime_inventory_is_exact_in_fp32(name: str) -> None:
    spec, s, b = SPECS[name], 16, 2
    rope = s * spec.head_dim_resolved * 4 if spec.position == "rope" else 0  # cos/sin tables, once per stage
    blocks = _saved_bytes(spec, (0, 2), last=False, seq_len=s, batch=b)
    assert blocks == 2 * memory.runtime_block_activation_bytes(spec, s, 4, 1) * b + rope
    with_head = _saved_bytes(spec, (1, 3), last=True, seq_len=s, batch=b)
    want = (2 * memory.runtime_block_activation_bytes(spec, s, 4, 1) + memory.runtime_head_activation_bytes(
        spec, s, 4, 1)) * b + rope
    assert with_head == pytest.approx(want, abs=8 * b)  # the summed loss: one scalar
