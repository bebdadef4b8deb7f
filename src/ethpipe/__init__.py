"""ethpipe: data-balanced heterogeneous pipeline parallelism (ETH) for mixed GPU clusters."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    import torch


def build_model(model: str, seed: int = 0) -> "torch.nn.Module":
    """The whole model as one plain ``nn.Module`` (``forward(tokens) -> logits``), with the
    same global parameter names and seeded initialisation as the pipeline stages."""
    from ethpipe.runtime.model.decoder import build_full_model

    return build_full_model(model, seed=seed)
