"""The executor's p2p on real ranks: what it keeps alive, and that it posts exactly the replayed order.

One spawn of six gloo ranks does three things:

1. **Liveness** (ranks 0-3, one pipeline of 4 stages x 8 micro-batches): every boundary tensor the
   executor sends or receives is tracked by a weak reference to its storage. At every action, no sent
   payload is alive (each send was waited before the action and dropped), at most one received
   gradient is (the one the backward about to run needs), the stashed inputs stay within 1F1B's
   ``depth - stage``, and the largest batch holds exactly the memory model's ``P2P_BUFFERS`` boundary
   tensors. The same run with the sent payloads kept until the step ends (the old executor's ``sends``
   list) breaks the bound: the check can fail.
2. **Order** (all ranks): ``ethpipe train`` on a plan with TP fan-out and fan-in, two pipelines of
   different cuts, ragged micro-batches and tied embeddings records every torch.distributed call; each
   rank's batched p2p and block all-reduces equal, step by step, the program that
   ``tests/unit/test_comm_replay.py`` proves deadlock-free under NCCL's semantics.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ethpipe.cluster import cluster_from_dict
from ethpipe.comm.program import p2p_batches, pipeline_group, plan_peers, step_program, sync_group
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import block_sync_shapes
from ethpipe.comm.replay import Post
from ethpipe.cost import memory
from ethpipe.runtime.pipeline import executor as executor_module
import ethpipe.runtime.step as step_module
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.pipeline.executor import StageIO, run_stage_step
from ethpipe.runtime.observe.timeline import Timeline
from ethpipe.runtime.model.decoder import build_stage
from ethpipe.runtime.pipeline.p2p import LivenessProbe
from ethpipe.runtime.train import TrainConfig, train
from ethpipe.schedule import one_f_one_b

from .comm_log import CommLog, HostReads, recording
from .harness import run_ranks
from .plans import LLAMA_LIKE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from _comm_plans import even_pipeline, interleaved_pipeline, make_plan, sync_posts  # noqa: E402  (the replay tests' plans)

pytestmark = pytest.mark.dist

SPEC = dataclasses.replace(LLAMA_LIKE, name="p2p-llama", num_layers=8, num_kv_heads=4, tie_embeddings=True)
UNTIED = dataclasses.replace(SPEC, name="p2p-llama-untied", tie_embeddings=False)
DEPTH, NUM_MB, MB, SEQ = 4, 8, 2, 16
STEPS = 2


def _order_plan():  # type: ignore[no-untyped-def]
    """Pipeline 0 runs zb-h1 (its W passes post nothing; the batch before a W is not waited there), pipeline 1 1F1B."""
    plan = make_plan([([((0, 3), 1), ((3, 5), 2), ((5, 8), 1)], [2, 1, 2, 1]),  # tp 1 -> 2 -> 1
                      ([((0, 5), 1), ((5, 8), 1)], [3, 1, 2])], spec=SPEC)
    zb = dataclasses.replace(plan.pipelines[0], schedule="zb-h1")
    return dataclasses.replace(plan, pipelines=(zb, plan.pipelines[1]))


def _interleaved_plan():  # type: ignore[no-untyped-def]
    """Two interleaved rings: 3 stages (tp 1 -> 2 -> 1) x 2 chunks, and 2 stages, where one pair of ranks
    carries activations one way and gradients the other in the same batches."""
    return make_plan([interleaved_pipeline(3, [2, 1, 2, 1, 1, 2], tps=[1, 2, 1], num_layers=8),
                      interleaved_pipeline(2, [1, 2, 1, 2], num_layers=8)], spec=SPEC)


def _liveness(rank: int, group: dist.ProcessGroup, leaky: bool) -> dict:
    plan = make_plan([even_pipeline(DEPTH, [MB] * NUM_MB, num_layers=SPEC.num_layers)], spec=SPEC)
    stage = plan.pipelines[0].stages[rank]
    first, last = rank == 0, rank == DEPTH - 1
    module = build_stage(SPEC, stage.layers, first, last, seed=0)
    gen = torch.Generator().manual_seed(rank)
    tokens = [torch.randint(0, SPEC.vocab_size, (MB, SEQ), generator=gen) for _ in range(NUM_MB)]
    io = StageIO(group, plan_peers(plan, rank), first, last, SPEC.hidden_size, SEQ)
    probe = LivenessProbe()
    kept: list[torch.Tensor] = []
    original = executor_module.post_batch

    def keep_payloads(batch, outgoing, *args, **kwargs):  # type: ignore[no-untyped-def]
        kept.extend(outgoing.values())  # the old executor's `sends` list: every payload until the step ends
        return original(batch, outgoing, *args, **kwargs)

    if leaky:
        executor_module.post_batch = keep_payloads  # type: ignore[assignment]
    try:
        run_stage_step(module, one_f_one_b(DEPTH, rank, NUM_MB), (MB,) * NUM_MB, tokens if first else None,
                       tokens if last else None, io, 1.0 / (MB * NUM_MB * SEQ), None, 0, Timeline(), probe=probe)
    finally:
        executor_module.post_batch = original  # type: ignore[assignment]
    return {"samples": probe.samples, "peak_batch_bytes": probe.peak_batch_bytes}


def _traffic_plan():  # type: ignore[no-untyped-def]
    """An untied model, a tp-2 middle stage, two pipelines of different cuts, ragged micro-batches."""
    return make_plan([([((0, 3), 1), ((3, 5), 2), ((5, 8), 1)], [2, 1, 2, 1]),
                      ([((0, 5), 1), ((5, 8), 1)], [3, 1, 2])], spec=UNTIED)


def _bf16_run(rank: int, world_size: int, tmp_path: Path, data: str) -> None:
    """Train the traffic plan in bf16, recording every call and counting host reads per step."""
    log, reads = CommLog(), HostReads()
    windows: list[int] = []
    real_gather = step_module.gather_stats

    def gather(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real_gather(*args, **kwargs)
        windows.append(reads.count)  # a window: from the end of one step's stats to the end of the next's
        return out

    step_module.gather_stats = gather  # type: ignore[assignment]
    config = TrainConfig(data=data, steps=STEPS + 1, lr=1e-3, progress=False, timeout_s=60.0, dtype="bf16",
                         clip_grad=1.0)
    try:
        with recording(log), reads:
            train(_traffic_plan(), config, rank, world_size)
    finally:
        step_module.gather_stats = real_gather  # type: ignore[assignment]
    steps = [[dataclasses.asdict(c) for c in calls] for calls in log.steps()]
    per_step_reads = [b - a for a, b in zip(windows, windows[1:])]
    (tmp_path / f"bf16-{rank}.json").write_text(json.dumps({"steps": steps, "reads": per_step_reads}))


def _ranks(rank: int, world_size: int, tmp: str, data: str) -> None:
    tmp_path = Path(tmp)
    group = dist.new_group(ranks=list(range(DEPTH)), timeout=timedelta(seconds=60))
    if rank < DEPTH:
        out = {"tight": _liveness(rank, group, leaky=False), "leaky": _liveness(rank, group, leaky=True)}
        (tmp_path / f"live-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group(group)
    config = TrainConfig(data=data, steps=STEPS, lr=1e-3, progress=False, timeout_s=60.0)
    for name, plan in (("order", _order_plan()), ("interleaved", _interleaved_plan())):
        log = CommLog()
        with recording(log):
            train(plan, config, rank, world_size)
        steps = [[dataclasses.asdict(c) for c in calls] for calls in log.steps()]
        (tmp_path / f"calls-{name}-{rank}.json").write_text(json.dumps(steps))
    _bf16_run(rank, world_size, tmp_path, data)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("p2p")
    data = tmp / "tokens.bin"
    prepare_tokens([" ".join(["pipeline", "stage", "gradient", "tensor"] * 500)], data)
    run_ranks(6, _ranks, (str(tmp), str(data)), tmp)
    return tmp


def test_liveness_stays_within_the_1f1b_bound_and_the_memory_model(ran: Path) -> None:
    boundary = memory.boundary_bytes(SPEC, SEQ, 4) * MB
    for rank in range(DEPTH):
        tight = json.loads((ran / f"live-{rank}.json").read_text())["tight"]
        samples = tight["samples"]
        assert len(samples) == 2 * NUM_MB
        for action, sent, received, _num_bytes, stashed in samples:
            assert sent == 0, (rank, action, "a sent payload outlived its batch")
            assert received == (1 if action.startswith("B") and rank < DEPTH - 1 else 0), (rank, action)
            assert stashed <= DEPTH - rank, (rank, action, stashed)
        assert max(s[4] for s in samples) == DEPTH - rank  # 1F1B's in-flight count is reached
        assert tight["peak_batch_bytes"] == memory.P2P_BUFFERS * boundary  # what the memory model counts


def test_keeping_payloads_until_the_step_ends_breaks_the_bound(ran: Path) -> None:
    for rank in range(DEPTH):
        leaky = json.loads((ran / f"live-{rank}.json").read_text())["leaky"]["samples"]
        assert max(s[1] for s in leaky) >= NUM_MB - 1, rank  # at its last action a stage has sent all but one


@pytest.mark.parametrize("name", ["order", "interleaved"])
def test_the_runtime_posts_exactly_the_replayed_program(ran: Path, name: str) -> None:
    plan = {"order": _order_plan, "interleaved": _interleaved_plan}[name]()
    for rank in range(plan.world_size):
        steps = json.loads((ran / f"calls-{name}-{rank}.json").read_text())
        assert len(steps) == STEPS + 1  # the set-up (the plan check's all-gather) + one list per step
        pos = plan.position_of(rank)
        program = step_program(plan, rank, sync_posts(plan, rank))
        want_p2p = [[(op.kind, op.peer) for op in item.ops] for item in program
                    if isinstance(item, Post) and item.group == pipeline_group(pos.pipeline)]
        want_sync = [item.group for item in program if isinstance(item, Post) and item.group.startswith("sync ")]
        stage_ranks = plan.pipelines[pos.pipeline].stages[pos.stage].ranks
        for calls in steps[1:]:
            got_p2p = [[(k, peer) for k, peer, _, _ in c["ops"]] for c in calls if c["fn"] == "batch"]
            assert got_p2p == want_p2p, rank
            for c in calls:
                for _, _, numel, dtype in c["ops"] if c["fn"] == "batch" else []:
                    assert numel % (SEQ * SPEC.hidden_size) == 0 and dtype == "torch.float32"
            others = (stage_ranks, plan.pipelines[pos.pipeline].ranks)  # TP collectives; the pipeline's warm-up
            got_sync = [sync_group(tuple(c["group"])) for c in calls if c["fn"] == "all_reduce"
                        and tuple(c["group"]) not in others and len(c["group"]) > 1]
            assert got_sync == want_sync, rank


def _bf16(ran: Path, rank: int) -> dict:
    return json.loads((ran / f"bf16-{rank}.json").read_text())


def test_one_host_read_per_training_step(ran: Path) -> None:
    for rank in range(6):
        assert _bf16(ran, rank)["reads"] == [1] * STEPS, rank  # the stats all-gather's one .tolist()


def test_tp_traffic_is_megatrons_and_boundaries_are_16_bit_under_bf16(ran: Path) -> None:
    """The tp-2 stage (two layers, no embedding or head) all-reduces 4 x b*s*h bf16 elements per layer per
    micro-batch: 2 forward (after attention and the MLP), 2 backward (at their inputs); nothing else on its group."""
    plan = _traffic_plan()
    stage = plan.pipelines[0].stages[1]
    sizes = plan.pipelines[0].micro_batch_sizes
    for rank in stage.ranks:
        for calls in _bf16(ran, rank)["steps"][1:]:
            tp_calls = [c for c in calls if c["fn"] == "all_reduce" and tuple(c["group"]) == stage.ranks]
            assert {c["dtype"] for c in tp_calls} == {"torch.bfloat16"}
            per_layer_mb = sum(c["numel"] for c in tp_calls) / (stage.num_layers * sum(sizes))
            assert per_layer_mb == 4 * SEQ * UNTIED.hidden_size
            assert len(tp_calls) == 4 * stage.num_layers * len(sizes)
    for rank in range(plan.world_size):
        for calls in _bf16(ran, rank)["steps"][1:]:
            assert {dtype for c in calls if c["fn"] == "batch" for *_, dtype in c["ops"]} == {"torch.bfloat16"}


def test_counted_traffic_equals_what_the_cost_model_prices(ran: Path) -> None:
    """Per step: every p2p message is ``CostModel.boundary_bytes`` of its micro-batch, every TP stage moves
    ``tp_message_bytes`` per layer pass (embedding and head terms included), and each block's all-reduce moves,
    on its busiest holder, the bytes ``block_sync_shapes`` prices (fp32 gradients)."""
    plan = _traffic_plan()
    cluster = cluster_from_dict({"nodes": [{"gpu": {"id": "cpu", "memory_gib": 1, "peak_tflops": 1}, "num_nodes": 1,
                                            "gpus_per_node": plan.world_size, "nic_gbit_s": 10}]})
    cost = CostModel(cluster, UNTIED, SEQ, dtype_bytes=2, dtype="bf16")
    priced_sync = [s.num_bytes if s else 0.0 for s in
                   block_sync_shapes(plan, cluster, lambda b, f, la: cost.block_grad_bytes(b, first=f, last=la))]
    moved: dict[str, float] = {}
    for rank in range(plan.world_size):
        pos = plan.position_of(rank)
        pipe = plan.pipelines[pos.pipeline]
        stage = pipe.stages[pos.stage]
        first, last = pos.stage == 0, pos.stage == pipe.depth - 1
        labels = [label for label, _ in sync_posts(plan, rank)]
        for calls in _bf16(ran, rank)["steps"][1:]:
            p2p = [numel * 2 for c in calls if c["fn"] == "batch" for _, _, numel, _ in c["ops"]]
            ops = [o for batch in p2p_batches(one_f_one_b(pipe.depth, pos.stage, pipe.num_microbatches),
                                              plan_peers(plan, rank)) for o in batch]
            assert p2p == [cost.boundary_bytes(pipe.micro_batch_sizes[o.microbatch]) for o in ops]
            tp_bytes = sum(c["numel"] * 2 if c["dtype"] == "torch.bfloat16" else c["numel"] * 4 for c in calls
                           if c["fn"] == "all_reduce" and tuple(c["group"]) == stage.ranks)
            kinds = [("block", stage.num_layers)] + [("embedding", 1)] * first + [("head", 1)] * last
            want = sum(n * sum(cost.tp_message_bytes(kind, b, bwd)) for b in pipe.micro_batch_sizes
                       for kind, n in kinds for bwd in (False, True)) if stage.tp > 1 else 0
            assert tp_bytes == want, rank
            sync = [c for c in calls if c["fn"] == "all_reduce" and tuple(c["group"]) not in
                    (stage.ranks, pipe.ranks) and len(c["group"]) > 1]
            assert [c["dtype"] for c in sync] == ["torch.float32"] * len(labels)
            per_block: dict[str, float] = {}
            for label, c in zip(labels, sync):
                per_block[label] = per_block.get(label, 0.0) + c["numel"] * 4
            for label, num_bytes in per_block.items():
                moved[label] = max(moved.get(label, 0.0), num_bytes)
    assert moved == {f"block {k}": priced for k, priced in enumerate(priced_sync)}
