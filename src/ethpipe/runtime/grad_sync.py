"""Block-wise gradient aggregation (DESIGN 2.2) and global-norm clipping that counts each block once.

After a stage's last backward, each of its blocks is all-reduced (SUM) in that block's group
(one rank per pipeline), asynchronously and in ascending block order on every rank: one
global order, so overlapping groups cannot deadlock. With the loss scaled by
``1 / global_batch_tokens`` the SUM is exactly the global-mean gradient.

Tied embeddings: the embedding matrix (``tok_emb.weight``, on first stages, and the copy on
last stages) is left out of blocks 0 and -1 and all-reduced once, after the blocks, in the
tied group (every holder), so each use's gradient of every pipeline is summed exactly once
and every copy ends with the full gradient.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ethpipe.plan import Plan
from ethpipe.runtime.groups import tied_ranks
from ethpipe.runtime.model import TIED_WEIGHT

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


def params_by_block(plan: Plan, module: nn.Module, tied: bool = False) -> dict[int, list[nn.Parameter]]:
    """This stage's parameters grouped by block, each list in the module's (deterministic) order;
    ``tied``: without the tied embedding matrix (``tied_parameters`` syncs it)."""
    out: dict[int, list[nn.Parameter]] = {}
    for name, param in module.named_parameters():
        if not (tied and name == TIED_WEIGHT):
            out.setdefault(block_of_parameter(plan, name), []).append(param)
    return dict(sorted(out.items()))


def tied_parameters(module: nn.Module, tied: bool) -> list[nn.Parameter]:
    """This stage's copy of the tied embedding matrix ([] if the model does not tie or the stage has none)."""
    return [p for name, p in module.named_parameters() if tied and name == TIED_WEIGHT]


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of at most ``bucket_bytes`` (0: the whole block in one all-reduce)."""
    if bucket_bytes <= 0:
        return [params]
    out: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


@dataclass
class _Pending:
    label: str  # "block 3" or "tied" (trace slices)
    params: list[nn.Parameter]
    flat: torch.Tensor
    work: dist.Work | None


@dataclass
class BlockGradSync:
    """Issue every block's all-reduce, then the tied one (``start``); wait and scatter back (``finish``)."""

    blocks: dict[int, list[nn.Parameter]]
    groups: dict[int, dist.ProcessGroup]
    bucket_bytes: int = 0
    tied: list[nn.Parameter] = field(default_factory=list)  # this rank's copy of the tied matrix, if any
    tied_group: dist.ProcessGroup | None = None
    pending: list[_Pending] = field(default_factory=list)
    started_s: float = 0.0  # wall time the all-reduces were issued (for traces)

    def start(self) -> None:
        assert not self.pending, "start() called twice without finish()"
        assert (self.tied_group is not None) == bool(self.tied), "a tied copy needs the tied group"
        self.started_s = time.time()
        for b_idx in sorted(self.blocks):
            for params in _buckets(self.blocks[b_idx], self.bucket_bytes):
                self._issue(f"block {b_idx}", params, self.groups[b_idx])
        if self.tied_group is not None:  # after every block: still one global order
            self._issue("tied", self.tied, self.tied_group)

    def _issue(self, label: str, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        work = None
        if dist.get_world_size(group) > 1:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self.pending.append(_Pending(label, params, flat, work))

    def finish(self, on_done=None) -> None:  # type: ignore[no-untyped-def]
        """Wait in issue order; ``on_done(label)`` ("block 3", "tied") is called after each bucket (tracing)."""
        for item in self.pending:
            if item.work is not None:
                item.work.wait()
            offset = 0
            for p in item.params:
                n = p.numel()
                p.grad.copy_(item.flat[offset:offset + n].view_as(p.grad))
                offset += n
            if on_done is not None:
                on_done(item.label)
        self.pending.clear()


def owned_square_norm(plan: Plan, rank: int, blocks: dict[int, list[nn.Parameter]],
                      tied: list[nn.Parameter] | None = None) -> float:
    """Sum of squared gradients over the blocks this rank holds in pipeline 0 (after sync every
    holder has the same gradient, so counting only pipeline 0's copy counts each block once);
    the tied matrix counts once, on the tied group's first rank."""
    total = torch.zeros((), dtype=torch.float64)
    owned = [p for b_idx, params in blocks.items() if plan.blocks[b_idx].ranks[0] == rank for p in params]
    if tied and tied_ranks(plan)[0] == rank:
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
