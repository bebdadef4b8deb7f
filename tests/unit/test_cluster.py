import pytest

from ethpipe.cluster import cluster_from_dict, load_cluster

SPEC = {"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 200},
                  {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100}]}


def test_ranks_follow_node_order_and_links() -> None:
    c = cluster_from_dict(SPEC)
    assert c.num_devices == 20
    assert [d.node for d in c.devices[7:9]] == [0, 1]
    assert c.devices[16].gpu.id == "v100_32gb_sxm2" and c.devices[16].local_rank == 0
    assert c.link_gbps(0, 1) == c.devices[0].gpu.intra_node_gbps
    assert c.link_gbps(0, 16) == 100 / 8  # slower NIC sets the inter-node link
    assert c.gpu_types == ("a100_80gb_sxm", "v100_32gb_sxm2")


@pytest.mark.parametrize("bad, field", [
    ({"nodes": [{"gpu": "nope", "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 1}]}, "nodes.0.gpu"),
    ({"nodes": [{"gpu": "t4", "num_nodes": -1, "gpus_per_node": 1, "nic_gbit_s": 1}]}, "nodes.0.num_nodes"),
    ({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 1, "colour": 3}]}, "colour"),
    ({"nodes": []}, "nodes"),
])
def test_bad_cluster_one_line_error(bad, field) -> None:
    with pytest.raises(ValueError) as err:
        cluster_from_dict(bad)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_inline_gpu_and_overrides(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodes:\n  - gpu: {id: fast, memory_gib: 1, peak_tflops: 3.0}\n    num_nodes: 1\n"
                    "    gpus_per_node: 2\n    nic_gbit_s: 10\n    efficiency: 0.5\n")
    c = load_cluster(path)
    assert c.devices[1].gpu.id == "fast" and c.devices[1].gpu.efficiency == 0.5
    with pytest.raises(ValueError, match="not found"):
        load_cluster(tmp_path / "missing.yaml")


def test_nccl_communicators_are_kept_free_on_catalog_gpus() -> None:
    """Usable memory = 90% of the device less NCCL's communicators per rank x memory per communicator (the
    cluster's own figures, defaults from NVIDIA/nccl#964); an inline device's memory figure is the user's."""
    from ethpipe.cluster import NCCL_COMMUNICATOR_MIB, NCCL_COMMUNICATORS_PER_RANK
    from ethpipe.cost.model import CostModel
    from ethpipe.model_load import load_model_spec

    spec = load_model_spec("tiny")
    nodes = [{"gpu": "a100_40gb_sxm", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}]
    gib = 2 ** 30
    cost = CostModel(cluster_from_dict({"nodes": nodes}), spec, 64)
    nccl = int(NCCL_COMMUNICATORS_PER_RANK * NCCL_COMMUNICATOR_MIB * 2 ** 20)
    assert nccl > gib and cost.usable_memory_bytes("a100_40gb_sxm") == int(40 * gib * 0.9) - nccl
    mine = cluster_from_dict({"nodes": nodes, "nccl_communicators_per_rank": 6, "nccl_communicator_mib": 100})
    assert CostModel(mine, spec, 64).usable_memory_bytes("a100_40gb_sxm") == int(40 * gib * 0.9) - 600 * 2 ** 20
    inline = cluster_from_dict({"nodes": [{"gpu": {"id": "x", "memory_gib": 1, "peak_tflops": 1.0},
                                           "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}]})
    assert CostModel(inline, spec, 64).usable_memory_bytes("x") == int(gib * 0.9)
    with pytest.raises(ValueError, match="nccl_communicator_mib"):
        cluster_from_dict({"nodes": nodes, "nccl_communicator_mib": -1})


@pytest.mark.parametrize("doc, line", [
    ({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_nod": 8, "nic_gbit_s": 100}]},
     "cluster spec field 'nodes.0.gpus_per_nod' is not a known key: did you mean 'gpus_per_node'?"),
    ({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}],
      "inter_node_latency": 3}, "cluster spec field 'inter_node_latency' is not a known key: did you mean "
                                "'inter_node_latency_us'?"),
])
def test_a_typo_in_a_key_names_the_key_and_the_nearest_valid_one(doc, line) -> None:
    """Not "gpus_per_node: Field required", which hid the typo that caused it."""
    with pytest.raises(ValueError) as err:
        cluster_from_dict(doc)
    assert str(err.value) == line


def test_a_yaml_syntax_error_says_where(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A broken indentation said 'while parsing a block collection' and nothing about where."""
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes:\n  - gpu: a100_80gb_sxm\n   num_nodes: 1\n")
    with pytest.raises(ValueError) as err:
        load_cluster(bad)
    assert str(err.value).endswith("at line 3, column 4") and "\n" not in str(err.value)
    broken = tmp_path / "c.json"
    broken.write_text('{"nodes": [}')
    with pytest.raises(ValueError, match=r"at line 1, column 12$"):
        load_cluster(broken)
