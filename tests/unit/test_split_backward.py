"""The backward split (runtime/pipeline/split_backward.py): B + W equal one whole backward, kernel for kernel.

A real decoder stage (``runtime.model.Decoder``) in float64: input gradients and, after every W, the
weight gradients equal ``torch.autograd.backward``'s bit for bit, with several micro-batches' W deferred
behind later B's, under recompute (correct, but not used: see the last test), under bf16 autocast (one cached 16-bit weight copy shared by every
micro-batch), for a last stage (the loss as root; tied: its head is its copy of the embedding). B computes no
weight gradient; B + W run exactly the whole backward's matmuls.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import Decoder, init_parameter
from ethpipe.runtime.pipeline.split_backward import backward_input, backward_weight

SPEC = ModelSpec(name="split", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                 vocab_size=64, max_seq_len=16)
GPT = dataclasses.replace(SPEC, name="split-gpt", activation="gelu", norm="layernorm", position="learned",
                          attention_bias=True, mlp_bias=True, num_kv_heads=4)
TIED = dataclasses.replace(GPT, name="split-tied", tie_embeddings=True)  # a last stage's head is the embedding
SEQ, MB, NUM_MB = 8, 2, 3


class _Matmuls(TorchDispatchMode):
    """Counts the matmul kernels run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _stage(spec: ModelSpec, last: bool, recompute: bool = False, dtype: torch.dtype = torch.float64) -> Decoder:
    module = Decoder(spec, (1, 3), first=False, last=last, recompute=recompute)
    with torch.no_grad():
        for name, p in module.named_parameters():
            init_parameter(spec, name, p, seed=3)
    return module.to(dtype)


def _run(module: Decoder, last: bool, split: bool, autocast: bool = False,
         cast: bool = False) -> tuple[list[torch.Tensor], dict]:
    """Forward NUM_MB micro-batches, then backward them (split: every B first, then every W); ``cast``: the
    runtime's one 16-bit copy of each weight per step (``weight_cast.py``), else plain autocast."""
    gen = torch.Generator().manual_seed(0)
    dtype = next(module.parameters()).dtype
    xs = [torch.randn(MB, SEQ, SPEC.hidden_size, generator=gen, dtype=dtype) for _ in range(NUM_MB)]
    grads = [torch.randn(MB, SEQ, SPEC.hidden_size, generator=gen, dtype=dtype) for _ in range(NUM_MB)]
    labels = [torch.randint(0, SPEC.vocab_size, (MB, SEQ), generator=gen) for _ in range(NUM_MB)]
    module.zero_grad(set_to_none=True)
    params = [p for p in module.parameters() if p.requires_grad]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    outs, input_grads, works = [], [], []
    with ctx, module.weight_cast.step(torch.bfloat16 if cast else None):
        for x in xs:
            x = x.clone().requires_grad_()
            out = module(x)
            outs.append((x, module.loss_sum(out.to(dtype), labels[len(outs)]) if last else out))
        for (x, root), g in zip(outs, grads):
            grad = None if last else g.to(root.dtype)
            if split:
                gx, work = backward_input(root, grad, x, params)
                assert all(p.grad is None for p in params), "B must leave every weight gradient alone"
                works.append(work)
                input_grads.append(gx)
            else:
                torch.autograd.backward(root, grad)
                input_grads.append(x.grad)
        for work in works:
            backward_weight(work)
    return input_grads, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("spec", [SPEC, GPT, TIED], ids=["llama", "gpt", "tied"])
@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
def test_split_equals_the_whole_backward_bit_for_bit(spec: ModelSpec, last: bool, recompute: bool) -> None:
    module = _stage(spec, last, recompute)
    ref_inputs, ref_weights = _run(module, last, split=False)
    got_inputs, got_weights = _run(module, last, split=True)
    for a, b in zip(ref_inputs, got_inputs):
        assert torch.equal(a, b)
    assert ref_weights.keys() == got_weights.keys()
    for name in ref_weights:
        assert torch.equal(ref_weights[name], got_weights[name]), name


def test_w_finishes_the_last_layers_weights_first_as_a_whole_backward_does() -> None:
    """The block sync fires buckets from post-accumulate hooks in one global order, last layers first
    (``runtime/sync/buckets.py``): a W that finished the first layer's weights first would leave every bucket
    waiting for its last root. Each W root's hooks fire layer by layer from the stage's top (it failed with
    the roots in post-order: layer 1, then 2)."""
    module = _stage(SPEC, last=False)
    order: list[int] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: order.append(int(name.split(".")[1])))
    x = torch.randn(MB, SEQ, SPEC.hidden_size, dtype=torch.float64, requires_grad=True)
    out = module(x)
    _, work = backward_input(out, torch.randn_like(out), x, list(module.parameters()))
    assert not order  # B leaves every weight to W
    backward_weight(work)
    assert order == sorted(order, reverse=True) and set(order) == {1, 2}


@pytest.mark.parametrize("cast", [False, True], ids=["plain-autocast", "weight-cast"])
def test_split_under_bf16_autocast_with_its_shared_weight_copies(cast: bool) -> None:
    """Both ways a 16-bit step can hold its weight copies: autocast's cache, or the runtime's ``WeightCast``
    (whose backward adds into ``.grad`` itself: W still does it, B still does not)."""
    module = _stage(SPEC, last=False, dtype=torch.float32)
    ref_inputs, ref_weights = _run(module, False, split=False, autocast=True, cast=cast)
    got_inputs, got_weights = _run(module, False, split=True, autocast=True, cast=cast)
    assert all(torch.equal(a, b) for a, b in zip(ref_inputs, got_inputs))
    assert all(torch.equal(ref_weights[n], got_weights[n]) for n in ref_weights)
    if cast:  # the same gradients as plain autocast's, bit for bit (no tied weight in this stage)
        _, plain = _run(module, False, split=True, autocast=True)
        assert all(torch.equal(plain[n], got_weights[n]) for n in plain)


def test_b_and_w_run_the_whole_backwards_matmuls_but_recompute_would_repeat_forwards() -> None:
    """Without recompute B + W run exactly the whole backward's matmuls. Under recompute W recomputes the
    checkpointed layers once per split node (one autograd call each): why the schedules never split a
    recomputing stage."""
    for recompute in (False, True):
        module = _stage(SPEC, last=False, recompute=recompute)
        params = list(module.parameters())
        x = torch.randn(MB, SEQ, SPEC.hidden_size, dtype=torch.float64, requires_grad=True)
        g = torch.randn(MB, SEQ, SPEC.hidden_size, dtype=torch.float64)
        with _Matmuls() as forward:
            out = module(x)
        with _Matmuls() as whole:
            torch.autograd.backward(out, g)
        out = module(x)
        with _Matmuls() as b:
            _, work = backward_input(out, g, x, params)
        with _Matmuls() as w:
            backward_weight(work)
        assert b.count > 0 and w.count > 0
        if recompute:
            assert b.count + w.count > whole.count + 2 * forward.count
        else:
            assert b.count + w.count == whole.count


def test_a_weight_used_twice_falls_back_to_a_whole_backward() -> None:
    """The W of the upper use would run down the input path into the lower one: B does it all, W is empty."""
    lin = torch.nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = lin(torch.tanh(lin(x)))
    g = torch.randn(4, 8, dtype=torch.float64)
    ref = torch.autograd.grad(out, [x, lin.weight, lin.bias], g, retain_graph=True)
    gx, work = backward_input(out, g, x, list(lin.parameters()))
    assert work.roots == [] and torch.equal(gx, ref[0])
    backward_weight(work)
    assert torch.equal(lin.weight.grad, ref[1]) and torch.equal(lin.bias.grad, ref[2])


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_the_memory_model_bounds_what_a_pending_w_holds(last: bool) -> None:
    """Between B and W a micro-batch keeps its split nodes' output gradients: ``CostModel.held_grad_bytes``
    prices them (an upper bound, within 2x of the measured unique storages)."""
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost.model import CostModel
    from ethpipe.plan import Stage

    module = _stage(SPEC, last, dtype=torch.float32)
    x = torch.randn(MB, SEQ, SPEC.hidden_size, requires_grad=True)
    out = module(x)
    root = module.loss_sum(out, torch.zeros(MB, SEQ, dtype=torch.long)) if last else out
    _, work = backward_input(root, None if last else torch.randn_like(out), x, list(module.parameters()))
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for _, _, grads in work.roots for g in grads if g is not None}
    held = sum(storages.values())
    cluster = cluster_from_dict({"nodes": [{"gpu": {"id": "cpu", "memory_gib": 1.0, "peak_tflops": 1.0},
                                            "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 10}]})
    cost = CostModel(cluster, SPEC, SEQ, dtype_bytes=4, dtype="fp32")
    priced = cost.held_grad_bytes(Stage((0,), "cpu", (1, 3)), MB, last=last)
    assert held <= priced <= 2 * held, (held, priced)
