"""Block-wise gradient aggregation (docs/design.md §2.2): which parameters a stage syncs with whom, and
the global-norm pieces that count each block once.

Each of a stage's blocks is all-reduced (SUM) among the block's holders (one rank per pipeline; with
tensor parallelism, slice by slice as ``sync_layout`` lays out) in one global order on every rank, so
overlapping groups cannot deadlock; ``grad_buckets`` runs them from backward hooks. With the loss
scaled by ``1 / global_batch_tokens`` the SUM is exactly the global-mean gradient.

Tied embeddings: the embedding matrix (``tok_emb.weight``, on first stages, and the copy on
last stages) is left out of blocks 0 and -1 and all-reduced once, after the blocks, in the
tied group (every holder), so each use's gradient of every pipeline is summed exactly once
and every copy ends with the full gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ethpipe.plan import Plan
from ethpipe.sublayers import unit_of_parameter
from ethpipe.runtime.model.decoder import TIED_WEIGHT
from ethpipe.runtime.sync.layout import SyncUnit, sync_units, tied_stages, tied_units
from ethpipe.runtime.model.tensor_parallel import shard_dim

_FIRST_PARTS = ("tok_emb.", "pos_emb.")
_LAST_PARTS = ("norm.", "head.")


def block_of_parameter(plan: Plan, name: str) -> int:
    """Which block a global parameter name belongs to (embeddings: block 0; norm/head: last)."""
    if name.startswith("layers."):
        unit = unit_of_parameter(name, plan.sublayers)
        return next(i for i, b in enumerate(plan.blocks) if b.layers[0] <= unit < b.layers[1])
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


def owned_names(plan: Plan, rank: int, blocks: dict[int, list[str]], tied: list[str]) -> list[str]:
    """The parameters whose gradients this rank counts in the global norm, so that each element counts
    once: after sync every holder has the same gradient, so only pipeline 0's copy counts; under tp,
    every rank counts its shards and the first TP rank the replicated parameters; the tied matrix
    counts once, on the tied group's first stage (each TP rank its vocab shard)."""
    pos = plan.position_of(rank)
    tp = plan.pipelines[pos.pipeline].stages[pos.stage].tp
    owned = [n for names in blocks.values() for n in names
             if pos.pipeline == 0 and (pos.tp_rank == 0 or (tp > 1 and shard_dim(n) is not None))]
    return owned + (tied if tied and rank in tied_stages(plan)[0] else [])


class GradStats:
    """[this rank's share of the squared global norm, 1.0 if any of its gradients is non-finite], fp64, on the
    device, from one foreach pass (no host read, no wide copy of any gradient, no host-to-device copy: the
    owned mask is made once).

    Each gradient's norm is computed in its own dtype (fp32 accumulation for fp32/16-bit gradients), and
    the squares are summed in fp64: the result's relative error is that of the worst per-tensor norm, at
    most n u_fp32 for a gradient of n elements (about log2(n) u_fp32 with the pairwise reductions used),
    e.g. below 1e-5 for a 128k x 8192 embedding in the worst case. fp64 runs are exact to u_fp64.
    A non-finite element makes its tensor's norm non-finite, so the total says whether any is.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], owned: Sequence[str], device: torch.device) -> None:
        missing = sorted(set(owned) - set(params))
        assert not missing, f"owned parameters not on this stage: {missing[:3]}"
        self.params, self.device = params, device
        self._names: tuple[str, ...] | None = None
        self._owned = frozenset(owned)
        self._mask = torch.zeros(0, dtype=torch.bool, device=device)

    def __call__(self) -> torch.Tensor:
        names = tuple(n for n, p in self.params.items() if p.grad is not None)
        if not names:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        if names != self._names:  # once (gradients are persistent), or where a stage's set of gradients changed
            self._names = names
            self._mask = torch.tensor([n in self._owned for n in names], dtype=torch.bool, device=self.device)
        squares = torch.stack(torch._foreach_norm([self.params[n].grad for n in names])).double().pow(2)  # type: ignore[misc]
        share = torch.where(self._mask, squares, torch.zeros_like(squares)).sum()  # another rank's inf stays out
        return torch.stack([share, (~torch.isfinite(squares.sum())).double()])


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """As ``torch.nn.utils.clip_grad_norm_``: scale by max_norm / (norm + 1e-6), never above 1."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def scale_grads(grads: Sequence[torch.Tensor], factor: float) -> None:
    """Multiply the gradients by ``factor`` (fp16 unscaling and clipping together) in one foreach launch."""
    grads = list(grads)
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)
