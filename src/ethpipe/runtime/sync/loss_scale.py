"""Dynamic loss scaling for fp16 training, decided identically on every rank.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a
large scale S before backward (and the gradients divided by S before the optimizer). Too
large an S overflows to inf/nan; then the step is skipped and S halved. After
``growth_interval`` finite steps in a row S doubles (torch.amp.GradScaler's policy and
defaults).

Across a pipeline-parallel world every rank must take the same decision, or one rank steps
while another skips and the replicas diverge. The decision is made from ONE number all ranks
share: the count of ranks with a non-finite gradient (``grad_sync.GradStats``), carried in the
per-step stats all-gather (runtime/observe/metrics.py) that already gives every rank the same loss
and gradient norm. The scaler's state is saved in every checkpoint's manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclass(frozen=True)
class LossScaler:
    """The scale for the next step and how many finite steps ran since it last changed."""

    scale: float = INIT_SCALE
    good_steps: int = 0
    growth_interval: int = GROWTH_INTERVAL

    def after_step(self, finite: bool) -> LossScaler:
        """The scaler for the next step, given whether this step's gradients were all finite."""
        if not finite:
            return LossScaler(self.scale * BACKOFF_FACTOR, 0, self.growth_interval)
        if self.good_steps + 1 >= self.growth_interval:
            return LossScaler(self.scale * GROWTH_FACTOR, 0, self.growth_interval)
        return LossScaler(self.scale, self.good_steps + 1, self.growth_interval)

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "growth_interval": self.growth_interval}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> LossScaler:
        return LossScaler(float(data["scale"]), int(data["good_steps"]), int(data["growth_interval"]))
