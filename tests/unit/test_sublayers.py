"""Stages cut between a layer's attention and its MLP (``ethpipe.sublayers``): the plan contract, what the runtime
builds and runs (counted), what the cost model prices, and the planner's use of them (training exactness:
tests/dist/test_exactness.py's "half-layer-cuts", test_broken_runtime.py's "lone-half-without-residual")."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost import memory, ops
from ethpipe.cost.model import CostModel
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan, compute_blocks
from ethpipe.plan_parts import in_half_layers
from ethpipe.plan_text import layers_text
from ethpipe.planner import PlannerOptions, estimate_plan, make_plan
from ethpipe.runtime.model.decoder import build_stage
from ethpipe.sim.engine import simulate
from ethpipe.sublayers import attention_units, layer_parts, unit_of_parameter

from test_counted_work import GPT, GQA, MHA, accumulation_bytes

SEQ, BATCH = 16, 2
CLUSTER = cluster_from_dict({"nodes": [
    {"gpu": "h100_sxm", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 200},
    {"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 100},
    {"gpu": "l4", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 50}]})


def test_units_name_the_halves_of_layers() -> None:
    assert layer_parts(3, 8, 2) == [(1, ("mlp",)), (2, ("attn", "mlp")), (3, ("attn", "mlp"))]
    assert layer_parts(4, 7, 2) == [(2, ("attn", "mlp")), (3, ("attn",))]
    assert layer_parts(2, 4, 1) == [(2, ("attn", "mlp")), (3, ("attn", "mlp"))]
    assert [attention_units(lo, hi, 2) for lo, hi in ((0, 1), (1, 2), (1, 6), (0, 6), (3, 3))] == [1, 0, 2, 3, 0]
    assert unit_of_parameter("layers.7.attn.wq.weight", 2) == 14
    assert unit_of_parameter("layers.7.attn_norm.weight", 2) == 14
    assert unit_of_parameter("layers.7.mlp_norm.weight", 2) == 15
    assert unit_of_parameter("layers.7.mlp.w2.weight", 1) == 7
    assert layers_text([(15, 23)], 2) == "L7m-11a" and layers_text([(14, 16)], 2) == "L7"
    assert layers_text([(15, 16)], 2) == "L7m" and layers_text([(14, 15)], 2) == "L7a"


@pytest.mark.parametrize("spec", [MHA, GPT], ids=lambda s: s.name)
def test_stages_in_half_layers_are_the_model_split(spec: ModelSpec) -> None:
    """Stages cut inside layers hold every parameter once, under the model's own names and values, and run the
    model's forward bit for bit (float64)."""
    spec = dataclasses.replace(spec, num_layers=3)
    full = build_stage(spec, (0, 3), True, True, seed=5, dtype=torch.float64)
    cuts = [0, 1, 4, 5, 6]
    stages = [build_stage(spec, (lo, hi), lo == 0, hi == 6, seed=5, dtype=torch.float64, sublayers=2)
              for lo, hi in zip(cuts, cuts[1:])]
    reference = dict(full.named_parameters())
    names = [n for st in stages for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(reference) and len(names) == len(set(names))
    assert all(torch.equal(p, reference[n]) for st in stages for n, p in st.named_parameters())
    x = torch.randint(0, spec.vocab_size, (BATCH, SEQ))
    h = x
    for st in stages:
        h = st(h)
    assert torch.equal(h, full(x))
    with pytest.raises(ValueError, match="outside the model"):
        build_stage(spec, (0, 7), True, True, sublayers=2)


def _half_stage(spec: ModelSpec, half: str) -> torch.nn.Module:
    unit = 0 if half == "attn" else 1
    return build_stage(dataclasses.replace(spec, num_layers=1), (unit, unit + 1), first=False, last=False,
                       sublayers=2)


@pytest.mark.parametrize("spec,half,autocast", list(itertools.product([GQA, GPT], ["attn", "mlp"], [False, True])),
                         ids=lambda x: getattr(x, "name", str(x)))
def test_a_halfs_gemm_flops_and_accumulation_are_priced_as_counted(spec: ModelSpec, half: str,
                                                                   autocast: bool) -> None:
    """A lone attention or MLP half runs the GEMMs ``ops.block_kernels(half=...)`` prices and accumulates the
    bytes ``ops.grad_accumulation_kernels(half=...)`` prices (the counts of tests/unit/test_counted_work.py)."""
    stage, e = _half_stage(spec, half), 2 if autocast else 4
    counter = FlopCounterMode(display=False)
    x = torch.randn(BATCH, SEQ, spec.hidden_size, requires_grad=True)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with sdpa_kernel([SDPBackend.MATH]), region, stage.weight_cast.step(torch.bfloat16 if autocast else None):
        with counter:
            out = stage(x)
        fwd = counter.get_total_flops()
        with counter:
            out.float().sum().backward()
        bwd = counter.get_total_flops()
    priced = {bw: ops.block_kernels(spec, SEQ, BATCH, 1, e, "flash", bw, half=half) for bw in (False, True)}
    linear = {bw: sum(k.flops for k in ks if k.kind == "gemm" and k.name != "flash_attn") for bw, ks in priced.items()}
    attention = sum(k.flops for k in priced[False] if k.name == "flash_attn") / ops.FLASH_CAUSAL_FRACTION
    assert (attention > 0) == (half == "attn")
    assert fwd == pytest.approx(linear[False] + attention, rel=1e-9)
    assert bwd == pytest.approx(linear[True] + 2 * attention, rel=1e-9)  # the math path's backward: 2x its forward
    counted = accumulation_bytes(stage, spec, False, autocast)
    accumulated = sum(k.num_bytes for k in ops.grad_accumulation_kernels("block", spec, 1, e, half=half))
    assert counted == pytest.approx(accumulated, rel=0.10)
    whole = {bw: ops.block_kernels(spec, SEQ, BATCH, 1, e, "flash", bw) for bw in (False, True)}
    other = "mlp" if half == "attn" else "attn"
    for bw in (False, True):  # the halves partition the block's kernels
        assert sorted(priced[bw] + ops.block_kernels(spec, SEQ, BATCH, 1, e, "flash", bw, half=other),
                      key=repr) == sorted(whole[bw], key=repr)


@pytest.mark.parametrize("spec,autocast", list(itertools.product([GQA, GPT], [False, True])),
                         ids=lambda x: getattr(x, "name", str(x)))
def test_a_halfs_saved_activations_are_priced_as_counted(spec: ModelSpec, autocast: bool) -> None:
    """What a lone half keeps for backward (autograd's saved tensors, each storage once, its weights' 16-bit
    copies apart) is ``memory.runtime_block_activation_bytes(half=...)``, and the halves add up to the block."""
    d = 2 if autocast else 4
    for half in ("attn", "mlp"):
        stage = _half_stage(spec, half)
        weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype.is_floating_point and t.untyped_storage().data_ptr() not in weights:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        region = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        x = torch.randn(BATCH, SEQ, spec.hidden_size, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), region:
            stage(x)
        rope = SEQ * spec.head_dim_resolved * d if spec.position == "rope" and half == "attn" else 0
        matrices = sum(p.numel() for p in stage.parameters() if p.dim() >= 2)
        priced = memory.runtime_block_activation_bytes(spec, SEQ, d, 1, half=half) * BATCH
        assert sum(seen.values()) == priced + rope + memory.autocast_weight_bytes(matrices, d, 1), half
    assert sum(memory.runtime_block_activation_bytes(spec, SEQ, d, 1, half=h) for h in ("attn", "mlp")) == \
        pytest.approx(memory.runtime_block_activation_bytes(spec, SEQ, d, 1), rel=1e-12)


def _halved(plan: Plan) -> Plan:
    pipes = in_half_layers(plan.pipelines)
    return dataclasses.replace(plan, pipelines=pipes, blocks=compute_blocks(pipes))


@pytest.fixture(scope="module")
def whole_plan() -> Plan:
    return make_plan(CLUSTER, load_model_spec("llama2-7b"), 192, 4096, options=PlannerOptions(sublayer_cuts=False))


def test_a_plan_in_half_layers_with_whole_cuts_prices_as_the_whole_plan(whole_plan: Plan) -> None:
    """The same cuts counted in half layers: the estimate (times, busy seconds, memory) and the simulator give the
    whole-layer plan's numbers, so every difference a real half-layer cut makes is the cut's."""
    half = Plan.from_dict(_halved(whole_plan).to_dict())
    assert half.sublayers == 2 and half.num_layers == 64 and half == _halved(whole_plan)
    cost = CostModel.for_plan(whole_plan)
    a, b = estimate_plan(whole_plan, cost), estimate_plan(half, cost)
    assert b.iteration_time_s == pytest.approx(a.iteration_time_s, rel=1e-12)
    assert b.memory_bytes == a.memory_bytes
    assert all(b.busy_s[r] == pytest.approx(a.busy_s[r], rel=1e-12) for r in a.busy_s)
    assert simulate(half, cost).iteration_time_s == pytest.approx(simulate(whole_plan, cost).iteration_time_s,
                                                                  rel=1e-12)


def test_an_attention_and_an_mlp_half_add_up_to_a_layer() -> None:
    cost = CostModel(CLUSTER, load_model_spec("llama3-8b"), 4096)
    stage = in_half_layers(make_plan(CLUSTER, cost.model, 48, 4096,
                                     options=PlannerOptions(sublayer_cuts=False)).pipelines)[0].stages[1]
    lone = [dataclasses.replace(stage, layers=(u, u + 1)) for u in (2, 3)]  # layer 1's attention, its MLP
    pair = dataclasses.replace(stage, layers=(2, 4))
    for recompute in (False, True):
        (af, ab), (mf, mb) = cost.half_layer_times_s(stage.device, 1, stage.tp, recompute)
        lf, lb = cost.layer_times_s(stage.device, 1, stage.tp, recompute)
        assert (af + mf, ab + mb) == pytest.approx((lf, lb), rel=1e-12)
        assert 0.15 < af / lf < 0.5  # llama3-8b at 4096 tokens: its MLP is most of a layer
    w = [cost.weight_grad_s(s, 1, first=False, last=False) for s in (*lone, pair)]
    assert w[0] + w[1] == pytest.approx(w[2], rel=1e-12) and w[0] > 0 and w[1] > 0
    held = [cost.held_grad_bytes(s, 1) for s in (*lone, pair)]
    assert held[0] + held[1] == pytest.approx(held[2], abs=2)  # each rounded down to whole bytes
    params = [cost.stage_params(s.num_layers, first=False, last=False, halves=s.halves) for s in (*lone, pair)]
    assert params[0] + params[1] == params[2] == cost.model.params_per_layer()


def test_the_planner_cuts_inside_layers_where_that_is_faster() -> None:
    """llama3-8b at one sample per GPU: its 128k-vocabulary head is two layers' worth, which whole layers cannot
    balance; the plan in half layers is predicted faster than the same search in whole layers, which it
    records, and it loads back as a plan file."""
    spec = load_model_spec("llama3-8b")
    cut = make_plan(CLUSTER, spec, 48, 4096)
    whole = make_plan(CLUSTER, spec, 48, 4096, options=PlannerOptions(sublayer_cuts=False))
    record = cut.extra["search"]["sublayer_cuts"]
    assert cut.sublayers == 2 and record["kept"] and whole.sublayers == 1
    assert any(lo % 2 or hi % 2 for p in cut.pipelines for st in p.stages for lo, hi in st.layer_ranges)
    assert cut.predicted["iteration_time_s"] < whole.predicted["iteration_time_s"]
    assert record["half_layers_s"] < record["whole_layers_s"]
    assert "sublayer_cuts" not in whole.extra["search"]  # not tried
    loaded = Plan.from_dict(cut.to_dict())
    assert estimate_plan(loaded, CostModel.for_plan(loaded)).iteration_time_s == pytest.approx(
        cut.predicted["iteration_time_s"], rel=1e-9)


def test_a_hand_edited_plan_in_half_layers_is_checked(whole_plan: Plan) -> None:
    data = _halved(whole_plan).to_dict()
    with pytest.raises(UserError, match="'sublayers' must be 1 .* or 2"):
        Plan.from_dict({**data, "sublayers": 3})
    with pytest.raises(UserError, match="covers layers \\[0, 64\\) but the model has 32 layers"):
        Plan.from_dict({**data, "sublayers": 1})


def test_ethpipe_plan_says_where_stages_end_inside_layers(tmp_path) -> None:
    import json

    import yaml
    from typer.testing import CliRunner

    from ethpipe.cli import commands  # noqa: F401  (registers the commands)
    from ethpipe.cli.app import app

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER.source))
    args = ["plan", "--cluster", str(cluster), "--model", "llama3-8b", "--global-batch", "48", "--seq-len", "4096"]
    cut = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "cut.json")], env={"COLUMNS": "250"})
    assert cut.exit_code == 0, cut.output
    assert "stages cut inside layers (a = attention, m = MLP half)" in cut.output and "m-" in cut.output
    assert json.loads((tmp_path / "cut.json").read_text())["sublayers"] == 2
    whole = CliRunner().invoke(app, [*args, "--no-sublayer-cuts", "--out", str(tmp_path / "whole.json")])
    assert whole.exit_code == 0, whole.output
    assert "sublayers" not in json.loads((tmp_path / "whole.json").read_text())
    assert "inside layers" not in whole.output

