"""`ethpipe profile` on the tiny model with tiny repeats: format, monotone work, the cost-model seam."""

from __future__ import annotations

from pathlib import Path

import pytest

from ethpipe.cost.profile import LAYER_KINDS, load_profile
from ethpipe.model_load import load_model_spec
from ethpipe.profiler import ProfileSettings, profile_model


@pytest.fixture(scope="module")
def tiny_profile():  # noqa: ANN201
    settings = ProfileSettings(seq_len=32, micro_batch_sizes=(1, 4), repeats=2, warmup=1)
    return profile_model(load_model_spec("tiny"), settings)


def test_profile_has_every_kind_and_size(tiny_profile) -> None:  # noqa: ANN001
    assert set(tiny_profile.layers) == set(LAYER_KINDS)
    for kind in LAYER_KINDS:
        assert set(tiny_profile.layers[kind]) == {1, 4}
        for timing in tiny_profile.layers[kind].values():
            assert timing.fwd_s > 0 and timing.bwd_s > 0
    assert tiny_profile.device_kind == "cpu" and tiny_profile.device_name.startswith("cpu: ")
    assert tiny_profile.seq_len == 32 and tiny_profile.model["name"] == "tiny"
    assert 0 < tiny_profile.optimizer_s_per_param < 1e-5


def test_saved_activation_bytes_scale_with_micro_batch(tiny_profile) -> None:  # noqa: ANN001
    spec = load_model_spec("tiny")
    block = tiny_profile.peak_memory_bytes["block"]
    # saved tensors are per-sample (plus the shared RoPE tables); parameters are not counted
    assert 3.9 * block[1] < block[4] <= 4 * block[1]
    assert block[1] >= 32 * spec.hidden_size * 4 * 4  # at least a handful of fp32 (s, h) tensors
    assert tiny_profile.peak_memory_bytes["embedding"][1] == 32 * 8  # the int64 token ids


def test_profile_round_trips_and_feeds_the_cost_model(tiny_profile, tmp_path: Path) -> None:  # noqa: ANN001
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost.model import CostModel
    from ethpipe.plan import Stage

    path = tmp_path / "p.json"
    tiny_profile.save(path)
    back = load_profile(path)
    assert back.layers == tiny_profile.layers and back.peak_memory_bytes == tiny_profile.peak_memory_bytes
    cluster = cluster_from_dict({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 2,
                                            "nic_gbit_s": 100}]})
    cost = CostModel(cluster, load_model_spec("tiny"), 32, profiles={"a100_80gb_sxm": back})
    fwd, bwd = cost.stage_compute_s(Stage((0,), "a100_80gb_sxm", (0, 2)), 4, first=False, last=False)
    block = back.layers["block"][4]
    assert fwd == pytest.approx(2 * block.fwd_s) and bwd == pytest.approx(2 * block.bwd_s)


def test_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="micro-batch-sizes"):
        ProfileSettings(seq_len=8, micro_batch_sizes=(0,))
    with pytest.raises(ValueError, match="--dtype"):
        ProfileSettings(seq_len=8, micro_batch_sizes=(1,), dtype="int8")
    with pytest.raises(ValueError, match="seq-len"):
        profile_model(load_model_spec("tiny"), ProfileSettings(seq_len=10_000, micro_batch_sizes=(1,)))
    with pytest.raises(ValueError, match="--attention must be one of auto, materialised"):
        ProfileSettings(seq_len=8, micro_batch_sizes=(1,), attention="flash")


def test_profile_records_the_kernel_modes_it_ran_with(tiny_profile) -> None:  # noqa: ANN001
    """CPU: no TF32 to speak of (None), and nothing switched SDPA off its own pick, so that is recorded even
    when materialised attention was asked for (only CUDA has the backends to switch)."""
    assert tiny_profile.tf32 is None and tiny_profile.attention == "auto"
    asked = profile_model(load_model_spec("tiny"), ProfileSettings(seq_len=32, micro_batch_sizes=(1,), repeats=1,
                                                                    warmup=0, attention="materialised"))
    assert asked.attention == "auto"


def test_a_profile_from_before_16_bit_rope_is_priced_as_the_runtime_it_measured(tiny_profile) -> None:  # noqa: ANN001
    """A profile written before RoPE rotated in the compute dtype (no ``rope`` field) measured the runtime that
    widened q and k to fp32: it is read as ``ethpipe_fp32_rope``, whose 16-bit RoPE moves 48 / 56 bytes per element
    forward / backward (the backward with its layout copy) against this runtime's 18 / 24, the rest of the block
    the same; a new profile round-trips as ``ethpipe``."""
    from ethpipe.cost.elementwise import block_elementwise
    from ethpipe.cost.profile import profile_from_dict

    data = tiny_profile.to_dict()
    assert profile_from_dict(data).layer_code == "ethpipe"
    del data["rope"]
    assert profile_from_dict(data).layer_code == "ethpipe_fp32_rope"
    spec = load_model_spec("llama2-7b")
    for backward, (old, new) in ((False, (48, 18)), (True, (56, 24))):
        per_elem = {code: block_elementwise(code, spec, 1, 1, 2, 2, backward)["rope"] / (spec.q_dim + spec.kv_dim)
                    for code in ("ethpipe_fp32_rope", "ethpipe")}
        assert per_elem == {"ethpipe_fp32_rope": old, "ethpipe": new}
        rest = {code: {k: v for k, v in block_elementwise(code, spec, 1, 1, 2, 2, backward).items() if k != "rope"}
                for code in ("ethpipe_fp32_rope", "ethpipe")}
        assert rest["ethpipe_fp32_rope"] == rest["ethpipe"]
