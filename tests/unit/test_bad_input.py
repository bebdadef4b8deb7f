"""Property-based bad input (hypothesis): cluster specs, model specs, plans and CLI arguments.

Whatever the input, the user sees one line and a non-zero exit, never a traceback, and a bad
plan is rejected before any process starts. Examples are few and derandomized (CI must not flake).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.cluster import cluster_from_dict
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec, spec_from_dict
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.start import launch
from ethpipe.tokens.texts import prepare_tokens

FAST = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
SPEC = ModelSpec(name="bad-input", num_layers=4, hidden_size=16, num_heads=2, num_kv_heads=2, ffn_hidden_size=32,
                 vocab_size=64, max_seq_len=16)
PIPES = (Pipeline((Stage((0,), "cpu", (0, 2)), Stage((1,), "cpu", (2, 4))), (2, 1)),
         Pipeline((Stage((2,), "cpu", (0, 4)),), (3,)))
GOOD_PLAN = Plan("custom", SPEC.name, 6, 8, PIPES, compute_blocks(PIPES), SPEC).to_dict()
GOOD_CLUSTER = {"nodes": [{"gpu": "a100-80gb", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}]}

junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=True), st.text(max_size=6),
                 st.lists(st.integers(-2, 8), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """The base document with one to three leaves replaced by junk or deleted."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(junk)
    return doc


def _only_value_errors(fn: Any, doc: Any) -> None:
    """Bad documents raise UserError (one line); a plain ValueError would be a bug reported as bad input."""
    try:
        fn(doc)
    except UserError as err:
        assert str(err) and len(str(err).splitlines()) == 1, str(err)


@FAST
@given(mutated(GOOD_CLUSTER))
def test_cluster_specs_fail_with_one_line(doc: dict[str, Any]) -> None:
    _only_value_errors(cluster_from_dict, doc)


@FAST
@given(mutated(SPEC.to_dict()))
def test_model_specs_fail_with_one_line(doc: dict[str, Any]) -> None:
    _only_value_errors(spec_from_dict, doc)


@FAST
@given(mutated(GOOD_PLAN))
def test_plans_fail_with_one_line(doc: dict[str, Any]) -> None:
    _only_value_errors(Plan.from_dict, doc)


def _inconsistent(kind: str) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD_PLAN)
    if kind == "overlapping ranks":
        doc["pipelines"][1]["stages"][0]["ranks"] = [1]
    elif kind == "gap in layers":
        doc["pipelines"][0]["stages"][1]["layers"] = [3, 4]
    elif kind == "samples not summing":
        doc["pipelines"][1]["micro_batch_sizes"] = [2]
    elif kind == "blocks not matching stages":
        doc["blocks"] = [{"layers": [0, 4], "ranks": [0, 2]}]
    elif kind == "rank gap":
        doc["pipelines"][1]["stages"][0]["ranks"] = [5]
    return doc


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(launch.mp, "start_processes", refuse)


def _cli(args: list[str]) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(app, args)
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, (result.stdout or "") + (result.stderr or ""), exc


@pytest.mark.parametrize("kind", ["overlapping ranks", "gap in layers", "samples not summing",
                                  "blocks not matching stages", "rank gap"])
def test_hand_edited_inconsistent_plans_are_rejected_before_any_process(kind: str, tmp_path: Path,
                                                                        no_spawn: None) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_inconsistent(kind)))
    (tmp_path / "t.bin").write_bytes(b"\0\0" * 400)
    code, out, exc = _cli(["train", "--plan", str(plan), "--data", str(tmp_path / "t.bin"), "--steps", "1",
                           "--no-progress"])
    assert exc is None and code == 2 and len(out.strip().splitlines()) == 1 and out.startswith("error:"), out


text_arg = st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=12).filter(
    lambda s: not s.startswith("-"))


@FAST
@given(rebalance=text_arg, slowdown=text_arg)
def test_train_arguments_fail_with_one_line_before_any_process(rebalance: str, slowdown: str, tmp_path: Path,
                                                               no_spawn: None) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GOOD_PLAN))
    args = ["train", "--plan", str(plan), "--data", str(tmp_path / "missing.bin"), "--steps", "1", "--no-progress",
            "--emulate", "--rebalance", rebalance, "--emulate-slowdown", slowdown]
    code, out, exc = _cli(args)
    assert exc is None, repr(exc)
    assert code == 2 and len(out.strip().splitlines()) == 1 and out.startswith("error:"), out


@FAST
@given(doc=mutated(GOOD_CLUSTER))
def test_replan_with_bad_clusters_gives_one_line(doc: dict[str, Any], tmp_path: Path) -> None:
    plan, cluster = tmp_path / "plan.json", tmp_path / "cluster.json"
    plan.write_text(json.dumps(GOOD_PLAN))
    cluster.write_text(json.dumps(doc))
    code, out, exc = _cli(["replan", "--plan", str(plan), "--cluster", str(cluster)])
    assert exc is None, repr(exc)
    assert "Traceback" not in out
    assert code == 0 or (code == 2 and len(out.strip().splitlines()) == 1 and out.startswith("error:")), out


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_any_process(tmp_path: Path, no_spawn: None) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GOOD_PLAN))
    prepare_tokens(["a checkpoint directory that is a file " * 40], tmp_path / "t.bin")
    (tmp_path / "ckpt").write_text("not a directory")
    code, out, exc = _cli(["train", "--plan", str(plan), "--data", str(tmp_path / "t.bin"), "--steps", "1",
                           "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert exc is None and code == 2 and out.strip().splitlines() == [
        f"error: --checkpoint-dir '{tmp_path / 'ckpt'}' is a file, not a directory: give a directory (it is "
        "created if missing)"], out


def test_a_failed_run_prints_its_cause_verbatim_even_when_it_looks_like_markup(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo's messages hold '[/__w/pytorch/...pair.cc:537]': printed as rich markup they crashed the reporter."""
    from ethpipe.runtime.start.launch import TrainingFailed

    message = "rank 1 crashed: RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:537] Connection closed [/b]"

    def failing(*_: Any, **__: Any) -> None:
        raise TrainingFailed(message)

    monkeypatch.setattr(launch, "run_local", failing)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GOOD_PLAN))
    prepare_tokens(["markup in a message " * 40], tmp_path / "t.bin")
    code, out, exc = _cli(["train", "--plan", str(plan), "--data", str(tmp_path / "t.bin"), "--steps", "1",
                           "--no-progress"])
    assert exc is None and code == 1 and out.strip() == f"error: {message}", out


def test_a_gpu_plan_on_a_machine_without_gpus_is_refused_unless_asked() -> None:
    """One CPU process per rank of a GPU plan would exhaust the host: refused, with the ways to go on."""
    from ethpipe.runtime.config import TrainConfig
    from ethpipe.runtime.start.launch import check_local_devices

    cluster = {"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 3, "nic_gbit_s": 100}]}
    plan = Plan.from_dict({**GOOD_PLAN, "pipelines": [
        {**p, "stages": [{**s, "device": "a100_80gb_sxm"} for s in p["stages"]]} for p in GOOD_PLAN["pipelines"]],
        "cluster": cluster})
    with pytest.raises(UserError) as err:
        check_local_devices(plan, TrainConfig(data="x", steps=1), has_accelerator=False)
    assert str(err.value) == ("the plan runs on a100_80gb_sxm but this machine has no GPU: start it where those GPUs "
                              "are (`ethpipe launch`), or pass --emulate to emulate them here, or --device cpu to run "
                              "its 3 ranks as CPU processes anyway")
    check_local_devices(plan, TrainConfig(data="x", steps=1), has_accelerator=True)
    check_local_devices(plan, TrainConfig(data="x", steps=1, emulate=True), has_accelerator=False)
    check_local_devices(plan, TrainConfig(data="x", steps=1, device="cpu"), has_accelerator=False)
    check_local_devices(Plan.from_dict(GOOD_PLAN), TrainConfig(data="x", steps=1), has_accelerator=False)  # "cpu": no GPU


def test_device_cuda_without_one_is_refused_in_one_line(tmp_path: Path, no_spawn: None) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: --device cuda is valid here")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(GOOD_PLAN))
    code, out, exc = _cli(["train", "--plan", str(plan), "--data", str(tmp_path / "t.bin"), "--steps", "1",
                           "--no-progress", "--device", "cuda"])
    assert exc is None and code == 2 and out.strip().splitlines() == [
        "error: --device cuda: this machine has no CUDA device; train where the GPUs are, or use --device cpu"], out
