"""Planner options: the ETH ablation knobs (issue 6), recorded in every plan's ``search`` field."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ethpipe.errors import UserError

if TYPE_CHECKING:
    from ethpipe.plan import Plan

BALANCE_MODES = ("data+layers", "data", "layers")


@dataclass(frozen=True)
class PlannerOptions:
    """What ETH may do. The defaults are ETH; each ``False`` / single mode removes one idea.

    * ``fine_grained``: sample-level data balance (a smaller last micro-batch). False: every
      pipeline's sample count is a whole number of its micro-batches, one micro-batch size for
      the whole plan (so whole micro-batches can add up to the batch).
    * ``block_sync``: block-wise gradient all-reduce overlapping the drain. False: flat sync
      after the slowest pipeline flushes (DDP-style), priced that way.
    * ``allow_mixed``: pipelines may mix GPU types where a type cannot hold a replica alone.
      False: homogeneous pipelines only (an error if some type cannot hold a replica).
    * ``balance``: ``data+layers`` (ETH), ``data`` (equal layers per stage, data balanced),
      ``layers`` (layers balanced per pipeline, equal data per pipeline).
    * ``allow_idle``: also plan without the slowest GPU type(s) and leave those nodes idle where
      that is predicted faster (``planner/devices/idle.py``). False: every device gets a rank.
    * ``per_type_tp``: a mixed pipeline's stages take a TP degree per device type (``planner/devices/hybrid.py``).
      False: one TP degree for every stage of a mixed pipeline.
    * ``hybrid``: also try mixing a pair of pools adjacent in speed order while the other pools keep
      their own pipelines (``planner/devices/hybrid.py``). False: mixed pipelines span all pools or the needy ones.
    * ``split_pools``: a pool's nodes may be shared by its two best shapes (``planner/devices/hybrid.py``).
      False: one template per pool.
    * ``sublayer_cuts``: the final plan's stages may end between a layer's attention and its MLP where that is
      predicted faster (``planner/layers/sublayer_cuts.py``). False: whole layers only.
    """

    fine_grained: bool = True
    block_sync: bool = True
    allow_mixed: bool = True
    balance: str = "data+layers"
    allow_idle: bool = True
    per_type_tp: bool = True
    hybrid: bool = True
    split_pools: bool = True
    sublayer_cuts: bool = True

    def __post_init__(self) -> None:
        if self.balance not in BALANCE_MODES:
            raise UserError(f"PlannerOptions.balance '{self.balance}' is unknown: use one of {', '.join(BALANCE_MODES)}")

    @property
    def balance_layers(self) -> bool:
        return self.balance != "data"

    @property
    def balance_data(self) -> bool:
        return self.balance != "layers"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def options_record(plan: Plan) -> dict[str, Any]:
    """The ``PlannerOptions`` fields ``plan`` records (``search.options``, as ``to_dict`` wrote them); {} for none.
    The passes after the search read them off the plan (equal data, whole micro-batches, flat sync)."""
    return ((plan.extra.get("search") or {}).get("options")) or {}
