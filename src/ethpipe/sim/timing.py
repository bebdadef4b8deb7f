"""The slice of the cost model the simulator needs, as a Protocol.

The simulator depends on this interface, not on ``ethpipe.cost.model.CostModel`` itself, so
hand-written fakes with round numbers can pin down exact timelines in tests while the real
cost model (analytic or profile-backed) drives ``ethpipe simulate``.
"""

from __future__ import annotations

from typing import Protocol

from ethpipe.plan import Plan, Stage


class TimingModel(Protocol):
    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        """(forward, backward) seconds of one micro-batch on a whole stage."""
        ...

    def weight_grad_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> float:
        """Seconds of a split backward's W (``CostModel.weight_grad_s``): B lasts the backward less this.
        Only asked for stages whose schedule splits the backward."""
        ...

    def p2p_s(self, src_rank: int, dst_rank: int, micro_batch: int) -> float:
        """Seconds to send one micro-batch's activation (or its gradient) between two ranks."""
        ...

    def block_sync_s(self, plan: Plan) -> list[float]:
        """Seconds of each block's all-reduce (``CostModel.block_sync_s``: the planner prices sync the same way)."""
        ...

    def tied_sync_s(self, plan: Plan) -> float:
        """Seconds of the tied embedding matrix's all-reduce among its copies (0: untied)."""
        ...

    def block_gather_s(self, plan: Plan) -> list[float]:
        """Seconds of each block's all-gather of updated shards after the optimizer (0: not sharded)."""
        ...

    def tied_gather_s(self, plan: Plan) -> float:
        ...

    def stats_gather_s(self, plan: Plan) -> float:
        """Seconds of the step's stats all-gather over every rank, between the last sync and the optimizer steps
        (``CostModel.stats_gather_s``)."""
        ...

    def optimizer_s(self, stage: Stage, *, first: bool, last: bool) -> float:
        """Seconds of the optimizer step over a stage's parameters."""
        ...

    def stage_memory_bytes(self, stage: Stage, micro_batch: int, in_flight: int, *, first: bool, last: bool,
                           pending_weights: int = 0) -> int:
        """Peak bytes on one rank of the stage with ``in_flight`` micro-batches of activations held."""
        ...
