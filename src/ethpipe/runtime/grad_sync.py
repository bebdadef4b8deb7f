"""Block-wise gradient aggregation (docs/design.md §2.2) and global-norm clipping that counts each block once.

After a stage's last backward, each of its blocks is all-reduced (SUM) among the block's holders
(one rank per pipeline; with tensor parallelism, slice by slice as ``sync_layout`` lays out),
asynchronously and in ascending block order on every rank: one global order, so overlapping
groups cannot deadlock. With the loss scaled by
``1 / global_batch_tokens`` the SUM is exactly the global-mean gradient.

Tied embeddings: the embedding matrix (``tok_emb.weight``, on first stages, and the copy on
last stages) is left out of blocks 0 and -1 and all-reduced once, after the blocks, in the
tied group (every holder), so each use's gradient of every pipeline is summed exactly once
and every copy ends with the full gradient.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ethpipe.plan import Plan
from ethpipe.runtime.model import TIED_WEIGHT
from ethpipe.runtime.sync_layout import SyncSlice, SyncUnit, sync_units, tied_stages, tied_units
from ethpipe.runtime.tensor_parallel import shard_dim
from ethpipe.units import runs_of_bytes

_FIRST_PARTS = ("tok_emb.", "pos_emb.")
_LAST_PARTS = ("norm.", "head.")


def block_of_parameter(plan: Plan, name: str) -> int:
    """Which block a global parameter name belongs to (embeddings: block 0; norm/head: last)."""
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(i for i, b in enumerate(plan.blocks) if b.layers[0] <= layer < b.layers[1])
    if name.startswith(_FIRST_PARTS):
        return 0
    assert name.startswith(_LAST_PARTS), name
    return len(plan.blocks) - 1


def params_by_block(plan: Plan, module: nn.Module, tied: bool = False) -> dict[int, list[str]]:
    """This stage's parameter names grouped by block, each list in the module's (deterministic) order;
    ``tied``: without the tied embedding matrix (``sync_layout.tied_units`` syncs it)."""
    out: dict[int, list[str]] = {}
    for name, _ in module.named_parameters():
        if not (tied and name == TIED_WEIGHT):
            out.setdefault(block_of_parameter(plan, name), []).append(name)
    return dict(sorted(out.items()))


def stage_sync_units(plan: Plan, rank: int, module: nn.Module, full_shapes: Mapping[str, tuple[int, ...]],
                     tied: bool) -> tuple[dict[int, list[str]], list[SyncUnit]]:
    """This stage's parameters by block and its all-reduces in the one global order: every block's
    (``sync_layout.sync_units``), then the tied matrix's (``tied_units``) if this stage holds a copy."""
    blocks = params_by_block(plan, module, tied)
    units = sync_units(plan, rank, blocks, full_shapes)
    if tied_parameters(module, tied):
        units += tied_units(plan, rank, TIED_WEIGHT, full_shapes[TIED_WEIGHT])
    return blocks, units


def tied_parameters(module: nn.Module, tied: bool) -> list[nn.Parameter]:
    """This stage's copy of the tied embedding matrix ([] if the model does not tie or the stage has none)."""
    return [p for name, p in module.named_parameters() if tied and name == TIED_WEIGHT]


def _views(params: Mapping[str, nn.Parameter], slices: Sequence[SyncSlice]) -> list[torch.Tensor]:
    """The gradient views a unit sums (a missing gradient becomes zeros: the stage had no use for it)."""
    out = []
    for sl in slices:
        p = params[sl.name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad if sl.dim is None else p.grad.narrow(sl.dim, sl.start, sl.length))
    return out


def _buckets(views: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of at most ``bucket_bytes`` (0: the whole unit in one all-reduce)."""
    return runs_of_bytes(views, lambda v: v.numel() * v.element_size(), bucket_bytes)


@dataclass
class _Pending:
    label: str  # "block 3" or "tied" (trace slices)
    views: list[torch.Tensor]
    flat: torch.Tensor
    work: dist.Work | None


@dataclass
class BlockGradSync:
    """Issue every unit's all-reduce (``start``); wait and scatter back (``finish``).

    ``units`` come from ``sync_layout.sync_units`` then ``tied_units`` (the global order);
    ``groups`` maps a unit's holder tuple to its process group.
    """

    params: Mapping[str, nn.Parameter]
    units: list[SyncUnit]
    groups: Mapping[tuple[int, ...], dist.ProcessGroup]
    bucket_bytes: int = 0
    pending: list[_Pending] = field(default_factory=list)
    started_s: float = 0.0  # wall time the all-reduces were issued (for traces)

    def start(self) -> None:
        assert not self.pending, "start() called twice without finish()"
        self.started_s = time.time()
        for unit in self.units:
            for views in _buckets(_views(self.params, unit.slices), self.bucket_bytes):
                self._issue(unit.label, views, self.groups[unit.holders], unit.divide_by)

    def _issue(self, label: str, views: list[torch.Tensor], group: dist.ProcessGroup, divide_by: int = 1) -> None:
        flat = torch.cat([v.reshape(-1) for v in views])
        if divide_by != 1:
            flat.div_(divide_by)
        work = None
        if dist.get_world_size(group) > 1:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.pending.append(_Pending(label, views, flat, work))

    def finish(self, on_done=None) -> None:  # type: ignore[no-untyped-def]
        """Wait in issue order; ``on_done(label)`` ("block 3", "tied") is called after each bucket (tracing)."""
        for item in self.pending:
            if item.work is not None:
                item.work.wait()
            offset = 0
            for view in item.views:
                n = view.numel()
                view.copy_(item.flat[offset:offset + n].view(view.shape))
                offset += n
            if on_done is not None:
                on_done(item.label)
        self.pending.clear()


def owned_square_norm(plan: Plan, rank: int, params: Mapping[str, nn.Parameter], blocks: dict[int, list[str]],
                      tied: list[nn.Parameter] | None = None) -> float:
    """Sum of squared gradients over the blocks this rank holds in pipeline 0 (after sync every
    holder has the same gradient, so counting only pipeline 0's copy counts each block once);
    under tp, every rank counts its shards and the first TP rank the replicated parameters;
    the tied matrix counts once, on the tied group's first rank."""
    total = torch.zeros((), dtype=torch.float64)
    pos = plan.position_of(rank)
    tp = plan.pipelines[pos.pipeline].stages[pos.stage].tp
    owned = [params[n] for names in blocks.values() for n in names
             if pos.pipeline == 0 and (pos.tp_rank == 0 or (tp > 1 and shard_dim(n) is not None))]
    if tied and rank in tied_stages(plan)[0]:  # pipeline 0's first stage; each TP rank its vocab shard
        owned += tied
    for p in owned:
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum().cpu()
    return float(total)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """As ``torch.nn.utils.clip_grad_norm_``: scale by max_norm / (norm + 1e-6), never above 1."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_gradients(module: nn.Module, coefficient: float) -> None:
    if coefficient >= 1.0:
        return
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(coefficient)
