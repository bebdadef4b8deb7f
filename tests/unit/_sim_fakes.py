"""Round-number timing model and plan builder for hand-computed simulator timelines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks


class FreeSyncTiming:
    """The parts of a timing model that pipeline-timing tests leave free: no gradient sync or gather, no optimizer
    step, no memory, no transfers; a test's table subclasses it with its own stage (and link) times."""

    def p2p_s(self, src_rank: int, dst_rank: int, micro_batch: int) -> float:
        return 0.0

    def block_sync_s(self, plan: Plan) -> list[float]:
        return [0.0] * len(plan.blocks)

    block_gather_s = block_sync_s

    def tied_sync_s(self, plan: Plan) -> float:
        return 0.0

    tied_gather_s = tied_sync_s
    stats_gather_s = tied_sync_s

    def optimizer_s(self, stage: Stage, *, first: bool, last: bool) -> float:
        return 0.0

    def stage_memory_bytes(self, stage: Stage, micro_batch: int, in_flight: float, *, first: bool, last: bool,
                           pending_weights: int = 0, stashed_inputs: int | None = None,
                           live_heads: int | None = None) -> int:
        return 0


@dataclass
class FakeCost:
    """fwd = per-layer time of the device x layers x micro-batch; bwd = 2 x fwd."""

    fwd_per_layer_s: dict[str, float] = field(default_factory=lambda: {"fast": 1.0})
    p2p_time_s: float = 0.0
    grad_bytes_by_layers: dict[tuple[int, int], int] = field(default_factory=dict)
    seconds_per_byte: float = 1e-3
    optimizer_time_s: float = 0.0
    stats_time_s: float = 0.0  # the step's stats all-gather (0: the barrier alone)
    calls: list[str] = field(default_factory=list)

    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        fwd = self.fwd_per_layer_s[stage.device] * stage.num_layers * micro_batch
        return fwd, 2.0 * fwd

    def p2p_s(self, src_rank: int, dst_rank: int, micro_batch: int) -> float:
        return self.p2p_time_s

    def block_gather_s(self, plan: Plan) -> list[float]:
        return [0.0] * len(plan.blocks)

    def tied_gather_s(self, plan: Plan) -> float:
        return 0.0

    def tied_sync_s(self, plan: Plan) -> float:
        return 0.0  # the fakes' models are untied

    def block_sync_s(self, plan: Plan) -> list[float]:
        """bytes x seconds_per_byte for blocks held by more than one pipeline."""
        multi = len(plan.pipelines) > 1
        return [self.grad_bytes_by_layers.get(b.layers, 0) * self.seconds_per_byte if multi else 0.0
                for b in plan.blocks]

    def stats_gather_s(self, plan: Plan) -> float:
        return self.stats_time_s

    def optimizer_s(self, stage: Stage, *, first: bool, last: bool) -> float:
        return self.optimizer_time_s

    def stage_memory_bytes(self, stage: Stage, micro_batch: int, in_flight: float, *, first: bool, last: bool,
                           pending_weights: int = 0, stashed_inputs: int | None = None,
                           live_heads: int | None = None) -> int:
        return int(100 * in_flight * micro_batch) + stage.num_layers


def make_plan(pipelines: Sequence[tuple[Sequence[tuple[int, int]], Sequence[int], str]], seq_len: int = 16) -> Plan:
    """pipelines: (layer ranges per stage, micro-batch sizes, device); ranks numbered in order."""
    built, rank = [], 0
    for ranges, sizes, device in pipelines:
        stages = []
        for lo, hi in ranges:
            stages.append(Stage(ranks=(rank,), device=device, layers=(lo, hi)))
            rank += 1
        built.append(Pipeline(tuple(stages), tuple(sizes)))
    return Plan(
        method="eth", model="tiny", global_batch_size=sum(sum(p.micro_batch_sizes) for p in built), seq_len=seq_len,
        pipelines=tuple(built), blocks=compute_blocks(built),
    )
