"""`ethpipe train` trains in the precision the plan was made for, and re-checks memory for another one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.cluster import cluster_from_dict
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.precision import check_dtype_fits, train_dtype
from ethpipe.tokens.texts import prepare_tokens


@pytest.fixture(scope="module")
def tight_bf16_plan():  # type: ignore[no-untyped-def]
    """llama2-7b on 8 A100-40GB at 4096 tokens without recompute: fits in bf16, not in fp32."""
    cluster = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 1, "gpus_per_node": 8,
                                            "nic_gbit_s": 100}]})
    return make_plan(cluster, load_model_spec("llama2-7b"), 32, 4096, recompute="never")


def test_the_run_takes_the_plans_precision_unless_told(tight_bf16_plan) -> None:  # type: ignore[no-untyped-def]
    assert tight_bf16_plan.extra["dtype"] == "bf16"
    assert train_dtype(tight_bf16_plan, None) == "bf16"
    assert train_dtype(tight_bf16_plan, "fp16") == "fp16"
    bare = dataclasses.replace(tight_bf16_plan, extra={})
    assert train_dtype(bare, None) == "fp32"  # a hand-written plan that records none


def test_another_precision_that_no_longer_fits_is_refused_naming_device_and_bytes(tight_bf16_plan) -> None:  # type: ignore[no-untyped-def]
    check_dtype_fits(tight_bf16_plan, "bf16")
    check_dtype_fits(tight_bf16_plan, "fp16")  # the same bytes
    check_dtype_fits(tight_bf16_plan, "fp64")  # the CPU exactness mode has no catalog pricing
    with pytest.raises(UserError) as err:
        check_dtype_fits(tight_bf16_plan, "fp32")
    text = str(err.value)
    assert text.startswith("--dtype fp32: stage 0 of pipeline 0 on a100_40gb_sxm would need ")
    # 90% of 40 GiB less NCCL's communicators (4 x 656 MiB, cluster.NCCL_*): 33.4 GiB
    assert "bytes) more than its 33.4 GiB usable (the plan was made for bf16)" in text
    assert "`ethpipe plan --dtype fp32`" in text


def test_the_cli_refuses_it_in_one_line_before_starting_anything(tight_bf16_plan, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tight_bf16_plan.save(tmp_path / "plan.json")
    prepare_tokens(["tokens " * 200], tmp_path / "t.bin")
    args = ["train", "--plan", str(tmp_path / "plan.json"), "--data", str(tmp_path / "t.bin"), "--steps", "1"]
    result = CliRunner().invoke(app, [*args, "--dtype", "fp32"])
    out = (result.stdout or "") + (result.stderr or "")
    assert result.exit_code == 2 and len(out.strip().splitlines()) == 1 and "--dtype fp32: stage 0" in out, out
