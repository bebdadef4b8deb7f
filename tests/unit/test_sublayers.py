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
from ethpipe.plan import Plan, Stage, compute_blocks
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


def _half_stage(spec: ModelSpec, half: str, recompute: bool = False) -> torch.nn.Module:
    unit = 0 if half == "attn" else 1
    return build_stage(dataclasses.replace(spec, num_layers=1), (unit, unit + 1), first=False, last=False,
                       sublayers=2, recompute=recompute)


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


@pytest.mark.parametrize("half", ["attn", "mlp"])
def test_a_lone_recomputing_half_reruns_what_is_priced(half: str) -> None:
    """torch's non-reentrant checkpoint stops a lone half's re-run before its last GEMM (the attention half's
    output projection, the MLP half's fc2), as ``ops.recompute_kernels(half=...)`` prices it."""
    from test_counted_work import LINEAR_GEMMS, _counted_flops, _priced_gemm_flops

    spec = dataclasses.replace(GQA, num_layers=1)
    plain, again = (_half_stage(spec, half, recompute=rc) for rc in (False, True))
    (fwd, bwd), (fwd_r, bwd_r) = _counted_flops(plain, spec, False), _counted_flops(again, spec, False)
    rerun = _priced_gemm_flops(ops.recompute_kernels(spec, SEQ, BATCH, 1, 4, "flash", half=half), LINEAR_GEMMS)
    attention = 4.0 * BATCH * spec.num_heads * SEQ * SEQ * spec.head_dim_resolved if half == "attn" else 0.0
    assert fwd_r == fwd and bwd_r == pytest.approx(bwd + rerun + attention, rel=1e-9)
    assert rerun > 0 and {k.name for k in ops.recompute_kernels(spec, SEQ, BATCH, 1, 4, "flash", half=half)
                          if k.kind == "gemm"} == ({"qkv", "flash_attn"} if half == "attn" else {"fc1"})


def test_a_lone_recomputing_half_reruns_no_tp_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank of a tp-2 stage (torch's fake process group): recomputing, a whole layer re-runs one all-reduce
    (after its attention), a lone attention or MLP half none, as ``CostModel.stage_tp_comm_s`` prices them."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ethpipe.runtime.model.tensor_parallel import TPGroup

    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    spec = dataclasses.replace(GQA, num_layers=1)

    def backward_all_reduces(units: tuple[int, int], recompute: bool) -> int:
        stage = build_stage(spec, units, first=False, last=False, sublayers=2, recompute=recompute,
                            tp=TPGroup(dist.group.WORLD, 0, 2))
        out = stage(torch.randn(BATCH, SEQ, spec.hidden_size, requires_grad=True))
        calls.clear()
        out.sum().backward()
        return len(calls)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        rerun = {units: backward_all_reduces(units, True) - backward_all_reduces(units, False)
                 for units in ((0, 2), (0, 1), (1, 2))}
    finally:
        dist.destroy_process_group()
    assert rerun == {(0, 2): 1, (0, 1): 0, (1, 2): 0}
    for (lo, hi), n in rerun.items():  # the re-run all-reduces the pricing counts (``stage_tp_comm_s``)
        stage = Stage((0, 1), "h100_sxm", (lo, hi), 2, True, sublayers=2)
        assert (stage.halves[0] - stage.lone_attention) * ops.RECOMPUTE_TP_ALLREDUCES == n


def test_half_stages_price_alike_everywhere_and_a_lone_attention_half_reruns_less() -> None:
    """Every range in half layers, recomputing or not, tp 1 and 2: the planner's rows (``LayerCount``) price a
    stage as ``CostModel.stage_compute_s`` does; a recomputing stage that ends after an attention half re-runs
    neither its projection nor its all-reduce, and the TP comm a run's fit takes out says so."""
    from ethpipe.planner.layers.timing import StageSlot, _layers_s, _stage_of, layer_count

    cost = CostModel(CLUSTER, load_model_spec("llama3-8b"), 4096)
    for (lo, hi), rc, tp in itertools.product([(0, 3), (1, 4), (1, 5), (0, 4), (2, 3), (1, 2), (3, 8)],
                                              (False, True), (1, 2)):
        stage = Stage(tuple(range(tp)), "h100_sxm", (lo, hi), tp, rc, sublayers=2)
        slot = StageSlot(stage.device, tp, stage.ranks)
        priced = cost.stage_compute_s(stage, 1, first=False, last=False)
        assert _layers_s(cost, slot, layer_count(stage), rc, 1) == pytest.approx(priced, rel=1e-12)
        rebuilt = _stage_of(slot, layer_count(stage), rc)
        assert (rebuilt.halves, rebuilt.lone_attention) == (stage.halves, stage.lone_attention)
        assert stage.lone_attention == hi % 2
        saved = cost.lone_attention_saving_s(stage.device, 1, tp, rc)
        assert (saved > 0) == rc
        if rc and hi % 2:
            ending = Stage(stage.ranks, stage.device, (lo, hi + 1), tp, rc, sublayers=2)  # the same, its MLP added
            _, (_, mlp_b) = cost.half_layer_times_s(stage.device, 1, tp, True)
            whole_b = cost.stage_compute_s(ending, 1, first=False, last=False)[1]
            assert whole_b - mlp_b - priced[1] == pytest.approx(saved, rel=1e-9)
        comm = cost.stage_tp_comm_s(stage, 1, first=False, last=False)
        plain = cost.stage_tp_comm_s(dataclasses.replace(stage, recompute=False), 1, first=False, last=False)
        per_allreduce = cost.stage_tp_comm_s(Stage(stage.ranks, stage.device, (0, 2), tp, False, sublayers=2), 1,
                                             first=False, last=False)[0] / 2
        assert comm[1] - plain[1] == pytest.approx(rc * (stage.halves[0] - hi % 2) * per_allreduce, abs=1e-15)


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


def test_a_replan_keeps_the_plans_choice_of_sublayer_cuts() -> None:
    """`ethpipe replan` plans with the options the old plan records (``search.options``), so a plan made with
    `--no-sublayer-cuts` is re-planned in whole layers; a bad record is one clear error."""
    from ethpipe.cli.replanning import recorded_options, replan

    spec = load_model_spec("llama3-8b")
    whole = make_plan(CLUSTER, spec, 48, 4096, options=PlannerOptions(sublayer_cuts=False))
    assert recorded_options(whole, allow_idle=False) == PlannerOptions(sublayer_cuts=False, allow_idle=False)
    again = replan(whole, CLUSTER)
    assert "sublayer_cuts" not in again.extra["search"] and again.sublayers == 1
    assert again.extra["search"]["options"]["sublayer_cuts"] is False
    assert "sublayer_cuts" in replan(make_plan(CLUSTER, spec, 48, 4096), CLUSTER).extra["search"]  # tried
    bad = dataclasses.replace(whole, extra={**whole.extra, "search": {"options": {"sublayer_cuts": "no"}}})
    with pytest.raises(UserError, match="'search.options.sublayer_cuts' must be true or false"):
        recorded_options(bad, allow_idle=True)


def test_the_batch_is_re_split_for_the_cut_stages() -> None:
    """gpt3-1.3b at one sample per GPU on 1024 GPUs of three types, unsharded: the cuts shorten some pipelines' slowest
    stages, and level 3 then gives those pipelines more samples; the plan so re-split is faster than the same cuts
    at the whole-layer plan's split, and every rank still fits its memory."""
    from ethpipe.planner.layers.sublayer_cuts import try_sublayer_cuts

    cluster = cluster_from_dict({"nodes": [
        {"gpu": "a100_80gb_sxm", "num_nodes": 45, "gpus_per_node": 8, "nic_gbit_s": 400},
        {"gpu": "a100_pcie_80gb", "num_nodes": 47, "gpus_per_node": 8, "nic_gbit_s": 800},
        {"gpu": "v100_16gb_pcie", "num_nodes": 72, "gpus_per_node": 4, "nic_gbit_s": 200}]})
    whole = make_plan(cluster, load_model_spec("gpt3-1.3b"), cluster.num_devices, 2048,
                      options=PlannerOptions(sublayer_cuts=False), shard_optimizer=False)  # sharded: 368 pipelines
    cost = CostModel.for_plan(whole)  # on the A100s, where the cuts do not pay
    cut, est, why = try_sublayer_cuts(whole, cost, whole.predicted["iteration_time_s"])
    assert est is not None, why
    assert any(a.num_samples != b.num_samples for a, b in zip(cut.pipelines, whole.pipelines))
    assert sum(p.num_samples for p in cut.pipelines) == whole.global_batch_size
    assert all(max(a.micro_batch_sizes) == max(b.micro_batch_sizes) and a.schedule == b.schedule
               for a, b in zip(cut.pipelines, whole.pipelines))
    at_old_split = dataclasses.replace(cut, pipelines=tuple(
        dataclasses.replace(c, micro_batch_sizes=w.micro_batch_sizes) for c, w in zip(cut.pipelines, whole.pipelines)))
    assert est.iteration_time_s < estimate_plan(at_old_split, cost).iteration_time_s < whole.predicted[
        "iteration_time_s"]
    devices = cost.cluster.devices
    assert all(n <= cost.usable_memory_bytes(devices[r].gpu.id) for r, n in est.memory_bytes.items())
    from ethpipe.cli.plan_lines import sublayer_line
    from ethpipe.planner.layers.sublayer_cuts import with_sublayer_cuts

    recorded = with_sublayer_cuts(whole, cost)
    assert recorded.extra["search"]["sublayer_cuts"]["batch_resplit"] is True
    assert "the batch re-split for them" in sublayer_line(recorded)


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

