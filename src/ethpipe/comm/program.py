"""What each rank communicates in one training step, in order, derived from the schedule and the plan.

**Point-to-point (Megatron's and torch.distributed.pipelining's rule).** The sends an action produces
and the receives the next action needs are posted together as ONE ``batch_isend_irecv`` on the
pipeline's group, and waited before that next action runs (``p2p_batches``). So a 1F1B stage posts
``send a_i + recv g_j`` in one batch where the old executor posted ``send a_i`` and then blocked in
``recv g_j``: under NCCL, whose large sends complete only when the peer's receive runs, the old order
waits in a cycle (each send queued behind a receive the peer posts after its own send). Every send
is waited before the next action, so a rank has at most one send outstanding per peer and direction,
and no payload outlives the action after it.

**Peers across TP degrees** (``plan_peers``): activations are replicated over a TP group; receiving
rank k of a stage takes its input from rank ``k % a`` of the previous stage (degree a), and sending
rank j takes its output gradient from rank ``j % b`` of the next (degree b). So every rank receives
each tensor exactly once, and a rank sends to every rank that takes from it.

**The whole step** (``step_program``) adds the collectives around the p2p batches, as the runtime
issues them: one TP collective per action on a tp > 1 stage (all TP ranks run the same code, so its
all-reduces keep the TP ranks in step), the block gradient sync's all-reduces (asynchronous, in the
one global bucket order of ``runtime.grad_buckets``), fired by backward hooks during the stage's last
backward and so posted before that backward's sends, waited at the end, and the per-step stats
all-gather over the world. ``ethpipe.comm.replay`` proves such programs
deadlock-free. Before the first step every rank runs one collective on its pipeline group: where
NCCL creates communicators lazily, the first batched p2p would otherwise need every rank of the
group at once, and a TP rank without sends in its warm-up reaches it only after waiting on its peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ethpipe.comm.replay import Item, Op, Post, Wait
from ethpipe.plan import Plan
from ethpipe.schedule import Action, actions_of, last_weight_grad_index

Payload = Literal["act", "grad"]
WORLD = "world"
# The gradient sync's default bucket size (runtime/grad_buckets.py; measured: docs/runtime.md, "Gradient sync").
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class P2pOp:
    """Send or receive one boundary tensor: micro-batch ``microbatch``'s activation or its gradient."""

    kind: Literal["send", "recv"]
    peer: int  # global rank
    payload: Payload
    microbatch: int

    @property
    def tag(self) -> str:
        return f"{self.payload} {self.microbatch}"


@dataclass(frozen=True)
class Peers:
    """Where one rank's boundary tensors come from and go to (global ranks; None / (): no such neighbour)."""

    act_from: int | None = None  # previous-stage rank whose output is this rank's input
    act_to: tuple[int, ...] = ()  # next-stage ranks that take this rank's output
    grad_from: int | None = None  # next-stage rank that sends this rank the gradient of its output
    grad_to: tuple[int, ...] = ()  # previous-stage ranks that take this rank's input gradient


def plan_peers(plan: Plan, rank: int) -> Peers:
    """This rank's neighbours under the TP fan-in/fan-out rule (module docstring)."""
    pos = plan.position_of(rank)
    stages = plan.pipelines[pos.pipeline].stages
    i, tp = pos.tp_rank, len(stages[pos.stage].ranks)
    prev = stages[pos.stage - 1].ranks if pos.stage > 0 else ()
    nxt = stages[pos.stage + 1].ranks if pos.stage + 1 < len(stages) else ()
    return Peers(
        act_from=prev[i % len(prev)] if prev else None,
        act_to=tuple(r for k, r in enumerate(nxt) if k % tp == i),
        grad_from=nxt[i % len(nxt)] if nxt else None,
        grad_to=tuple(r for j, r in enumerate(prev) if j % tp == i),
    )


def action_recvs(action: Action, peers: Peers) -> tuple[P2pOp, ...]:
    """What ``action`` needs before it runs: its input activation (F) or its output's gradient (B); W: none."""
    if action.kind == "W":
        return ()
    src = peers.act_from if action.kind == "F" else peers.grad_from
    payload: Payload = "act" if action.kind == "F" else "grad"
    return () if src is None else (P2pOp("recv", src, payload, action.microbatch),)


def action_sends(action: Action, peers: Peers) -> tuple[P2pOp, ...]:
    """What ``action`` produces for its neighbours: its output (F) or its input's gradient (B); W: none."""
    if action.kind == "W":
        return ()
    dsts, payload = (peers.act_to, "act") if action.kind == "F" else (peers.grad_to, "grad")
    return tuple(P2pOp("send", d, payload, action.microbatch) for d in dsts)  # type: ignore[arg-type]


def p2p_batches(actions: Sequence[Action], peers: Peers) -> tuple[tuple[P2pOp, ...], ...]:
    """``len(actions) + 1`` batches: batch k (the sends of action k-1 and the receives of action k) is
    posted and waited right before action k runs; the last one, after the last action."""
    out: list[tuple[P2pOp, ...]] = []
    sends: tuple[P2pOp, ...] = ()
    for action in actions:
        out.append(sends + action_recvs(action, peers))
        sends = action_sends(action, peers)
    out.append(sends)
    return tuple(out)


def deferred_batches(actions: Sequence[Action]) -> frozenset[int]:
    """Batches posted without a wait: the one before a ``W`` (only the previous B's sends: the W needs nothing
    from it). Waiting it there would hold the W until the peer reaches its matching receive (under NCCL a send
    completes only with it), which is what zero-bubble schedules must not do; it is waited before the next
    batch that is waited (so a rank still has at most one send outstanding per peer and direction)."""
    return frozenset(k for k, a in enumerate(actions) if a.kind == "W")


def pipeline_group(pipeline: int) -> str:
    return f"pipeline {pipeline}"


def tp_group(pipeline: int, stage: int) -> str:
    return f"tp {pipeline}.{stage}"


def sync_group(holders: tuple[int, ...]) -> str:
    return "sync " + ",".join(map(str, holders))


SyncPosts = Sequence[tuple[str, tuple[int, ...]]]  # (label, holder ranks) per all-reduce, in issue order


def communicators(plan: Plan, sync_posts: Callable[[int], SyncPosts]) -> dict[str, tuple[int, ...]]:
    """Every communicator of a plan's step and its members (what ``replay`` needs)."""
    groups: dict[str, tuple[int, ...]] = {WORLD: tuple(range(plan.world_size))}
    for p, pipe in enumerate(plan.pipelines):
        groups[pipeline_group(p)] = pipe.ranks
        for s, stage in enumerate(pipe.stages):
            if stage.tp > 1:
                groups[tp_group(p, s)] = stage.ranks
    for rank in range(plan.world_size):
        for _, holders in sync_posts(rank):
            groups[sync_group(holders)] = holders
    return groups


def step_program(plan: Plan, rank: int, sync_posts: SyncPosts, *, warmup: bool = False, overlap_sync: bool = True,
                 schedule: Callable[[int, int, int], tuple[Action, ...]] | None = None,
                 gather_posts: SyncPosts = ()) -> list[Item]:
    """Rank ``rank``'s communication in one training step, in the order the runtime issues it;
    ``warmup``: the first step, after the start-up collective on each pipeline group (``runtime.groups``);
    ``overlap_sync`` False: the sync's all-reduces only after the step's last sends (``--no-overlap-grad-sync``);
    ``gather_posts``: a sharded optimizer's broadcasts of the updated shards, after the stats (that is,
    after the optimizer step), waited before the next step (here: at the program's end); ``schedule``: the
    action lists (default: each pipeline's own, ``Pipeline.schedule``)."""
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    actions = (schedule(pipe.depth, pos.stage, pipe.num_microbatches) if schedule is not None
               else actions_of(pipe, pos.stage))
    batches = p2p_batches(actions, plan_peers(plan, rank))
    deferred = deferred_batches(actions)
    items: list[Item] = []
    pending: list[int] = []
    p2p_pending: list[int] = []  # deferred p2p batches, waited before the next waited one

    def post(group: str, ops: tuple[Op, ...], wait: bool = True) -> None:
        handle = len(items)
        items.append(Post(handle, group, ops))
        if wait:
            items.append(Wait(handle))
        else:
            pending.append(handle)

    def post_p2p(batch: tuple[P2pOp, ...], defer: bool = False) -> None:
        if not defer:
            items.extend(Wait(h) for h in p2p_pending)
            p2p_pending.clear()
        if batch:
            handle = len(items)
            items.append(Post(handle, pipeline_group(pos.pipeline), tuple(Op(o.kind, o.peer, o.tag) for o in batch)))
            if defer:
                p2p_pending.append(handle)
            else:
                items.append(Wait(handle))

    def post_sync() -> None:
        for label, holders in sync_posts:
            post(sync_group(holders), (Op("collective", tag=label),), wait=False)

    if warmup:
        post(pipeline_group(pos.pipeline), (Op("collective", tag="warm-up"),))
    last_backward = last_weight_grad_index(actions)
    for k, action in enumerate(actions):
        post_p2p(batches[k], defer=k in deferred)
        if stage.tp > 1 and action.kind != "W":  # a weight pass has no TP collective (split_backward)
            post(tp_group(pos.pipeline, pos.stage), (Op("collective", tag=str(action)),))
        if k == last_backward and overlap_sync:  # the hooks fire them during it (its last accumulation), before its sends
            post_sync()
    post_p2p(batches[-1])  # also waits a deferred batch before it
    if not overlap_sync:
        post_sync()
    items.extend(Wait(h) for h in pending)
    post(WORLD, (Op("collective", tag="stats"),))
    gathers = len(items)
    for label, holders in gather_posts:
        post(sync_group(holders), (Op("collective", tag=f"gather {label}"),), wait=False)
    items.extend(Wait(h) for h in pending if h >= gathers)
    return items
