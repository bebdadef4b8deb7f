"""Count what the runtime runs, and check the cost model prices it (``cost/ops.py``).

The runtime's own layers (``runtime/model/decoder.py``) run on CPU under counting dispatch modes:
``FlopCounterMode`` for matmul FLOPs, and a ``TorchDispatchMode`` that records each aten op's input and output
tensors. Checked against the price of the same layer:
- every linear GEMM's FLOPs, forward and backward (dgrad + wgrad), fp32 and 16-bit autocast, MHA and GQA, tp 1:
  equal to ``ops.block_kernels``' GEMMs;
- the per-micro-batch gradient accumulation of a backward into existing ``.grad`` (16-bit: each weight gradient
  added into the fp32 ``.grad`` by the runtime's fused cast-and-add, ``runtime/model/weight_cast.py``; fp32: the
  add; the embedding's dense gradient): the bytes of exactly those aten ops, within 10% of
  ``ops.grad_accumulation_kernels``; a price without them, and a runtime that casts before adding, are caught;
- the B/W split of a zero-bubble stage: B's and W's GEMM FLOPs apart, and W alone accumulating;
- per step: one 16-bit copy of each copied weight (``CostModel.cast_params``' bytes, the memory model's copy term) and the
  AdamW step's bytes (``OPTIMIZER_BYTES_PER_PARAM``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from _counting import OpRecorder
from ethpipe.cost import ops
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import build_stage

SEQ, BATCH = 16, 2
MHA = ModelSpec(name="count-mha", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=160,
                vocab_size=96, max_seq_len=32)
GQA = dataclasses.replace(MHA, name="count-gqa", num_kv_heads=2)
GPT = dataclasses.replace(MHA, name="count-gpt", activation="gelu", norm="layernorm", position="learned",
                          attention_bias=True, mlp_bias=True)
LINEAR_GEMMS = ("qkv", "proj", "fc1", "fc2")


def _stage(spec: ModelSpec, first: bool) -> torch.nn.Module:
    return build_stage(spec, (0, 1), first=first, last=False)


@contextlib.contextmanager
def _step(stage: torch.nn.Module, autocast: bool, cast: bool = True) -> Iterator[None]:
    """A step as the executor runs it: in 16-bit one autocast region and one weight-cast step (``cast`` False:
    plain autocast over the fp32 weights, the runtime before ``weight_cast.py``)."""
    low = torch.bfloat16 if autocast and cast else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), stage.weight_cast.step(low):
        yield


def _run(stage: torch.nn.Module, spec: ModelSpec, first: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=gen) if first else
         torch.randn(BATCH, SEQ, spec.hidden_size, generator=gen, requires_grad=True))
    return stage(x)


def accumulation_bytes(stage: torch.nn.Module, spec: ModelSpec, first: bool, autocast: bool, cast: bool = True) -> float:
    """Bytes the second micro-batch's backward moves to put its gradients into the existing ``.grad``: each op
    that adds into a ``.grad`` in place (reads both, writes one: 4 + 2 + 4 bytes for the runtime's fused
    cast-and-add of a 16-bit gradient), and what makes the gradient it adds apart from the priced matmuls:
    plain autocast's fp32 cast of a 16-bit weight gradient (reads it, writes fp32), the embedding's dense
    vocab x h gradient (written; its reads of the incoming gradient are priced as ``embed.grad``)."""
    with _step(stage, autocast, cast):
        _run(stage, spec, first).float().sum().backward()  # micro-batch 1: .grad exists afterwards
        out = _run(stage, spec, first).float().sum()
        grads = {p.grad.data_ptr() for p in stage.parameters()}
        rec = OpRecorder()
        with rec:
            out.backward()
    total = 0.0
    fed: set[int] = set()
    for name, ins, outs, _ in rec.ops:
        if name.endswith("add_.Tensor") and ins[0][0] in grads:
            total += sum(b for _, b in ins) + sum(b for _, b in outs)
            fed |= {ptr for ptr, _ in ins[1:]}
    for name, ins, outs, _ in rec.ops:
        if not outs or outs[0][0] not in fed or outs[0][0] in {ptr for ptr, _ in ins}:
            continue  # not feeding an accumulation, or a view (moves nothing)
        if "_to_copy" in name:
            total += sum(b for _, b in ins) + sum(b for _, b in outs)
        elif "embedding_dense_backward" in name:
            total += sum(b for _, b in outs)
        else:
            assert name.startswith("aten.mm") or name.startswith("aten.addmm") or "sum" in name, name
    return total


def priced_bytes(kind: str, spec: ModelSpec, autocast: bool, accumulation: str = "cast_add") -> float:
    return sum(k.num_bytes for k in ops.grad_accumulation_kernels(kind, spec, 1, 2 if autocast else 4, accumulation))


@pytest.mark.parametrize("spec", [MHA, GQA, GPT], ids=lambda s: s.name)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_linear_gemm_flops_are_the_priced_ones(spec: ModelSpec, autocast: bool) -> None:
    fwd, bwd = _counted_flops(_stage(spec, first=False), spec, autocast)  # attention as bmm's (SDPA's math path)
    e = 2 if autocast else 4
    kernels = {False: ops.block_kernels(spec, SEQ, BATCH, 1, e, "flash", False),
               True: ops.block_kernels(spec, SEQ, BATCH, 1, e, "flash", True)}
    linear = {bw: sum(k.flops for k in ks if k.name.split(".")[0] in LINEAR_GEMMS) for bw, ks in kernels.items()}
    attention = {bw: sum(k.flops for k in ks if k.name == "flash_attn") for bw, ks in kernels.items()}
    # The math path does the masked half too, and its backward does not recompute the scores:
    counted_attention_fwd = attention[False] / ops.FLASH_CAUSAL_FRACTION
    assert fwd == pytest.approx(linear[False] + counted_attention_fwd, rel=1e-9)
    counted_attention_bwd = attention[True] / ops.FLASH_CAUSAL_FRACTION / ops.FLASH_BWD_FLOPS_FACTOR * 2
    assert bwd == pytest.approx(linear[True] + counted_attention_bwd, rel=1e-9)  # the counter restarts per region


@pytest.mark.parametrize("spec", [MHA, GQA, GPT], ids=lambda s: s.name)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_gradient_accumulation_is_priced_as_counted(spec: ModelSpec, autocast: bool) -> None:
    stage = _stage(spec, first=False)
    counted = accumulation_bytes(stage, spec, False, autocast)
    assert counted == pytest.approx(priced_bytes("block", spec, autocast), rel=0.10)
    assert counted != pytest.approx(priced_bytes("block", spec, autocast, "fused"), rel=0.10)


@pytest.mark.parametrize("spec", [MHA, GPT], ids=lambda s: s.name)
def test_an_unpriced_cast_in_the_runtime_is_caught(spec: ModelSpec) -> None:
    """The runtime as it was (plain autocast: each 16-bit weight gradient cast to fp32, then added) moves what
    the ``autocast`` price says, and the runtime's own price (``cast_add``) is off by far more than 10% for it:
    a cast the runtime gains and the price lacks fails the test above. The fused add moves 10 bytes per
    parameter where plain autocast moved 18."""
    stage = _stage(spec, first=False)
    plain = accumulation_bytes(stage, spec, False, autocast=True, cast=False)
    assert plain == pytest.approx(priced_bytes("block", spec, True, "autocast"), rel=0.10)
    assert plain != pytest.approx(priced_bytes("block", spec, True), rel=0.10)
    fused = accumulation_bytes(stage, spec, False, autocast=True)
    params = sum(p.numel() for p in stage.parameters())
    assert 9.5 < fused / params < 10.5 and 17 < plain / params < 18.5, (fused / params, plain / params)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_embeddings_dense_gradient_is_priced_as_counted(autocast: bool) -> None:
    """A first stage: its block's accumulation and the embedding's dense vocab x h gradient."""
    stage = _stage(MHA, first=True)
    counted = accumulation_bytes(stage, MHA, True, autocast)
    priced = priced_bytes("block", MHA, autocast) + priced_bytes("embedding", MHA, autocast)
    assert counted == pytest.approx(priced, rel=0.10)


def _counted_flops(stage: torch.nn.Module, spec: ModelSpec, autocast: bool) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of one micro-batch through ``stage`` (SDPA on its math path: bmm's)."""
    counter = FlopCounterMode(display=False)
    with sdpa_kernel([SDPBackend.MATH]):
        with _step(stage, autocast):
            with counter:
                out = _run(stage, spec, False)
            fwd = counter.get_total_flops()
            with counter:
                out.float().sum().backward()
            return fwd, counter.get_total_flops()


def _priced_gemm_flops(kernels: list[ops.Kernel], names: tuple[str, ...]) -> float:
    return sum(k.flops for k in kernels if k.kind == "gemm" and k.name.split(".")[0] in names)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_heads_gemm_flops_and_accumulation_are_priced_as_counted(autocast: bool) -> None:
    """A last stage's LM head (its final norm, the vocab GEMM, the fp32 cross-entropy outside the counted
    matmuls): the head GEMM's FLOPs as priced, and its weight's accumulation bytes."""
    stage = build_stage(MHA, (0, 1), first=False, last=True)
    block = _priced_gemm_flops(ops.block_kernels(MHA, SEQ, BATCH, 1, 2 if autocast else 4, "flash", False),
                               LINEAR_GEMMS)
    attention = 4.0 * BATCH * MHA.num_heads * SEQ * SEQ * MHA.head_dim_resolved  # math path: the masked half too
    fwd, bwd = _counted_flops(stage, MHA, autocast)
    head = {bw: _priced_gemm_flops(ops.head_kernels(MHA, SEQ, BATCH, 1, 2 if autocast else 4, bw), ("lm_head",))
            for bw in (False, True)}
    assert fwd == pytest.approx(block + attention + head[False], rel=1e-9)
    assert bwd == pytest.approx(2 * (block + attention) + head[True], rel=1e-9)
    counted = accumulation_bytes(stage, MHA, False, autocast)
    priced = priced_bytes("block", MHA, autocast) + priced_bytes("head", MHA, autocast)
    assert counted == pytest.approx(priced, rel=0.10)


def test_a_recomputing_stage_runs_what_the_price_reruns() -> None:
    """Full recomputation under torch's non-reentrant checkpoint stops once every tensor the backward needs is
    back: the backward's matmuls are the backward's plus the forward's without the last GEMM (fc2), as
    ``ops.recompute_kernels`` prices it (``CostModel.recompute_s``)."""
    plain = build_stage(GQA, (0, 1), first=False, last=False)
    again = build_stage(GQA, (0, 1), first=False, last=False, recompute=True)
    fwd, bwd = _counted_flops(plain, GQA, False)
    fwd_r, bwd_r = _counted_flops(again, GQA, False)
    rerun = _priced_gemm_flops(ops.recompute_kernels(GQA, SEQ, BATCH, 1, 4, "flash"), LINEAR_GEMMS)
    attention = 4.0 * BATCH * GQA.num_heads * SEQ * SEQ * GQA.head_dim_resolved  # math path: the masked half too
    assert fwd_r == fwd and bwd_r == pytest.approx(bwd + rerun + attention, rel=1e-9)
    assert rerun < _priced_gemm_flops(ops.block_kernels(GQA, SEQ, BATCH, 1, 4, "flash", False), LINEAR_GEMMS)


@pytest.mark.parametrize("spec", [MHA, GQA], ids=lambda s: s.name)
def test_a_tp2_ranks_gemm_flops_are_half_the_priced_layers(spec: ModelSpec) -> None:
    """One rank of a tp-2 stage (torch's fake process group: its all-reduces complete at once) does the GEMMs
    ``ops.block_kernels`` prices at tp 2: each linear's share and half the heads."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ethpipe.runtime.model.tensor_parallel import TPGroup

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        stage = build_stage(spec, (0, 1), first=False, last=False, tp=TPGroup(dist.group.WORLD, 0, 2))
        fwd, bwd = _counted_flops(stage, spec, False)
    finally:
        dist.destroy_process_group()
    kernels = {bw: ops.block_kernels(spec, SEQ, BATCH, 2, 4, "flash", bw) for bw in (False, True)}
    linear = {bw: _priced_gemm_flops(ks, LINEAR_GEMMS) for bw, ks in kernels.items()}
    attention = 4.0 * BATCH * spec.num_heads / 2 * SEQ * SEQ * spec.head_dim_resolved
    assert fwd == pytest.approx(linear[False] + attention, rel=1e-9)
    assert bwd == pytest.approx(linear[True] + 2 * attention, rel=1e-9)


def test_a_steps_weight_copies_are_made_once_and_priced() -> None:
    """A 16-bit step of three micro-batches through a first-and-last stage makes ONE 16-bit copy of each block
    and head weight (not of the embedding, looked up in fp32): 6 bytes per copied parameter, as
    ``optimizer_s`` prices (``cast_params``), and the copies' bytes are the memory model's weight-copy term."""
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost import memory
    from ethpipe.cost.model import CostModel

    spec = dataclasses.replace(MHA, num_layers=2)
    stage = build_stage(spec, (0, 2), first=True, last=True)
    params = {p.data_ptr() for p in stage.parameters()}
    rec = OpRecorder()
    with _step(stage, autocast=True):
        with rec:
            for _ in range(3):
                _run(stage, spec, first=True).float().sum().backward()
        copies = stage.weight_cast.copies()
    casts = [(ins, outs) for name, ins, outs, _ in rec.ops if "_to_copy" in name and ins and ins[0][0] in params]
    assert len(casts) == len(copies) == len({ins[0][0] for ins, _ in casts})  # once per weight per step
    copied = sum(c.numel() for c in copies)
    cost = CostModel(cluster_from_dict({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 1,
                                                 "nic_gbit_s": 100}]}),
                     spec, SEQ, dtype_bytes=2, dtype="bf16")
    priced = cost.cast_params(2, last=True)
    assert copied == pytest.approx(priced, rel=0.02)  # the norms' scales are priced with their layers, not copied
    assert sum(b for ins, outs in casts for _, b in ins + outs) == pytest.approx(ops.WEIGHT_CAST_BYTES * priced, rel=0.02)
    kept = memory.autocast_weight_bytes(2 * spec.params_per_layer() + spec.vocab_size * spec.hidden_size, 2, 1)
    assert sum(c.numel() * c.element_size() for c in copies) == pytest.approx(kept, rel=0.02)


def test_the_optimizer_step_moves_the_priced_bytes() -> None:
    """The AdamW step as a GPU runs it (torch's fused kernel, here its CPU twin) over a block's fp32 weights,
    gradients and moments: the bytes it reads and writes are ``OPTIMIZER_BYTES_PER_PARAM`` per parameter."""
    from ethpipe.cost.model_memory import OPTIMIZER_BYTES_PER_PARAM

    params = list(_stage(GQA, first=False).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt.step()  # the moments exist from here on
    rec = OpRecorder()
    with rec:
        opt.step()
    moved = 0
    for name, ins, _, tensors in rec.ops:
        if "fused_adamw" in name:
            written = {t.data_ptr() for group in (0, 2, 3) for t in _lists(tensors, group)}  # w, m, v in place
            moved += sum(b for _, b in ins) + sum(b for ptr, b in ins if ptr in written)
    n = sum(p.numel() for p in params)
    assert moved / n == pytest.approx(OPTIMIZER_BYTES_PER_PARAM, rel=0.10)


def _lists(tensors: list[torch.Tensor], group: int) -> list[torch.Tensor]:
    """The ``group``-th tensor list of a fused optimizer op's flattened inputs (params, grads, m, v, ...)."""
    size = len(tensors) // 5 if len(tensors) % 5 == 0 else None  # params, grads, m, v, steps (no amsgrad list)
    assert size, "unexpected fused AdamW signature"
    return tensors[group * size:(group + 1) * size]


@pytest.mark.parametrize("spec", [MHA, GQA], ids=lambda s: s.name)
def test_the_split_backward_runs_the_priced_b_and_w(spec: ModelSpec) -> None:
    """A zero-bubble stage's backward as B (input gradient) and W (weight gradients), in a 16-bit step: B runs
    every backward GEMM but the weight-gradient ones, W exactly those (``.wgrad`` in ``ops.block_kernels``, the
    share ``split_pricing`` moves to W), and W alone puts the gradients into ``.grad``, with the priced bytes."""
    from ethpipe.runtime.pipeline.split_backward import backward_input, backward_weight

    stage = _stage(spec, first=False)
    params = list(stage.parameters())
    counter = FlopCounterMode(display=False)
    with sdpa_kernel([SDPBackend.MATH]), _step(stage, autocast=True):
        _run(stage, spec, False).float().sum().backward()  # micro-batch 1: .grad exists afterwards
        x = torch.randn(BATCH, SEQ, spec.hidden_size, requires_grad=True)
        out = stage(x)
        grads = {p.grad.data_ptr() for p in params}
        before = [p.grad.clone() for p in params]
        with counter:
            _, work = backward_input(out, torch.ones_like(out), x, params)
        b_flops = counter.get_total_flops()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, before)), "B touched a weight gradient"
        rec = OpRecorder()
        with counter, rec:
            backward_weight(work)
        w_flops = counter.get_total_flops()
    kernels = ops.block_kernels(spec, SEQ, BATCH, 1, 2, "flash", True)
    wgrad = sum(k.flops for k in kernels if k.name.endswith(".wgrad"))
    linear = _priced_gemm_flops(kernels, LINEAR_GEMMS)
    attention = sum(k.flops for k in kernels if k.name == "flash_attn") / ops.FLASH_CAUSAL_FRACTION \
        / ops.FLASH_BWD_FLOPS_FACTOR * 2  # the math path: the masked half too, no recomputed scores
    assert w_flops == pytest.approx(wgrad, rel=1e-9)
    assert b_flops == pytest.approx(linear - wgrad + attention, rel=1e-9)
    added = sum(sum(b for _, b in ins) + sum(b for _, b in outs) for name, ins, outs, _ in rec.ops
                if name.endswith("add_.Tensor") and ins[0][0] in grads)
    assert added == pytest.approx(priced_bytes("block", spec, True), rel=0.10)
