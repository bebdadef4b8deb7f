"""Every plan shape trains to the same parameters as plain single-process PyTorch (docs/design.md §2.2).

Seven plans run one after another in the SAME six forked processes (fresh groups per plan),
so the whole check costs one spawn; the fourth leaves two of its cluster's eight devices idle
(no rank: to the runtime it is just a six-rank world). The last two are laid out by ETH itself on
real GPU clusters (``planned``: a hybrid of mixed and per-type pipelines, and one pipeline with a
TP degree per device type), then trained on a small model with the same number of layers; the seventh cuts stages
inside layers (``ethpipe.sublayers``). Parameters, per-step losses and gradient norms are
compared with a single-process AdamW reference on the same global batches and init, in
float64 with the tolerances derived in ``exactness.py``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ethpipe import planner
from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.model_spec import ModelSpec
from ethpipe.model_load import load_model_spec
from ethpipe.plan import IdleDevice, Plan
from ethpipe.planner import PlannerOptions
from ethpipe.runtime.checkpoint.consolidated import save_atomic
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig, train

from .exactness import assert_matches_reference
from .harness import run_ranks
from .plans import GPT_LIKE, LLAMA_LIKE, half_layer_plan, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

STEPS = 3
LR = 1e-3
CPU = {"id": "cpu", "memory_gib": 1.0, "peak_tflops": 1.0}
# Devices 4-5 (a "spare" node) are idle, so ranks 0..5 are devices 0-3 and 6-7.
IDLE_CLUSTER = {"nodes": [
    {"gpu": CPU, "num_nodes": 2, "gpus_per_node": 2, "nic_gbit_s": 10},
    {"gpu": {**CPU, "id": "spare"}, "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 10},
    {"gpu": CPU, "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 10},
]}


def _cluster(*parts: tuple[str, int, int]) -> Cluster:
    return cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": n, "gpus_per_node": k, "nic_gbit_s": 1600}
                                        for g, n, k in parts]})


def planned(parts: tuple, model: str, batch: int, spec: ModelSpec, schedules: tuple[str, ...] | None = None) -> Plan:
    """ETH's own layout for ``model`` on a real-GPU cluster, retargeted to ``spec`` (same layer count)
    and sequence 16 so that six CPU ranks can train it."""
    layout = planner.make_plan(_cluster(*parts), load_model_spec(model), batch, 2048, max_tp=4,
                               options=PlannerOptions(allow_idle=False), schedules=schedules)
    assert spec.num_layers == layout.num_layers
    out = dataclasses.replace(layout, model=spec.name, model_spec=spec, seq_len=16)
    return Plan.from_dict(json.loads(out.to_json()))  # validated as a plan file is (TP degrees fit spec)


def _planned_plans() -> tuple[Plan, Plan]:
    hybrid = planned((("a100_80gb_sxm", 1, 2), ("l4", 1, 2), ("h100_sxm", 1, 2)), "gpt3-350m", 16,
                     dataclasses.replace(GPT_LIKE, name="test-gpt-24", num_layers=24),
                     schedules=("1f1b",))  # with zb-h1 a non-hybrid layout wins here
    kinds = [{s.device for s in p.stages} for p in hybrid.pipelines]
    assert any(len(k) > 1 for k in kinds) and any(len(k) == 1 for k in kinds), "precondition: a hybrid layout"
    per_type = planned((("h100_sxm", 1, 2), ("v100_16gb", 1, 4)), "llama2-7b", 8,
                       dataclasses.replace(LLAMA_LIKE, name="test-llama-32", num_layers=32, num_kv_heads=4),
                       schedules=("1f1b",))  # with zb-h1 one TP degree (2) everywhere wins here
    assert any(len({(s.device, s.tp) for s in p.stages}) > 1 and len({s.tp for s in p.stages}) > 1
               for p in per_type.pipelines), "precondition: TP degree per device type in one pipeline"
    return hybrid, per_type


def _scenarios(tmp: Path, data: str) -> list[tuple[str, object, TrainConfig, dict]]:
    """(name, plan, config, reference kwargs) for each plan shape."""
    common = dict(data=data, steps=STEPS, lr=LR, progress=False, timeout_s=60.0, dtype="fp64")
    three = make_plan(LLAMA_LIKE, [
        ([(0, (0, 6))], (3, 2)),  # depth 1, smaller last micro-batch
        ([(1, (0, 3)), (2, (3, 6))], (2, 2, 1)),  # depth 2
        ([(3, (0, 2)), (4, (2, 4)), (5, (4, 6))], (2,)),  # depth 3, one micro-batch < stages
    ])
    deep = make_plan(LLAMA_LIKE, [([(r, (r, r + 1)) for r in range(6)], (3, 2))])  # 6 stages, 2 micro-batches
    mixed = make_plan(GPT_LIKE, [
        ([(0, (0, 1), "fast"), (1, (1, 4), "fast"), (2, (4, 6), "fast")], (1, 1, 1, 1)),
        ([(3, (0, 3), "slow"), (4, (3, 5), "slow", True), (5, (5, 6), "slow")], (3, 1)),
    ], extra={"device_speeds": {"fast": 1.0, "slow": 0.5}})
    idle = dataclasses.replace(make_plan(LLAMA_LIKE, [
        ([(0, (0, 2)), (1, (2, 4)), (2, (4, 6))], (2, 1)),
        ([(3, (0, 4)), (4, (4, 6))], (2, 2)),
        ([(5, (0, 6))], (1,)),
    ]), cluster=IDLE_CLUSTER, idle_devices=tuple(IdleDevice(i, "spare", "idle: test") for i in (4, 5)))
    idle = Plan.from_dict(json.loads(idle.to_json()))  # validated as a plan file is
    assert idle.idle_device_indices == (4, 5) and idle.world_size == 6
    hybrid, per_type = _planned_plans()
    # Stages that end inside a layer (12 half layers): pipelines cut at different halves, so a gradient block is one
    # MLP half ([7, 8)) held by stages at different depths; a recomputing half-layer stage; zb-h1's split backward.
    halves = half_layer_plan(LLAMA_LIKE, [
        ([(0, (0, 3), False), (1, (3, 8), False), (2, (8, 12), False)], (2, 1, 1), "zb-h1"),
        ([(3, (0, 7), True), (4, (7, 12), False)], (2, 2), "1f1b"),
        ([(5, (0, 12), False)], (1,), "1f1b"),
    ])
    assert [b.layers for b in halves.blocks] == [(0, 3), (3, 7), (7, 8), (8, 12)]
    init_file = str(tmp / "init.safetensors")
    save_atomic(build_full_model(GPT_LIKE, seed=7).state_dict(), init_file)
    return [
        ("three-pipelines-clip", three,
         TrainConfig(**common, clip_grad=0.05, save_final=str(tmp / "a.safetensors"), trace=str(tmp / "a.trace.json")),
         dict(clip_grad=0.05)),
        ("one-deep-pipeline", deep,
         TrainConfig(**common, weight_decay=0.0, bucket_bytes=4096, save_final=str(tmp / "b.pt")),
         dict(weight_decay=0.0)),
        ("gpt-two-pipelines", mixed,
         TrainConfig(**common, clip_grad=0.5, seed=3, shuffle=True, warmup_steps=1, lr_schedule="cosine",
                     emulate=True, init_from=init_file, save_final=str(tmp / "c.safetensors")),
         dict(clip_grad=0.5, seed=3, shuffle=True, warmup_steps=1, cosine=True, init_seed=7)),
        ("idle-devices", idle, TrainConfig(**common, clip_grad=0.05, save_final=str(tmp / "d.safetensors"),
                                           adam_betas=(0.8, 0.99), adam_eps=1e-6, lr_schedule="wsd", warmup_steps=1,
                                           decay_fraction=0.5, min_lr_ratio=0.2),
         dict(clip_grad=0.05, betas=(0.8, 0.99), eps=1e-6, warmup_steps=1, wsd_decay_fraction=0.5, min_lr_ratio=0.2)),
        ("planned-hybrid", hybrid, TrainConfig(**common, save_final=str(tmp / "e.safetensors")), {}),
        ("planned-per-type-tp", per_type, TrainConfig(**common, clip_grad=0.05, save_final=str(tmp / "f.safetensors")),
         dict(clip_grad=0.05)),
        ("half-layer-cuts", halves, TrainConfig(**common, clip_grad=0.05, save_final=str(tmp / "g.safetensors")),
         dict(clip_grad=0.05)),
    ]


def _worker(rank: int, world_size: int, scenarios: list, out_dir: str) -> None:
    for name, plan, config, _ in scenarios:
        records = train(plan, config, rank, world_size)
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(records))


def _load(path: str) -> dict[str, torch.Tensor]:
    return load_file(path) if path.endswith(".safetensors") else torch.load(path, weights_only=True)


def test_plans_match_single_process_adamw(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    words = ["the", "pipeline", "balances", "data", "not", "layers", "across", "mixed", "devices", "."]
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(words, size=4000))], data)
    scenarios = _scenarios(tmp_path, data)
    run_ranks(6, _worker, (scenarios, str(tmp_path)), tmp_path)

    for name, plan, config, ref_kwargs in scenarios:
        spec = plan.resolve_model()
        init_seed = ref_kwargs.get("init_seed", ref_kwargs.get("seed", 0))
        ref = reference_train(
            spec, data, plan.global_batch_size, plan.seq_len, STEPS, LR,
            weight_decay=ref_kwargs.get("weight_decay", 0.1), clip_grad=ref_kwargs.get("clip_grad", 0.0),
            seed=ref_kwargs.get("seed", 0), init_seed=init_seed, shuffle=ref_kwargs.get("shuffle", False),
            warmup_steps=ref_kwargs.get("warmup_steps", 0), cosine=ref_kwargs.get("cosine", False),
            betas=ref_kwargs.get("betas", (0.9, 0.95)), eps=ref_kwargs.get("eps", 1e-8),
            wsd_decay_fraction=ref_kwargs.get("wsd_decay_fraction"), min_lr_ratio=ref_kwargs.get("min_lr_ratio", 0.1),
        )
        records = json.loads(Path(tmp_path, f"{name}.json").read_text())
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        assert_matches_reference(name, _load(config.save_final), records, ref)
        if config.clip_grad > 0:
            assert max(ref.grad_norms) > config.clip_grad, f"{name}: clipping never engaged, the test proves nothing"
        assert all(len(r["pipeline_compute_s"]) == len(plan.pipelines) for r in records)

    trace = json.loads(Path(tmp_path, "a.trace.json").read_text())["traceEvents"]
    slices = {(e["tid"], e["name"]) for e in trace if e["ph"] == "X"}
    assert {(0, "F1"), (0, "B1"), (1, "F2"), (5, "F0"), (5, "B0"), (3, "allreduce block 0")} <= slices
    assert not any(name == "F1" for tid, name in slices if tid == 3)  # pipeline 2 has one micro-batch
