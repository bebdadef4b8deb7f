"""Replay every rank's communication under NCCL's semantics and report whether it can deadlock.

Gloo buffers sends, so a multi-rank CPU test passes orders that hang on GPUs. This replay takes the
worst case NCCL allows instead, so an order it completes is deadlock-free on NCCL too:

- **No buffering.** A send completes only together with the peer's matching receive: the k-th send
  from A to B on a communicator matches the k-th receive on B from A there (and their tags must
  agree, or the receiver would get the wrong tensor: reported as an error).
- **One FIFO per communicator.** A rank's posts on one communicator (``streams="group"``: each
  process group, as ProcessGroupNCCL runs one NCCL stream per communicator) run in issue order;
  only the head post is active. ``streams="device"`` is stricter: one FIFO for all of a rank's
  communicators (kernels of different communicators never overlap on a GPU).
- **A batch completes as a unit.** A post (one ``batch_isend_irecv``, or one collective) holds its
  stream until all of its ops have matched; the ops inside it may match in any order.
- **A wait blocks.** ``Wait(h)`` stops the rank's program until post ``h`` completes (on NCCL a stream
  wait: everything the rank issues later runs after it, which orders the same way).
- A collective completes when every member of its group has it at the head of its stream.
- ``lazy_init``: a communicator's first use is a collective over its whole group (NCCL's lazy
  communicator creation); ``init_process_group(device_id=...)`` makes it eager (no such step).

More constraints only add dependency cycles, so an order that completes under ``"device"``
also completes under ``"group"``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

OpKind = Literal["send", "recv", "collective"]
StreamMode = Literal["group", "device"]


@dataclass(frozen=True)
class Op:
    """One operation as the communicator sees it; ``tag`` names the data (payload, micro-batch, block)."""

    kind: OpKind
    peer: int | None = None  # p2p only
    tag: str = ""


@dataclass(frozen=True)
class Post:
    """One launch on communicator ``group``: a batch of p2p ops, or one collective."""

    handle: int
    group: str
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Wait:
    """Block the rank's program until its post ``handle`` has completed."""

    handle: int


Item = Post | Wait
Program = Sequence[Item]


@dataclass(frozen=True)
class Outcome:
    """``completed``: every program ran to its end with every post matched and every tag agreeing.
    Otherwise ``blocked`` says where each unfinished rank is stuck; ``errors`` lists tag mismatches
    (the wrong tensor received) and ops outside their communicator."""

    completed: bool
    blocked: dict[int, str] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.completed and not self.errors:
            return "completed"
        parts = [f"rank {r}: {what}" for r, what in sorted(self.blocked.items())]
        return "; ".join(list(self.errors) + parts)


@dataclass
class _Posted:
    rank: int
    post: Post
    pending: set[int]  # indices of its ops not yet matched
    active: bool = False


def replay(programs: Mapping[int, Program], groups: Mapping[str, tuple[int, ...]], *,
           streams: StreamMode = "group", lazy_init: bool = False) -> Outcome:
    """Run every rank's program under NCCL's semantics (module docstring); ``groups``: communicator
    name -> member ranks (a collective needs all of them)."""
    for rank, program in programs.items():
        handles = [item.handle for item in program if isinstance(item, Post)]
        assert len(handles) == len(set(handles)), f"rank {rank} posts a handle twice"
    pc = {r: 0 for r in programs}
    queues: dict[tuple[int, ...] | tuple[int, str], deque[_Posted]] = defaultdict(deque)
    by_handle: dict[tuple[int, int], _Posted] = {}
    done: set[tuple[int, int]] = set()
    initialised: set[tuple[int, str]] = set()
    errors: list[str] = []
    # FIFO matching: p2p by (group, src, dst) sequence number, collectives by (group) sequence number.
    counters: dict[tuple[object, ...], int] = defaultdict(int)
    waiting: dict[tuple[object, ...], list[tuple[_Posted, int]]] = defaultdict(list)

    def stream_of(rank: int, group: str) -> tuple[int, ...] | tuple[int, str]:
        return (rank,) if streams == "device" else (rank, group)

    def enqueue(rank: int, post: Post) -> None:
        members = groups[post.group]
        if rank not in members or any(op.peer is not None and op.peer not in members for op in post.ops):
            errors.append(f"rank {rank} posts {_describe(_Posted(rank, post, set()))} outside its members {members}")
        item = _Posted(rank, post, set(range(len(post.ops))))
        queues[stream_of(rank, post.group)].append(item)
        by_handle[(rank, post.handle)] = item

    def next_match_key(item: _Posted, i: int) -> tuple[object, ...]:
        """The identity of op ``i``'s match: its channel and its sequence number there (advances it)."""
        op, group, rank = item.post.ops[i], item.post.group, item.rank
        if op.kind == "collective":
            key = ("coll", group)
        elif op.kind == "send":
            key = ("p2p", group, rank, op.peer)
        else:
            key = ("p2p", group, op.peer, rank)
        side = (rank, op.kind if op.kind != "collective" else "c")
        seq = counters[(key, side)]
        counters[(key, side)] += 1
        return (*key, seq)

    progressed = True
    while progressed:
        progressed = False
        for rank, program in programs.items():  # run each program until it blocks
            while pc[rank] < len(program):
                item = program[pc[rank]]
                if isinstance(item, Wait):
                    if (rank, item.handle) not in done:
                        break
                else:
                    if lazy_init and (rank, item.group) not in initialised:
                        initialised.add((rank, item.group))
                        enqueue(rank, Post(-1 - len(initialised), item.group, (Op("collective", tag="init"),)))
                    enqueue(rank, item)
                pc[rank] += 1
                progressed = True
        for queue in queues.values():  # activate stream heads: their ops become matchable
            if queue and not queue[0].active:
                head = queue[0]
                head.active = True
                progressed = True
                for i in sorted(head.pending):
                    key = next_match_key(head, i)
                    waiting[key].append((head, i))
                    op = head.post.ops[i]
                    members = groups[head.post.group]
                    need = len(members) if op.kind == "collective" else 2
                    if len(waiting[key]) == need:
                        tags = {it.post.ops[j].tag for it, j in waiting[key]}
                        if len(tags) > 1:
                            errors.append(f"{head.post.group} {key[:-1]} #{key[-1]}: tags differ {sorted(tags)}")
                        for it, j in waiting.pop(key):
                            it.pending.discard(j)
        for queue in queues.values():  # retire completed heads
            while queue and queue[0].active and not queue[0].pending:
                finished = queue.popleft()
                done.add((finished.rank, finished.post.handle))
                progressed = True
    blocked: dict[int, str] = {}
    for rank, program in programs.items():
        if pc[rank] < len(program):
            item = program[pc[rank]]
            assert isinstance(item, Wait)
            posted = by_handle.get((rank, item.handle))
            blocked[rank] = f"waits on {_describe(posted)}" if posted else f"waits on handle {item.handle}, never posted"
    for queue in queues.values():
        if queue and queue[0].rank not in blocked:
            blocked[queue[0].rank] = f"never completes {_describe(queue[0])}"
    return Outcome(not blocked and not errors, blocked, tuple(errors))


def _describe(item: _Posted) -> str:
    ops = ", ".join(f"{o.kind}{'' if o.peer is None else f' {o.peer}'} {o.tag}".strip() for o in item.post.ops)
    return f"[{ops}] on {item.post.group}"
