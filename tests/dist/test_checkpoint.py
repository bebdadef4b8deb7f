"""Training checkpoints survive plan changes, crashes mid-save and export (issue 4).

One module fixture runs every training scenario in three forked worlds (3, 2 and 4 ranks):
- pair 1 (llama-like, clipping): A = two pipelines (depth 2 + depth 1) -> B = one pipeline of depth 3 cut in
  half layers (a pipeline removed, depths and split changed, stages ending inside layers); same world size, so A, B, the uninterrupted run
  and the crash scenario share one world;
- pair 2 (gpt-like: learned positions, biases; shuffled data): A = one pipeline of depth 2 (2 ranks)
  -> B = three pipelines of depths 1, 2, 1 (4 ranks; pipelines added, layer split changed).
Each "resumed" run trains 2 steps under A, saves, and trains 2 more under B; it must equal 4
uninterrupted steps under A (parameters and AdamW state) and plain single-process PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from typer.testing import CliRunner

import ethpipe
from ethpipe.cli.app import app
from ethpipe.plan import Plan
from ethpipe.runtime.checkpoint.layout import FAIL_SAVE_ENV, InjectedSaveFailure, complete_checkpoints
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.train import TrainConfig, train

from .exactness import PARAM_ATOL, assert_params_match
from .harness import load_everything, run_ranks
from .plans import GPT_LIKE, LLAMA_LIKE, half_layer_plan, make_plan
from .reference import reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

import ethpipe.cli.commands  # noqa: E402,F401  (registers the commands on the app)

LR = 1e-3
STEPS = 4

PLAN_1A = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1)), ([(2, (0, 6))], (2, 1))])
# In half layers (``ethpipe.sublayers``): stage 0 ends after layer 2's attention, stage 1 after layer 4's.
PLAN_1B = half_layer_plan(LLAMA_LIKE, [([(0, (0, 5), False), (1, (5, 9), False), (2, (9, 12), False)], (3, 3), "1f1b")])
PLAN_2A = make_plan(GPT_LIKE, [([(0, (0, 4)), (1, (4, 6))], (4, 2))])
PLAN_2B = make_plan(GPT_LIKE, [([(0, (0, 6))], (2,)), ([(1, (0, 1)), (2, (1, 6))], (1, 1)), ([(3, (0, 6))], (2,))])


@dataclass(frozen=True)
class Pair:
    name: str
    plan_a: Plan
    plan_b: Plan
    options: dict[str, Any]  # TrainConfig fields shared by every run of the pair


PAIRS = (
    Pair("two-pipelines-to-one-deeper", PLAN_1A, PLAN_1B, {"clip_grad": 0.05}),
    Pair("one-pipeline-to-three", PLAN_2A, PLAN_2B, {"shuffle": True, "seed": 3, "weight_decay": 0.0}),
)


def _config(data: str, ckpt: Path, steps: int, options: dict[str, Any], **kw: Any) -> TrainConfig:
    return TrainConfig(data=data, steps=steps, lr=LR, progress=False, timeout_s=60.0, checkpoint_dir=str(ckpt),
                       dtype="fp64", **options, **kw)


def _run_plans(rank: int, world_size: int, jobs: list[tuple[str, Plan, TrainConfig]], out_dir: str) -> None:
    """Run each job in order on this world; the 'crash' job must die in its save (the test hook)."""
    for name, plan, config in jobs:
        if name == "crash":
            os.environ[FAIL_SAVE_ENV] = "3"
            with pytest.raises(InjectedSaveFailure):
                train(plan, config, rank, world_size)
            del os.environ[FAIL_SAVE_ENV]
            if rank == 0:
                names = sorted(p.name for p in Path(config.checkpoint_dir).iterdir())  # type: ignore[arg-type]
                Path(out_dir, "after-crash.json").write_text(json.dumps(names))
        else:
            train(plan, config, rank, world_size)


def _fresh(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("ckpt")
    rng = np.random.default_rng(0)
    words = ["checkpoints", "survive", "plan", "changes", "and", "crashes", "mid", "save", "."]
    data = str(tmp / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(words, size=3000))], data)
    p1, p2 = PAIRS
    world_3 = [
        ("uninterrupted", p1.plan_a, _config(data, tmp / "u1", STEPS, p1.options)),
        ("first-half", p1.plan_a, _config(data, tmp / "r1", 2, p1.options)),
        ("second-half", p1.plan_b, _config(data, tmp / "r1", STEPS, p1.options, resume=True)),
        ("crash", p1.plan_a, _config(data, tmp / "k1", STEPS, p1.options, save_every=1, keep=2)),
        ("after-crash", p1.plan_a, _config(data, tmp / "k1", STEPS, p1.options, save_every=1, keep=2, resume=True)),
    ]
    run_ranks(3, _run_plans, (world_3, str(tmp)), _fresh(tmp / "w3"))
    world_2 = [
        ("uninterrupted", p2.plan_a, _config(data, tmp / "u2", STEPS, p2.options)),
        ("first-half", p2.plan_a, _config(data, tmp / "r2", 2, p2.options)),
    ]
    run_ranks(2, _run_plans, (world_2, str(tmp)), _fresh(tmp / "w2"))
    run_ranks(4, _run_plans, ([("second-half", p2.plan_b, _config(data, tmp / "r2", STEPS, p2.options,
                                                                     resume=True))], str(tmp)), _fresh(tmp / "w4"))
    return {"tmp": tmp, "data": data, "after_crash": json.loads((tmp / "after-crash.json").read_text())}


def _kind(key: str) -> str:
    return key.split(".")[1] if key.startswith("optim.") else "param"


def _assert_same_training_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert set(got) == set(want), label
    assert any(k.startswith("optim.exp_avg_sq.") for k in want)
    # Each kind at PARAM_ATOL of its own scale (largest |value| of that kind): parameters ~1,
    # exp_avg ~1e-3, exp_avg_sq ~1e-6 (float64 runs; see exactness.py for why this holds on any CPU).
    scale: dict[str, float] = {}
    for key, value in want.items():
        scale[_kind(key)] = max(scale.get(_kind(key), 0.0), float(value.abs().max()))
    for key, value in want.items():
        atol = PARAM_ATOL * scale[_kind(key)]
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0, msg=lambda m, k=key: f"{label} {k}: {m}")


def _reference(pair: Pair, data: str) -> dict[str, torch.Tensor]:
    o = pair.options
    plan = pair.plan_a
    return reference_train(plan.resolve_model(), data, plan.global_batch_size, plan.seq_len, STEPS, LR,
                           weight_decay=o.get("weight_decay", 0.1), clip_grad=o.get("clip_grad", 0.0),
                           seed=o.get("seed", 0), shuffle=o.get("shuffle", False)).state


@pytest.mark.parametrize("pair_index", [0, 1], ids=[p.name for p in PAIRS])
def test_resume_under_another_plan_equals_uninterrupted(runs: dict[str, Any], pair_index: int) -> None:
    pair = PAIRS[pair_index]
    tag = "12"[pair_index]
    tmp = runs["tmp"]
    uninterrupted = load_everything(tmp / f"u{tag}" / "step-00000004")
    resumed_dir = tmp / f"r{tag}"
    assert [s for s, _ in complete_checkpoints(resumed_dir)] == [2, 4]
    resumed = load_everything(resumed_dir / "step-00000004")
    _assert_same_training_state(resumed, uninterrupted, pair.name)
    want = _reference(pair, runs["data"])  # and both equal plain PyTorch
    assert_params_match(pair.name, {k: resumed[k] for k in want}, want)
    manifest = json.loads((resumed_dir / "step-00000004" / "ethpipe.json").read_text())
    assert Plan.from_dict(manifest["plan"]) == pair.plan_b  # the plan that wrote it
    assert manifest["cursor"]["next_sample"] == STEPS * pair.plan_a.global_batch_size
    assert manifest["step"] == STEPS and manifest["model_spec"]["name"] == pair.plan_a.model


def test_kill_during_save_then_resume_equals_uninterrupted(runs: dict[str, Any]) -> None:
    tmp = runs["tmp"]
    # the crashed save of step 3 left its shards under a temporary name; steps 1 and 2 stayed complete
    assert runs["after_crash"] == [".tmp-step-00000003", "latest", "step-00000001", "step-00000002"]
    assert sorted(p.name for p in (tmp / "k1").iterdir()) == ["latest", "step-00000003", "step-00000004"]
    assert (tmp / "k1" / "latest").read_text().strip() == "step-00000004"
    resumed = load_everything(tmp / "k1" / "step-00000004")
    _assert_same_training_state(resumed, load_everything(tmp / "u1" / "step-00000004"), "kill during save")


def test_replicated_tensors_are_written_once(runs: dict[str, Any]) -> None:
    step_dir = runs["tmp"] / "u1" / "step-00000004"  # plan 1A: both pipelines hold every layer
    metadata = FileSystemReader(str(step_dir)).read_metadata()
    fqns = [index.fqn for index in metadata.storage_data]
    assert len(fqns) == len(set(fqns)), "a key was written by more than one rank"
    writers = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn.startswith("layers.")}
    assert len(writers) == 3  # load-balanced over the holders, not all on pipeline 0
    unique_bytes = sum(v.size.numel() * v.properties.dtype.itemsize for k, v in metadata.state_dict_metadata.items()
                       if not k.startswith("rng."))
    shard_bytes = sum(p.stat().st_size for p in step_dir.glob("*.distcp"))
    assert unique_bytes < shard_bytes < 1.5 * unique_bytes  # both pipelines' copies written: > 2x


def test_export_round_trips_into_build_model(runs: dict[str, Any], tmp_path: Path) -> None:
    ckpt = runs["tmp"] / "r2"  # written under plan 2B (three pipelines)
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(app, ["export", str(ckpt), "--out", str(out)])
    assert result.exit_code == 0, result.output
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(GPT_LIKE.to_dict()))
    model = ethpipe.build_model(str(spec_file))
    exported = load_file(out)
    model.load_state_dict(exported)  # strict: exactly the model's names and shapes
    saved = load_everything(ckpt / "step-00000004")
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], saved[name]), name  # bit for bit, in the run's dtype (fp64)
        assert torch.equal(value, saved[name].to(value.dtype)), name
    from ethpipe.runtime.checkpoint.consolidated import check_checkpoint

    check_checkpoint(out, GPT_LIKE)  # what `ethpipe train --init-from` checks


def test_inspect_shows_step_plan_and_cursor(runs: dict[str, Any]) -> None:
    ckpt = runs["tmp"] / "r1"
    result = CliRunner().invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["step"] == STEPS and info["next_sample"] == STEPS * PLAN_1A.global_batch_size
    assert [p["depth"] for p in info["pipelines"]] == [3] and info["world_size"] == 3
    assert info["sublayers"] == 2 and info["pipelines"][0]["layers"][0] == [[0, 5]]  # in half layers, said so
    assert info["checkpoints"] == [2, 4] and info["size_bytes"] > 0
    table = CliRunner().invoke(app, ["inspect", str(ckpt)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "next sample 24" in table.output
    assert "cpu L0-2a -> cpu L2m-4a -> cpu L4m-5" in table.output  # the plan's notation (plan_text.py)


def _one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    out = (result.stdout or "") + (result.stderr or "")
    assert result.exit_code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith("error:"), out
    return out


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_bad_checkpoints_fail_with_one_line_and_touch_nothing(runs: dict[str, Any], tmp_path: Path) -> None:
    data = runs["data"]
    plan_file = tmp_path / "plan.json"
    PLAN_1B.save(plan_file)

    def resume(ckpt: Path, plan: Path = plan_file) -> str:
        metrics = tmp_path / "m.jsonl"
        metrics.write_text("keep")
        before = _snapshot(ckpt)
        out = _one_line_error(["train", "--plan", str(plan), "--data", data, "--steps", "6", "--checkpoint-dir",
                               str(ckpt), "--resume", "--metrics", str(metrics), "--no-progress"])
        assert _snapshot(ckpt) == before and metrics.read_text() == "keep"
        return out

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(runs["tmp"] / "r1", dst)
        return dst / "step-00000004"

    wider = make_plan(dataclasses.replace(LLAMA_LIKE, ffn_hidden_size=96), [([(0, (0, 2)), (1, (2, 4)), (2, (4, 6))],
                                                                             (3, 3))])
    wider.save(tmp_path / "wider.json")
    assert "another model shape" in resume(runs["tmp"] / "r1", tmp_path / "wider.json")
    missing = copy("missing")
    (missing / "__1_0.distcp").unlink()
    assert "missing file '__1_0.distcp'" in resume(missing.parent)
    flipped = copy("flipped")
    shard = bytearray((flipped / "__0_0.distcp").read_bytes())
    shard[len(shard) // 2] ^= 0xFF  # same size, one bad byte: only the crc32 can tell
    (flipped / "__0_0.distcp").write_bytes(bytes(shard))
    assert "'__0_0.distcp' is corrupt" in resume(flipped.parent)  # found by the ranks, reported once
    assert "'__0_0.distcp' is corrupt" in _one_line_error(["export", str(flipped.parent), "--out",
                                                           str(tmp_path / "x.safetensors")])
    assert not (tmp_path / "x.safetensors").exists()
    garbage = copy("garbage")
    size = (garbage / ".metadata").stat().st_size
    (garbage / ".metadata").write_bytes(b"\0" * size)
    assert "'.metadata' is corrupt" in resume(garbage.parent)
    (garbage / "ethpipe.json").write_text("{not json")
    assert "corrupt ethpipe.json" in _one_line_error(["inspect", str(garbage.parent)])
    partial = tmp_path / "partial"
    (partial / ".tmp-step-00000002").mkdir(parents=True)
    assert "no complete checkpoint" in resume(partial)
    fresh = _one_line_error(["train", "--plan", str(plan_file), "--data", data, "--steps", "6", "--checkpoint-dir",
                             str(runs["tmp"] / "r1"), "--no-progress"])
    assert "pass --resume" in fresh  # starting over would overwrite the run's checkpoints
