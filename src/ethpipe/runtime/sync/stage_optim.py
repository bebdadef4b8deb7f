"""A stage's gradient sync and optimizer as one object: plain AdamW over all-reduced blocks, or ZeRO-1.

The training loop does the same things in the same order either way (``train``): zero the gradients,
run the schedule (the buckets sync from backward hooks), wait, read the norm pieces, scale, step, and,
sharded, send the updated shards to the other holders (``gather``) and wait for them before the next
forwards (``wait_params``). Which one runs is the plan's ``shard_optimizer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ethpipe.plan import Plan
from ethpipe.runtime.config import TrainConfig, make_optimizer
from ethpipe.runtime.sync.buckets import GradBuckets
from ethpipe.runtime.sync.grads import GradStats, owned_names, scale_grads, stage_sync_units, tied_parameters
from ethpipe.runtime.groups import RankGroups
from ethpipe.runtime.model.decoder import TIED_WEIGHT
from ethpipe.runtime.sync.sharded_adamw import ShardedAdamW
from ethpipe.runtime.sync.zero import ShardedBuckets

States = Mapping[str, Mapping[str, torch.Tensor]]


@dataclass
class StageOptimizer:
    buckets: GradBuckets
    optimizer: Any  # torch.optim.AdamW, or ShardedAdamW (what checkpoints save)
    _stats: Any = field(repr=False)

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank scales and counts: all of them, or (sharded) its shards of the summed ones."""
        if isinstance(self.buckets, ShardedBuckets):
            return self.buckets.owned_grads()
        return [p.grad for p in self.buckets.params.values() if p.grad is not None]

    def norm_parts(self) -> torch.Tensor:
        """[this rank's share of the squared global norm, 1.0 if any counted gradient is non-finite], on the device."""
        return self._stats()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, factor: float) -> None:
        """Scale the gradients by ``factor`` (clipping, fp16 unscaling), step, and start the all-gather (sharded)."""
        scale_grads(self.grads(), factor)
        self.optimizer.step()
        if isinstance(self.buckets, ShardedBuckets):
            self.buckets.gather_params()

    def wait_params(self) -> None:
        """Before the next forwards (and before a save): the other holders' updated shards are here."""
        if isinstance(self.buckets, ShardedBuckets):
            self.buckets.wait_params()


def _shard_stats(buckets: ShardedBuckets, device: torch.device) -> Any:
    def parts() -> torch.Tensor:
        grads = buckets.owned_grads()
        if not grads:
            return torch.zeros(2, dtype=torch.float64, device=device)
        share = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        return torch.stack([share, (~torch.isfinite(share)).double()])
    return parts


def reduce_dtype_of(plan: Plan) -> torch.dtype | None:
    """The dtype a plan's gradient sync sums in (``extra.grad_reduce``: ``bf16``), None for the gradients' own."""
    return torch.bfloat16 if plan.extra.get("grad_reduce", "fp32") == "bf16" else None


def build_stage_optimizer(plan: Plan, config: TrainConfig, rank: int, module: nn.Module, full_shapes: Mapping[str, tuple[int, ...]],
                          tied: bool, groups: RankGroups, device: torch.device, states: States | None) -> StageOptimizer:
    """The stage's buckets and optimizer, with the AdamW ``states`` of a checkpoint (by parameter name) if any.
    Built after the model's weights are final (a sharded optimizer lays the parameters out in its buffers)."""
    blocks, units = stage_sync_units(plan, rank, module, full_shapes, tied)
    params = dict(module.named_parameters())
    if not plan.shard_optimizer:
        owned = owned_names(plan, rank, blocks, [TIED_WEIGHT] if tied_parameters(module, tied) else [])
        optimizer = make_optimizer(module, config)
        if states is not None:
            fused = bool(optimizer.defaults.get("fused"))
            for name, param in params.items():
                state = dict(states[name])
                state["step"] = state["step"].to(param.device if fused else "cpu")
                optimizer.state[param] = state
        buckets = GradBuckets(params, units, groups.block_groups, config.bucket_bytes, reduce_dtype_of(plan))
        return StageOptimizer(buckets, optimizer, GradStats(params, owned, device))
    weights = dict(enumerate(plan.shard_weights)) if plan.shard_weights else {}
    sharded = ShardedBuckets(params, units, groups.block_groups, rank, weights, config.bucket_bytes,
                             reduce_dtype_of(plan))
    sharded_optimizer = ShardedAdamW(sharded, config.lr, config.weight_decay, config.adam_betas, config.adam_eps)
    if states is not None:
        sharded_optimizer.load_full(states)
    return StageOptimizer(sharded, sharded_optimizer, _shard_stats(sharded, device))
