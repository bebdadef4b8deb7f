"""AdamW on this rank's shards only (``zero.ShardedBuckets``): the update torch's AdamW makes, on fewer elements.

It calls ``torch.optim.adamw.adamw``, the function ``torch.optim.AdamW.step`` itself runs, with the same
hyper-parameters, on 1-D views of the owned pieces of each parameter, so every element is updated exactly
as the unsharded optimizer would update it (the update is elementwise; weight decay follows the piece's
parameter, as ``config.make_optimizer`` groups them). Moments exist for the owned pieces only: 8 / k bytes
per parameter over k holders. Checkpoints hold full tensors under global names (``full_states``), so a
sharded save loads under any plan, sharded or not (``load_full``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.adamw import adamw

from ethpipe.runtime.config import ADAM_BETAS, ADAM_EPS
from ethpipe.runtime.sync.buckets import _region
from ethpipe.runtime.sync.zero import ShardedBuckets

MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedAdamW:
    """This rank's AdamW state and step (module docstring); ``param_groups`` carries the lr like torch's."""

    def __init__(self, buckets: ShardedBuckets, lr: float, weight_decay: float,
                 betas: tuple[float, float] = ADAM_BETAS, eps: float = ADAM_EPS) -> None:
        self.buckets, self.betas, self.eps = buckets, betas, eps
        pieces = buckets.pieces
        self.fused = bool(pieces) and pieces[0].param.device.type == "cuda"
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "weight_decay": weight_decay, "decay": True},
                                                   {"lr": lr, "weight_decay": 0.0, "decay": False}]
        self.moments = {kind: [torch.zeros_like(p.param) for p in pieces] for kind in MOMENTS}
        step_device = pieces[0].param.device if self.fused else torch.device("cpu")
        self.steps = [torch.zeros((), dtype=torch.float32, device=step_device) for _ in pieces]
        self.num_steps = 0

    def state_bytes(self) -> int:
        """The moments' bytes on this rank (the memory model's sharded optimizer term)."""
        return sum(t.numel() * t.element_size() for kind in MOMENTS for t in self.moments[kind])

    @torch.no_grad()
    def step(self) -> None:
        pieces = self.buckets.pieces
        for group in self.param_groups:
            idx = [i for i, p in enumerate(pieces) if p.decay == group["decay"]]
            if not idx:
                continue
            adamw([pieces[i].param for i in idx], [pieces[i].grad for i in idx],
                  [self.moments["exp_avg"][i] for i in idx], [self.moments["exp_avg_sq"][i] for i in idx], [],
                  [self.steps[i] for i in idx], foreach=None, fused=self.fused or None, amsgrad=False,
                  beta1=self.betas[0], beta2=self.betas[1], lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=self.eps, maximize=False)
        self.num_steps += 1

    def full_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every local parameter's full AdamW state on the CPU, as ``torch.optim.AdamW.state`` holds it (collective
        over each bucket's holders, in the global order: every rank calls it at the same point)."""
        params = self.buckets.params
        out: dict[str, dict[str, torch.Tensor]] = {
            name: {"step": torch.tensor(float(self.num_steps), dtype=torch.float32)} for name in params}
        for kind in MOMENTS:
            full = {name: torch.zeros(p.shape, dtype=p.dtype) for name, p in params.items()}
            self.buckets.gather_full(dict(enumerate(self.moments[kind])), full)
            for name, value in full.items():
                out[name][kind] = value
        return out

    def load_full(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take this rank's pieces of full per-parameter states (``full_states``' form, any device)."""
        for i, piece in enumerate(self.buckets.pieces):
            a, b = piece.span
            for kind in MOMENTS:
                full = states[piece.name][kind]
                self.moments[kind][i].copy_(_region(full, piece.sl).reshape(-1)[a:b])
        steps = {float(s["step"]) for s in states.values()}
        assert len(steps) == 1, f"parameters saved at different steps: {sorted(steps)}"
        self.num_steps = int(steps.pop())
        for t in self.steps:
            t.fill_(float(self.num_steps))
