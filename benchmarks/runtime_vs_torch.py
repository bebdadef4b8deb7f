"""ethpipe's runtime against torch.distributed.pipelining on the same homogeneous plan, in one run (CPU, gloo).

Two comparisons, every rank running both sides alternately so that load drift hits them alike:

1. **1F1B, forward and backward only**: one pipeline of 4 stages, ethpipe's executor (``run_stage_step``)
   vs ``Schedule1F1B`` on the same stage modules and micro-batches.
2. **Whole training steps**: 2 pipelines x 2 stages. ethpipe: ``ethpipe.runtime.train.train`` (its 1F1B, the
   block gradient sync from backward hooks, the stats all-gather, clipping, AdamW). torch:
   ``Schedule1F1B`` on each pipeline with each stage module wrapped in ``DistributedDataParallel`` over the
   stage's two replicas (its gradient buckets reduce during the last micro-batch's backward), one loss
   all-reduce for logging, and the same AdamW. Same model, init, micro-batches and optimizer settings.

Also measured here: ethpipe's gradient-sync exposed time (the wait after the last backward) with the
backward-hook sync and with ``--no-overlap-grad-sync``, and for a few bucket sizes (the default's evidence).

    .venv/bin/python benchmarks/runtime_vs_torch.py   (runtime_cpu.py runs it and renders the tables)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.optim  # noqa: F401  (imported before the workers fork)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel

from ethpipe.comm.program import Peers
from ethpipe.model_spec import ModelSpec
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.config import TrainConfig, make_optimizer
from ethpipe.runtime.data import gather_samples, open_tokens
from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.runtime.pipeline.executor import StageIO, run_stage_step
from ethpipe.runtime.start.launch import die_with_parent
from ethpipe.runtime.model.decoder import build_stage
from ethpipe.runtime.observe.timeline import Timeline
from ethpipe.runtime.train import train
from ethpipe.schedule import one_f_one_b

MODEL, SEQ_LEN, MICRO_BATCH = "tiny", 128, 2
# Wider than tiny, so that a stage's gradients (25 MB) make the sync visible next to its compute.
SYNC_MODEL = ModelSpec(name="sync-bench", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=704, vocab_size=256, max_seq_len=SEQ_LEN)
WARMUP = 2


def _two_by_two(spec: ModelSpec, num_mb: int) -> Plan:
    half = spec.num_layers // 2
    pipes = tuple(Pipeline((Stage((2 * p,), "cpu", (0, half)), Stage((2 * p + 1,), "cpu", (half, spec.num_layers))),
                           (MICRO_BATCH,) * num_mb) for p in range(2))
    return Plan("uniform", spec.name, 2 * num_mb * MICRO_BATCH, SEQ_LEN, pipes, compute_blocks(pipes), model_spec=spec)


def _fb_only(rank: int, group: dist.ProcessGroup, num_mb: int, iters: int) -> dict[str, float]:
    """Comparison 1 on ranks 0-3 (one pipeline)."""
    spec, world = load_model_spec(MODEL), 4
    per = spec.num_layers // world
    first, last = rank == 0, rank == world - 1
    module = build_stage(spec, (rank * per, (rank + 1) * per), first, last)
    tokens = torch.randint(0, spec.vocab_size, (num_mb * MICRO_BATCH, SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    peers = Peers(rank - 1 if not first else None, () if last else (rank + 1,), rank + 1 if not last else None,
                  () if first else (rank - 1,))
    io = StageIO(group, peers, first, last, spec.hidden_size, SEQ_LEN)
    actions = one_f_one_b(world, rank, num_mb)

    def ours() -> None:
        run_stage_step(module, actions, (MICRO_BATCH,) * num_mb, list(inputs.split(MICRO_BATCH)) if first else None,
                       list(targets.split(MICRO_BATCH)) if last else None, io, 1.0, None, 0, Timeline())

    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, num_mb, loss_fn=_loss_sum, scale_grads=False)

    def theirs() -> None:
        _torch_step(schedule, first, last, inputs, targets)

    return _alternate({"ours": ours, "torch": theirs}, iters, group, lambda: module.zero_grad(set_to_none=True))


def _loss_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")


def _torch_step(schedule: Schedule1F1B, first: bool, last: bool, inputs: torch.Tensor,
                targets: torch.Tensor) -> None:
    if first:
        schedule.step(inputs)
    elif last:
        schedule.step(target=targets)
    else:
        schedule.step()


def _alternate(fns: dict[str, Any], iters: int, group: dist.ProcessGroup | None, reset: Any) -> dict[str, float]:
    """Median seconds of each function, called alternately (the first WARMUP of each left out)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for it in range(len(fns) * (iters + WARMUP)):
        name = list(fns)[it % len(fns)]
        dist.barrier(group=group)
        start = time.perf_counter()
        fns[name]()
        dist.barrier(group=group)
        times[name].append(time.perf_counter() - start)
        reset()
    return {name: statistics.median(v[WARMUP:]) for name, v in times.items()}


def _torch_training(rank: int, spec: ModelSpec, plan: Plan, steps: int, data_tokens: torch.Tensor,
                    lr: float) -> list[float]:
    """Comparison 2's torch side: Schedule1F1B + DDP per stage, AdamW, a loss all-reduce per step."""
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage_def = pipe.stages[pos.stage]
    first, last = pos.stage == 0, pos.stage == pipe.depth - 1
    timeout = timedelta(seconds=120)
    pipe_groups = [dist.new_group(list(p.ranks), timeout=timeout) for p in plan.pipelines]
    dp_groups = [dist.new_group([p.stages[s].ranks[0] for p in plan.pipelines], timeout=timeout) for s in range(2)]
    module = build_stage(spec, stage_def.layers, first, last)
    ddp = DistributedDataParallel(module, process_group=dp_groups[pos.stage])
    optimizer = make_optimizer(module, TrainConfig(data="", steps=1, lr=lr))
    stage = PipelineStage(ddp, pos.stage, pipe.depth, torch.device("cpu"), group=pipe_groups[pos.pipeline])
    schedule = Schedule1F1B(stage, pipe.num_microbatches, loss_fn=_loss_sum, scale_grads=False)
    per_pipe = pipe.num_samples
    times = []
    for step in range(steps):
        start = time.perf_counter()
        lo = step * plan.global_batch_size + pos.pipeline * per_pipe
        batch = data_tokens[lo:lo + per_pipe]
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(batch[:, :-1].contiguous())
        elif last:
            schedule.step(target=batch[:, 1:].contiguous(), losses=losses)
        else:
            schedule.step()
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
        dist.all_reduce(loss)  # the step's logged loss: one world collective, as ethpipe's stats
        float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    for g in pipe_groups + dp_groups:
        dist.destroy_process_group(g)
    return times


def _worker(rank: int, world: int, store: str, data: str, rounds: int, steps: int, out: str) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    group = dist.new_group(list(range(4)), timeout=timedelta(seconds=120))
    result: dict[str, Any] = {"fb_only": _fb_only(rank, group, 8, 15)}
    spec = load_model_spec(MODEL)
    plan = _two_by_two(spec, 8)
    tokens = torch.from_numpy(gather_samples(open_tokens(data, spec.vocab_size),
                                             np.arange(steps * plan.global_batch_size), SEQ_LEN))
    full: dict[str, list[float]] = {"ethpipe": [], "torch": []}
    for r in range(rounds):
        for side in (("ethpipe", "torch") if r % 2 == 0 else ("torch", "ethpipe")):
            if side == "ethpipe":
                records = train(plan, TrainConfig(data=data, steps=steps, lr=1e-3, progress=False, dtype="fp32",
                                                  timeout_s=120.0), rank, world)
                step_s = [rec["iteration_time_s"] for rec in records]
            else:
                step_s = _torch_training(rank, spec, plan, steps, tokens, 1e-3)
            full[side].append(statistics.median(step_s[WARMUP:]) if step_s else 0.0)
    result["full_step"] = full
    sync_plan = _two_by_two(SYNC_MODEL, 4)
    exposed: dict[str, list[float]] = {}
    variants = {"hooks, 25 MiB buckets": dict(), "hooks, 1 MiB buckets": dict(bucket_bytes=2**20),
                "hooks, one bucket per block": dict(bucket_bytes=0),
                "after the last backward (--no-overlap-grad-sync)": dict(overlap_grad_sync=False)}
    for r in range(rounds):
        for name, kwargs in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            records = train(sync_plan, TrainConfig(data=data, steps=steps, lr=1e-3, progress=False, dtype="fp32",
                                                   timeout_s=120.0, **kwargs), rank, world)
            if rank == 0:
                exposed.setdefault(name, []).append(statistics.median(
                    [rec["grad_sync_exposed_s"] for rec in records[WARMUP:]]))
                exposed.setdefault(name + " step", []).append(statistics.median(
                    [rec["iteration_time_s"] for rec in records[WARMUP:]]))
    result["sync"] = exposed
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group(group)
    dist.destroy_process_group()


def measure(rounds: int = 3, steps: int = 8) -> dict[str, Any]:
    """Run both comparisons on 4 local ranks; medians over rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/tokens.bin"
        prepare_tokens(builtin_text(2_000_000), data)
        out = f"{tmp}/result.json"
        mp.start_processes(_worker, args=(4, f"{tmp}/store", data, rounds, steps, out), nprocs=4,
                           start_method="fork")
        raw = json.loads(Path(out).read_text())
    fb = raw["fb_only"]
    full = {k: statistics.median(v) for k, v in raw["full_step"].items()}
    sync = {k: statistics.median(v) for k, v in raw["sync"].items()}
    return {"fb_only": {"stages": 4, "microbatches": 8, "micro_batch_size": MICRO_BATCH, **fb,
                        "ratio_ours_over_torch": fb["ours"] / fb["torch"]},
            "full_step": {"pipelines": 2, "stages": 2, "microbatches": 8, "micro_batch_size": MICRO_BATCH,
                          "rounds_s": raw["full_step"], **full, "ratio_ethpipe_over_torch": full["ethpipe"] / full["torch"]},
            "sync": {"model": SYNC_MODEL.name, "hidden_size": SYNC_MODEL.hidden_size,
                     "num_layers": SYNC_MODEL.num_layers, "microbatches": 4, "rounds": raw["sync"], "medians": sync},
            "rounds": rounds, "steps": steps}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
    sys.exit(0)
