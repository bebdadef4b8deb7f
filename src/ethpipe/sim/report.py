"""What one simulated iteration produced: events, per-rank statistics and the summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

EventKind = Literal["compute", "p2p", "allreduce", "optimizer", "allgather"]


@dataclass(frozen=True)
class SimEvent:
    """One interval on one stage's stream (tp ranks of a stage share one stream)."""

    name: str  # "F3", "B3", "recv F3", "allreduce block 2", "optimizer"
    kind: EventKind
    pipeline: int
    stage: int
    ranks: tuple[int, ...]
    start_s: float
    end_s: float
    microbatch: int = -1  # -1 where it does not apply
    block: int = -1

    @property
    def dur_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranks"] = list(self.ranks)
        return out


@dataclass(frozen=True)
class RankStats:
    """Where one rank's iteration went. ``busy + idle = iteration time``.

    ``busy_s`` is compute (forward, backward, optimizer); ``idle_s`` everything else. Inside the
    pipeline phase (up to the rank's flush: its last backward and its last sends) the non-compute time
    splits into ``recv_s`` (blocking receives) and ``bubble_s`` (waiting on other stages, a sender's wait
    for its transfers included); ``sync_wait_s`` is the time from the flush to the optimizer step: gradient
    sync that compute did not hide (own all-reduces plus waiting for other holders), then waiting for the
    slowest rank's sync and the step's stats all-gather, which every optimizer step follows.
    """

    rank: int
    pipeline: int
    stage: int
    device: str
    busy_s: float
    idle_s: float
    bubble_s: float
    recv_s: float
    sync_wait_s: float
    flush_s: float  # end of the rank's last backward and of its last sends
    peak_memory_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SimReport:
    iteration_time_s: float
    tokens_per_s: float
    exposed_comm_s: float  # how much longer the iteration is than with free gradient sync
    flat_sync: bool
    pipeline_flush_s: tuple[float, ...]  # when each pipeline's last backward (and its sends) ends
    ranks: tuple[RankStats, ...]
    critical_path: tuple[SimEvent, ...]
    events: tuple[SimEvent, ...]

    def to_dict(self, include_events: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iteration_time_s": self.iteration_time_s,
            "tokens_per_s": self.tokens_per_s,
            "exposed_comm_s": self.exposed_comm_s,
            "flat_sync": self.flat_sync,
            "pipeline_flush_s": list(self.pipeline_flush_s),
            "ranks": [r.to_dict() for r in self.ranks],
            "critical_path": [e.to_dict() for e in self.critical_path],
        }
        if include_events:
            out["events"] = [e.to_dict() for e in self.events]
        return out
