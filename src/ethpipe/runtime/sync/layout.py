"""Which gradient slices each rank all-reduces with whom: block-wise aggregation across TP degrees.

Plain data, no torch.distributed, so tests can read it. A block is held by one stage of every
pipeline, each at its own TP degree t_p. The SUM over pipelines must add each pipeline's
gradient of every element exactly once, and every holder must end with the sum:

- **Sharded parameters** (``shard_dim`` not None) are cut into the common refinement of the
  holders' shard boundaries: L = lcm(t_p) equal pieces along the shard dim. Piece k lies on
  rank ``ranks_p[k * t_p // L]`` of pipeline p; the pieces with the same holder tuple form a
  contiguous run, and each run is one all-reduce among exactly those holders (one rank per
  pipeline). At most sum(t_p) groups per block ("one group per slice pattern").
- **Replicated parameters** (norms, row-parallel biases, learned positions) are identical on
  the t_p ranks of a stage. Each holder divides its gradient by its own t_p and all holders of
  the block all-reduce together: sum_p t_p * (g_p / t_p) = sum_p g_p (dividing by a power of
  two is exact).

When every holder has tp 1, L = 1 and a block is one all-reduce of everything among its ranks.
Tied embeddings: the matrix (vocab-sharded under tp) is held by each pipeline's first and last
stage; it is summed over the same refinement of those holding stages, after every block.
Units are listed block by block, runs in piece order, replicated last, tied at the end: one
global order on every rank, so overlapping groups cannot deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ethpipe.plan import Plan
from ethpipe.runtime.model.tensor_parallel import shard_dim


@dataclass(frozen=True)
class SyncSlice:
    """A slice of one local gradient: ``length`` elements from ``start`` along ``dim`` (None: whole).

    ``split``: some holder's shard of the parameter spans more than this slice (a lower TP degree holds
    several pieces), the same on every holder, so every holder lays the unit's all-reduces out alike
    (``grad_buckets``)."""

    name: str
    dim: int | None
    start: int
    length: int
    split: bool = False


def _split_somewhere(stages: Sequence[tuple[int, ...]], k0: int, k1: int, pieces: int) -> bool:
    """Whether a run of pieces [k0, k1) is less than some holding stage's whole shard (pieces / its degree)."""
    return any(pieces // len(ranks) > k1 - k0 for ranks in stages)


@dataclass(frozen=True)
class SyncUnit:
    """One all-reduce: this rank's ``slices`` of ``block``, summed among ``holders`` (global ranks)."""

    block: int
    holders: tuple[int, ...]
    slices: tuple[SyncSlice, ...]
    divide_by: int = 1  # the rank's TP degree for replicated slices (see the module docstring)
    tag: str = ""  # "tied" for the tied embedding matrix

    @property
    def label(self) -> str:
        return self.tag or f"block {self.block}"


def _holding_stages(plan: Plan, b_idx: int) -> list[tuple[int, ...]]:
    """The ranks of the stage holding block ``b_idx`` in each pipeline, pipeline by pipeline."""
    lo = plan.blocks[b_idx].layers[0]
    return [next(s.ranks for s in pipe.stages if s.holds(lo)) for pipe in plan.pipelines]


def tied_stages(plan: Plan) -> list[tuple[int, ...]]:
    """The stages holding a copy of a tied embedding: each pipeline's first, and its last if deeper."""
    return [s.ranks for pipe in plan.pipelines for s in dict.fromkeys((pipe.stages[0], pipe.stages[-1]))]


def piece_runs(plan: Plan, b_idx: int) -> tuple[int, list[tuple[int, int, tuple[int, ...]]]]:
    """(L, [(first piece, end piece, holders)]) of block ``b_idx``'s common refinement."""
    return refinement(_holding_stages(plan, b_idx))


def refinement(stages: Sequence[tuple[int, ...]]) -> tuple[int, list[tuple[int, int, tuple[int, ...]]]]:
    """(L, runs) of the common refinement of the holding stages' equal shards (one rank per stage)."""
    pieces = math.lcm(*(len(r) for r in stages))
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for k in range(pieces):
        holders = tuple(ranks[k * len(ranks) // pieces] for ranks in stages)
        if runs and runs[-1][2] == holders:
            runs[-1] = (runs[-1][0], k + 1, holders)
        else:
            runs.append((k, k + 1, holders))
    return pieces, runs


def holder_sets(plan: Plan, tied: bool = False) -> list[tuple[int, ...]]:
    """Every group the block sync needs (``tied``: and the tied matrix's), in the one order every rank
    creates them."""
    out: list[tuple[int, ...]] = []
    for b_idx, block in enumerate(plan.blocks):
        pieces, runs = piece_runs(plan, b_idx)
        for holders in ([h for _, _, h in runs] if pieces > 1 else []) + [tuple(block.ranks)]:
            if holders not in out:
                out.append(holders)
    for _, _, holders in refinement(tied_stages(plan))[1] if tied else []:
        if holders not in out:
            out.append(holders)
    return out


def tied_units(plan: Plan, rank: int, name: str, full_shape: tuple[int, ...]) -> list[SyncUnit]:
    """This rank's all-reduces of its copy of the tied matrix ``name`` ([] if it holds none)."""
    stages = tied_stages(plan)
    mine = next((ranks for ranks in stages if rank in ranks), None)
    if mine is None:
        return []
    pieces, runs = refinement(stages)
    size, index = full_shape[0], mine.index(rank)  # vocab rows: the shard dim of the embedding
    assert size % pieces == 0, (size, pieces)
    piece = size // pieces
    return [SyncUnit(-1, holders, (SyncSlice(name, 0, k0 * piece - index * (size // len(mine)), (k1 - k0) * piece,
                                             _split_somewhere(stages, k0, k1, pieces)),),
                     tag="tied") for k0, k1, holders in runs if rank in holders]


def sync_units(plan: Plan, rank: int, blocks: Mapping[int, Sequence[str]],
               full_shapes: Mapping[str, tuple[int, ...]]) -> list[SyncUnit]:
    """This rank's all-reduces; ``blocks``: block index -> this stage's parameter names (module order)."""
    pos = plan.position_of(rank)
    tp = plan.pipelines[pos.pipeline].stages[pos.stage].tp
    units: list[SyncUnit] = []
    for b_idx in sorted(blocks):
        names = list(blocks[b_idx])
        pieces, runs = piece_runs(plan, b_idx)
        stages = _holding_stages(plan, b_idx)
        sharded = [n for n in names if pieces > 1 and shard_dim(n) is not None]
        for k0, k1, holders in runs if sharded else []:
            if rank not in holders:
                continue
            split = _split_somewhere(stages, k0, k1, pieces)
            slices = []
            for name in sharded:
                dim = shard_dim(name)
                assert dim is not None
                size = full_shapes[name][dim]
                assert size % pieces == 0, (name, size, pieces)
                piece = size // pieces
                slices.append(SyncSlice(name, dim, k0 * piece - pos.tp_rank * (size // tp), (k1 - k0) * piece, split))
            units.append(SyncUnit(b_idx, holders, tuple(slices)))
        replicated = [SyncSlice(n, None, 0, 0) for n in names if n not in sharded]
        if replicated:
            units.append(SyncUnit(b_idx, tuple(plan.blocks[b_idx].ranks), tuple(replicated), tp if pieces > 1 else 1))
    return units
