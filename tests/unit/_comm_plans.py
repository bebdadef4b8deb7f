"""Plans and per-rank step programs for the NCCL-semantics replay tests (unit and multi-rank).

The block sync's posts come from the runtime's own ``sync.grads.stage_sync_units`` on a stage built on
the meta device, so the replay sees exactly the all-reduces ``ethpipe train`` issues.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ethpipe.comm.program import communicators, step_program
from ethpipe.comm.replay import Op, Outcome, Post, Program, Wait, replay
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.comm.program import DEFAULT_BUCKET_BYTES
from ethpipe.runtime.sync.buckets import GradBuckets
from ethpipe.runtime.sync.grads import stage_sync_units
from ethpipe.runtime.model.decoder import Decoder, state_dict_shapes
from ethpipe.runtime.model.tensor_parallel import TPGroup
from ethpipe.runtime.sync.zero import ShardedBuckets
from ethpipe.schedule import one_f_one_b

SPEC = ModelSpec(name="replay", num_layers=16, hidden_size=64, num_heads=8, num_kv_heads=4, ffn_hidden_size=128,
                 vocab_size=256, max_seq_len=64)

StageDef = tuple[tuple[int, int] | tuple[tuple[int, int], ...], int]  # (layers, or chunks' ranges; tp)


def make_plan(pipelines: Sequence[tuple[Sequence[StageDef], Sequence[int]]], spec: ModelSpec = SPEC,
              schedule: str = "1f1b", recompute: frozenset[int] = frozenset()) -> Plan:
    """Ranks numbered stage by stage, pipeline by pipeline; every pipeline runs ``schedule``; stages whose
    first rank is in ``recompute`` recompute (so never split their backward)."""
    pipes, rank = [], 0
    for stages, sizes in pipelines:
        built = []
        for layers, tp in stages:
            chunks = layers if isinstance(layers[0], tuple) else ()
            built.append(Stage(tuple(range(rank, rank + tp)), "cpu", chunks[0] if chunks else layers, tp,  # type: ignore[arg-type]
                               rank in recompute, chunks))  # type: ignore[arg-type]
            rank += tp
        pipes.append(Pipeline(tuple(built), tuple(sizes), "interleaved" if built[0].chunks else schedule))
    return Plan("custom", spec.name, sum(sum(s) for _, s in pipelines), 16, tuple(pipes), compute_blocks(pipes),
                model_spec=spec)


def even_pipeline(depth: int, sizes: Sequence[int], tps: Sequence[int] | None = None,
                  num_layers: int = 16) -> tuple[list[StageDef], list[int]]:
    tps = tps or [1] * depth
    return [((s * num_layers // depth, (s + 1) * num_layers // depth), tps[s]) for s in range(depth)], list(sizes)


def interleaved_pipeline(depth: int, sizes: Sequence[int], num_chunks: int = 2, tps: Sequence[int] | None = None,
                         num_layers: int = 16) -> tuple[list[StageDef], list[int]]:
    """Layers cut evenly into ``depth * num_chunks`` virtual stages; virtual stage ``c * depth + s`` is stage s's
    chunk c."""
    tps = tps or [1] * depth
    v = depth * num_chunks
    cut = [k * num_layers // v for k in range(v + 1)]
    return [(tuple((cut[c * depth + s], cut[c * depth + s + 1]) for c in range(num_chunks)), tps[s])
            for s in range(depth)], list(sizes)


def stage_buckets(plan: Plan, rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                  sharded: bool = False) -> GradBuckets | None:
    """``rank``'s sync buckets as the runtime builds them, on a meta-device stage (None: nothing to sync)."""
    spec = plan.resolve_model()
    if len(plan.pipelines) == 1 and not spec.tie_embeddings:
        return None  # one holder per block (building the meta stages is the slow part of these tests)
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    with torch.device("meta"):
        module = Decoder(spec, stage.layers, pos.stage == 0, pos.stage == pipe.depth - 1,
                         tp=TPGroup(None, pos.tp_rank, stage.tp), chunks=stage.chunks, sublayers=stage.sublayers)
    _, units = stage_sync_units(plan, rank, module, state_dict_shapes(spec), spec.tie_embeddings)
    params = dict(module.named_parameters())
    buckets = (ShardedBuckets(params, units, {}, rank, {}, bucket_bytes) if sharded
               else GradBuckets(params, units, {}, bucket_bytes))
    buckets.remove_hooks()
    return buckets


def sync_posts(plan: Plan, rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[str, tuple[int, ...]]]:
    """The block sync's all-reduces of ``rank`` in the runtime's issue order (``GradBuckets.posts``: those
    with more than one holder; the runtime skips the rest)."""
    buckets = stage_buckets(plan, rank, bucket_bytes)
    return buckets.posts() if buckets is not None else []


def replay_plan(plan: Plan, *, streams: str = "group", lazy_init: bool = False, warmup: bool = False,
                overlap_sync: bool = True, sharded: bool = False) -> Outcome:
    """``sharded``: the ZeRO-1 runtime's reduces (per shard) and its broadcasts of the updated shards."""
    buckets = {r: stage_buckets(plan, r, sharded=sharded) for r in range(plan.world_size)}
    posts = {r: b.posts() if b is not None else [] for r, b in buckets.items()}
    gathers = {r: b.gather_posts() if isinstance(b, ShardedBuckets) else [] for r, b in buckets.items()}
    programs = {r: step_program(plan, r, posts[r], warmup=warmup, overlap_sync=overlap_sync, gather_posts=gathers[r])
                for r in range(plan.world_size)}
    return replay(programs, communicators(plan, posts.__getitem__), streams=streams,  # type: ignore[arg-type]
                  lazy_init=lazy_init)


def old_executor_program(plan: Plan, rank: int) -> Program:
    """The executor before the p2p rework, as NCCL ran it: a blocking ``recv`` before each action and an
    ``isend`` after it, waited at the end of the step; single p2p ops run on the pair's communicator."""
    from ethpipe.comm.program import plan_peers

    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    peers = plan_peers(plan, rank)
    items: list[Post | Wait] = []
    sends: list[int] = []

    def post(kind: str, peer: int, tag: str, wait: bool) -> None:
        handle = len(items)
        items.append(Post(handle, f"pair {min(rank, peer)},{max(rank, peer)}", (Op(kind, peer, tag),)))  # type: ignore[arg-type]
        items.append(Wait(handle)) if wait else sends.append(handle)

    for action in one_f_one_b(pipe.depth, pos.stage, pipe.num_microbatches):
        forward = action.kind == "F"
        src, dsts = (peers.act_from, peers.act_to) if forward else (peers.grad_from, peers.grad_to)
        tag = f"{'act' if forward else 'grad'} {action.microbatch}"
        if src is not None:
            post("recv", src, tag, wait=True)
        for dst in dsts:
            post("send", dst, tag, wait=False)
    items.extend(Wait(h) for h in sends)
    return items


def pair_groups(world_size: int) -> dict[str, tuple[int, ...]]:
    return {f"pair {a},{b}": (a, b) for a in range(world_size) for b in range(a + 1, world_size)}
