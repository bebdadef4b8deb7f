"""ETH's space contains both baselines' spaces, so in one cost model ETH must never predict slower."""

import random

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.model_load import load_model_spec
from ethpipe.errors import Infeasible
from ethpipe.planner import make_plan

GPUS = [("h100_sxm", 3200), ("a100_80gb_sxm", 1600), ("a100_40gb_sxm", 1600), ("v100_32gb_sxm2", 800), ("t4", 200)]
MODELS = {"gpt3-1.3b": 2048, "llama2-7b": 2048, "tiny": 256}


def _case(seed: int) -> tuple[dict, str, int]:
    rng = random.Random(seed)
    gpus_per_node = rng.choice([2, 4])
    nodes = [{"gpu": g, "num_nodes": rng.randint(1, 2), "gpus_per_node": gpus_per_node, "nic_gbit_s": nic}
             for g, nic in rng.sample(GPUS, rng.randint(2, 3))]
    num_devices = sum(n["num_nodes"] * gpus_per_node for n in nodes)
    model = rng.choice(list(MODELS))
    return {"nodes": nodes}, model, rng.choice([num_devices, 2 * num_devices, rng.randint(num_devices, 128)])


@pytest.mark.parametrize("seed", range(10))
def test_eth_at_least_as_fast_as_both_baselines(seed: int) -> None:
    cluster_dict, model, batch = _case(seed)
    cluster, spec, seq = cluster_from_dict(cluster_dict), load_model_spec(model), MODELS[model]
    baselines = {}
    for method in ("layer-balanced", "uniform"):
        try:
            baselines[method] = make_plan(cluster, spec, batch, seq, method)
        except Infeasible:
            pass  # e.g. the model fits no replicated mixed shape, or no equal-layer split; ETH may still plan
    assert baselines, f"both baselines infeasible: the case proves nothing ({cluster_dict}, {model}, {batch})"
    eth_s = make_plan(cluster, spec, batch, seq).predicted["iteration_time_s"]
    for method, plan in baselines.items():
        assert eth_s <= plan.predicted["iteration_time_s"] * (1 + 1e-9), (method, cluster_dict, model, batch)


def test_eth_beats_layer_balanced_where_sync_dominates() -> None:
    # One sample per GPU on 4 types: the previous search lost here (0.65x); ETH now searches the
    # replicated space too and balances data on top of it.
    cluster = cluster_from_dict({"nodes": [
        {"gpu": g, "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": nic} for g, nic in GPUS[:4]]})
    spec = load_model_spec("gpt3-1.3b")
    eth = make_plan(cluster, spec, 32, 2048)
    lb = make_plan(cluster, spec, 32, 2048, "layer-balanced")
    assert eth.predicted["iteration_time_s"] <= lb.predicted["iteration_time_s"] * (1 + 1e-9)
