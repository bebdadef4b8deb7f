"""The step's stats all-gather (runtime/step.py, ``gather_step_stats``) as the cost model prices it: one fp64
vector per rank over the whole world, between the last rank's sync and every optimizer step."""

from __future__ import annotations

import numpy as np
import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import STATS_BYTES_PER_RANK, sync_shape_s, world_gather_shape
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.planner.estimate import estimate_plan
from ethpipe.runtime.observe.metrics import DEVICE_FIELDS, HOST_FIELDS
from ethpipe.sim import simulate


def test_the_priced_vector_is_the_runtimes() -> None:
    assert STATS_BYTES_PER_RANK == 8 * len(DEVICE_FIELDS + HOST_FIELDS)


def _cluster(nodes: int, per_node: int = 8, nic_gbit_s: int = 400):
    return cluster_from_dict({"nodes": [{"gpu": "h100_sxm", "num_nodes": nodes, "gpus_per_node": per_node,
                                         "nic_gbit_s": nic_gbit_s}]})


def test_every_rank_of_a_node_shares_its_nic_and_the_ring_crosses_every_node() -> None:
    cluster = _cluster(512)
    ranks = np.arange(cluster.num_devices)
    shape = world_gather_shape(cluster, ranks, STATS_BYTES_PER_RANK)
    assert shape is not None
    assert (shape.num_ranks, shape.num_nodes, shape.max_ranks_per_node) == (4096, 512, 8)
    assert shape.num_bytes == 4096 * STATS_BYTES_PER_RANK
    device = cluster.devices[0]
    assert shape.nic_gbps == min(8 * device.flow_gbps, device.nic_gbps)
    assert world_gather_shape(cluster, ranks[:1], STATS_BYTES_PER_RANK) is None


def test_the_gather_grows_with_the_world_and_sits_before_every_optimizer_step(monkeypatch) -> None:
    """Latency-bound: at 4096 ranks at least the inter-node ring's 511 steps, far more than on 16 ranks. A plan's
    estimate and its simulation agree, and both put it between the last sync and the optimizer steps: priced at
    0 s instead, both iterations shorten by exactly its seconds."""
    large = _cluster(512)
    shape = world_gather_shape(large, np.arange(large.num_devices), STATS_BYTES_PER_RANK)
    large_s = sync_shape_s(shape, large) / 2  # a ring all-gather: the all-reduce's second half
    plan = make_plan(_cluster(2), load_model_spec("gpt3-1.3b"), 32, 2048)
    cost = CostModel.for_plan(plan)
    stats_s = cost.stats_gather_s(plan)
    assert large_s >= 511 * large.inter_node_latency_s > stats_s > 0.0
    iteration_s = estimate_plan(plan, cost).iteration_time_s
    assert simulate(plan, cost).iteration_time_s == pytest.approx(iteration_s, rel=1e-12)
    monkeypatch.setattr(CostModel, "stats_gather_s", lambda self, plan: 0.0)
    free = CostModel.for_plan(plan)
    assert estimate_plan(plan, free).iteration_time_s == pytest.approx(iteration_s - stats_s, rel=1e-12)
    assert simulate(plan, free).iteration_time_s == pytest.approx(iteration_s - stats_s, rel=1e-12)
