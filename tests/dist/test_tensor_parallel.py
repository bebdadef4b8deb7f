"""Tensor parallelism of any degree per stage trains exactly like single-process PyTorch.

One forked 8-rank world runs, in float64 with the checks of ``exactness.py``:
- A (Llama-like, GQA 8 query / 4 KV heads): pipeline 0 = tp 2 then tp 1 (tp 2 next to tp 1 in one
  pipeline), pipeline 1 = one tp-4 stage, pipeline 2 = tp 1; so block 0 is held at tp 2, 4 and 1
  (its sharded gradients are summed over the common refinement: 4 slice patterns) and ragged
  micro-batches; clipping on;
- B -> A: 2 steps under B (tp 4 then tp 2 in one pipeline: activations fan in, gradients fan
  out; a tp-1 pipeline beside it), a checkpoint, then 2 more steps under A: must equal 4 steps of
  the reference (checkpoints hold global tensors, whatever the TP degree that wrote them);
- E -> A: 2 steps under E, where every holder of a layer is tensor-parallel (tp 2 + tp 4 in one pipeline, a
  tp-2 pipeline beside it), a checkpoint, then 2 more steps under A: the checkpoint holds each rank's slices
  at their offsets (no global tensor built), and A's stages of tp 1, 2 and 4 read them back by offset;
- C (GPT-like: learned positions, biases, LayerNorm, GELU): tp 1 -> tp 2 in one pipeline, a
  pipeline of two tp-2 stages, and a tp-1 pipeline.
- D (C with tied embeddings): tp 2 first stage and tp 4 last stage in one pipeline, two tp-1
  pipelines: the vocab-sharded matrix's copies are summed over the refinement of 4 holding stages;
- plans ``make_plan`` itself emits with tp > 1 (a 2-layer model on 4 H100 + 4 A100: one pipeline
  of two tp-4 stages at batch 1, two pipelines of tp-2 stages at batch 3), one step each.
The exported checkpoint (unsharded weights) loads into the single-process model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from ethpipe.cluster import cluster_from_dict
from ethpipe.model_spec import ModelSpec
from ethpipe.planner import PlannerOptions, make_plan
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.checkpoint.layout import resolve_checkpoint, step_dir_name
from ethpipe.runtime.checkpoint.weights import export_checkpoint
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.sync.layout import piece_runs, refinement, tied_stages
from ethpipe.runtime.train import TrainConfig, train

from .exactness import assert_matches_reference, assert_params_match
from .harness import run_ranks
from .plans import GPT_LIKE
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

LR = 1e-3
GQA = ModelSpec(name="test-gqa", num_layers=6, hidden_size=32, num_heads=8, num_kv_heads=4, ffn_hidden_size=64,
                vocab_size=256, max_seq_len=64)

StageDef = tuple[tuple[int, ...], tuple[int, int]]


def tp_plan(spec: ModelSpec, pipelines: list[tuple[list[StageDef], tuple[int, ...]]], seq_len: int = 16) -> Plan:
    pipes = tuple(Pipeline(tuple(Stage(ranks, "cpu", layers, len(ranks)) for ranks, layers in stages), sizes)
                  for stages, sizes in pipelines)
    return Plan("custom", spec.name, sum(p.num_samples for p in pipes), seq_len, pipes, compute_blocks(pipes),
                model_spec=spec)


PLAN_A = tp_plan(GQA, [([((0, 1), (0, 3)), ((2,), (3, 6))], (2, 1)),
                       ([((3, 4, 5, 6), (0, 6))], (3,)),
                       ([((7,), (0, 6))], (1, 1))])
PLAN_B = tp_plan(GQA, [([((0, 1, 2, 3), (0, 2)), ((4, 5), (2, 6))], (1, 2, 1)),
                       ([((6,), (0, 3)), ((7,), (3, 6))], (3, 1))])
PLAN_E = tp_plan(GQA, [([((0, 1), (0, 3)), ((2, 3, 4, 5), (3, 6))], (2, 2)),
                       ([((6, 7), (0, 6))], (2, 2))])
TIED = dataclasses.replace(GPT_LIKE, name="test-gpt-tied", tie_embeddings=True)
PLAN_D = tp_plan(TIED, [([((0, 1), (0, 3)), ((2, 3, 4, 5), (3, 6))], (1, 2)),
                        ([((6,), (0, 6))], (2,)),
                        ([((7,), (0, 6))], (1, 1))])
PLAN_C = tp_plan(GPT_LIKE, [([((0,), (0, 2)), ((1, 2), (2, 6))], (2, 1)),
                            ([((3, 4), (0, 4)), ((5, 6), (4, 6))], (1, 1)),
                            ([((7,), (0, 6))], (1,))])


TWO_LAYERS = dataclasses.replace(GQA, name="test-gqa-2", num_layers=2)
MIXED = cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 16}
                                     for g in ("h100_sxm", "a100_80gb_sxm")]})
PLANNED = {batch: make_plan(MIXED, TWO_LAYERS, batch, 16, dtype="fp32", max_tp=4,
                           options=PlannerOptions(allow_idle=False))  # every device: the spawn is 8 ranks
           for batch in (1, 3)}


def saved_chunks(root: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each key's pieces in the checkpoint ``root``: (offsets, sizes), sorted."""
    step_dir = resolve_checkpoint(root)
    entries = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
            for k, md in entries.items() if hasattr(md, "chunks")}


def _worker(rank: int, world_size: int, runs: list[tuple[str, Plan, TrainConfig]], out_dir: str) -> None:
    for name, plan, config in runs:
        records = train(plan, config, rank, world_size)
        if rank == 0:
            Path(out_dir, f"{name}.json").write_text(json.dumps(records))


def test_slice_patterns_of_the_plans() -> None:
    assert refinement(tied_stages(PLAN_D)) == (4, [(0, 1, (0, 2, 6, 7)), (1, 2, (0, 3, 6, 7)), (2, 3, (1, 4, 6, 7)),
                                                   (3, 4, (1, 5, 6, 7))])
    pieces, runs = piece_runs(PLAN_A, 0)
    assert pieces == 4
    assert [holders for _, _, holders in runs] == [(0, 3, 7), (0, 4, 7), (1, 5, 7), (1, 6, 7)]
    assert piece_runs(PLAN_B, 0) == (4, [(0, 1, (0, 6)), (1, 2, (1, 6)), (2, 3, (2, 6)), (3, 4, (3, 6))])
    assert piece_runs(PLAN_B, 1) == (2, [(0, 1, (4, 6)), (1, 2, (5, 6))])  # layers 2-3: tp 2 beside tp 1


def test_tensor_parallel_plans_match_single_process_adamw(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["heads", "split", "over", "ranks", "sum", "once", "."], size=4000))], data)
    common = dict(data=data, lr=LR, progress=False, timeout_s=60.0, dtype="fp64")
    ckpt = str(tmp_path / "ckpt")
    runs = [
        ("a", PLAN_A, TrainConfig(**common, steps=3, clip_grad=0.05, save_final=str(tmp_path / "a.safetensors"))),
        ("b", PLAN_B, TrainConfig(**common, steps=2, checkpoint_dir=ckpt, bucket_bytes=2048)),
        ("b-then-a", PLAN_A, TrainConfig(**common, steps=4, checkpoint_dir=ckpt, resume=True,
                                         save_final=str(tmp_path / "ba.safetensors"))),
        ("e", PLAN_E, TrainConfig(**common, steps=2, checkpoint_dir=str(tmp_path / "ckpt-e"))),
        ("e-then-a", PLAN_A, TrainConfig(**common, steps=4, checkpoint_dir=str(tmp_path / "ckpt-e"), resume=True,
                                         save_final=str(tmp_path / "ea.safetensors"))),
        ("c", PLAN_C, TrainConfig(**common, steps=2, save_final=str(tmp_path / "c.safetensors"))),
        ("d", PLAN_D, TrainConfig(**common, steps=2, clip_grad=0.05, save_final=str(tmp_path / "d.safetensors"))),
        *((f"planned-{b}", plan, TrainConfig(**common, steps=1, save_final=str(tmp_path / f"planned-{b}.safetensors")))
          for b, plan in PLANNED.items()),
    ]
    assert [sorted({s.tp for p in PLANNED[b].pipelines for s in p.stages}) for b in (1, 3)] == [[4], [2]]
    run_ranks(8, _worker, (runs, str(tmp_path)), tmp_path, deadline_s=240.0)
    records = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name, _, _ in runs}

    kwargs = dict(global_batch=8, seq_len=16, lr=LR, weight_decay=0.1, seed=0)
    ref_a = reference_train(GQA, data, steps=3, clip_grad=0.05, **kwargs)  # type: ignore[arg-type]
    assert max(ref_a.grad_norms) > 0.05, "clipping never engaged: the test proves nothing"
    assert_matches_reference("A", load_file(tmp_path / "a.safetensors"), records["a"], ref_a)

    ref_4 = reference_train(GQA, data, steps=4, clip_grad=0.0, **kwargs)  # type: ignore[arg-type]
    assert_matches_reference("B then A", load_file(tmp_path / "ba.safetensors"), records["b"] + records["b-then-a"],
                             ref_4)
    export_checkpoint(ckpt, tmp_path / "exported.safetensors")  # unsharded, global names
    assert_params_match("export", load_file(tmp_path / "exported.safetensors"), ref_4.state)

    assert_matches_reference("E then A", load_file(tmp_path / "ea.safetensors"), records["e"] + records["e-then-a"],
                             ref_4)
    chunks = saved_chunks(tmp_path / "ckpt-e" / step_dir_name(2))  # written by the smallest TP degree holding each key, by offset
    assert chunks["layers.0.attn.wq.weight"] == [((0, 0), (16, 32)), ((16, 0), (16, 32))]  # p0's tp-2 stage
    assert chunks["layers.4.mlp.w2.weight"] == [((0, 0), (32, 32)), ((0, 32), (32, 32))]  # p1's tp 2, not tp 4
    assert chunks["optim.exp_avg.tok_emb.weight"] == [((0, 0), (128, 32)), ((128, 0), (128, 32))]
    assert chunks["layers.4.attn_norm.weight"] == [((0,), (32,))]  # replicated: one whole piece

    ref_c = reference_train(GPT_LIKE, data, steps=2, clip_grad=0.0, **{**kwargs, "global_batch": 6})  # type: ignore
    assert_matches_reference("C", load_file(tmp_path / "c.safetensors"), records["c"], ref_c)

    ref_d = reference_train(TIED, data, steps=2, clip_grad=0.05,  # type: ignore[arg-type]
                            **{**kwargs, "global_batch": PLAN_D.global_batch_size})
    assert_matches_reference("D", load_file(tmp_path / "d.safetensors"), records["d"], ref_d)

    for batch in PLANNED:
        ref = reference_train(TWO_LAYERS, data, steps=1, clip_grad=0.0, **{**kwargs, "global_batch": batch})  # type: ignore
        assert_matches_reference(f"planned batch {batch}", load_file(tmp_path / f"planned-{batch}.safetensors"),
                                 records[f"planned-{batch}"], ref)
