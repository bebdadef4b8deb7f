"""`ethpipe train` end to end (a real spawned run) and its bad-input errors.

Bad input must give one line, a non-zero exit, no hung rank and no overwritten output.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ethpipe.cli.app import app
from ethpipe.errors import CRASH_DIR_ENV
import ethpipe.runtime.step as step_module
from ethpipe.runtime.start import launch
from ethpipe.runtime.checkpoint.consolidated import save_atomic
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.model.decoder import build_full_model
from ethpipe.runtime.train import TrainConfig

from .plans import GPT_LIKE, LLAMA_LIKE, make_plan

pytestmark = pytest.mark.dist

import ethpipe.cli.commands  # noqa: E402,F401  (registers the commands on the app)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    plan = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1))])
    plan.save(tmp_path / "plan.json")
    rng = np.random.default_rng(1)
    prepare_tokens([" ".join(rng.choice(["ab", "cd", "ef", "gh"], size=600))], tmp_path / "tokens.bin")
    return {"plan": tmp_path / "plan.json", "data": tmp_path / "tokens.bin", "dir": tmp_path}


def test_cli_train_spawns_locally_and_writes_outputs(files: dict[str, Path]) -> None:
    d = files["dir"]
    cmd = [sys.executable, "-m", "ethpipe", "train", "--plan", str(files["plan"]), "--data", str(files["data"]),
           "--steps", "2", "--metrics", str(d / "m.jsonl"), "--save-final", str(d / "w.safetensors"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "ethpipe train: 2 ranks on cpu, 1 pipelines, fp32 (the plan records none), 2 steps" in proc.stdout
    lines = [json.loads(x) for x in (d / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]  # 1-based, as the console and the checkpoint folders
    assert {"loss", "tokens_per_s", "iteration_time_s", "pipeline_compute_s", "pipeline_idle_s",
            "grad_sync_exposed_s", "grad_norm", "lr"} <= set(lines[0])
    weights = load_file(d / "w.safetensors")
    full = build_full_model(LLAMA_LIKE).state_dict()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in full.items()}
    assert not torch.equal(weights["layers.4.attn.wq.weight"], full["layers.4.attn.wq.weight"])  # it trained


def _run_cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args)
    return result.exit_code, (result.stdout or "") + (result.stderr or "")


def _bad(files: dict[str, Path], extra: list[str], plan: Path | None = None, data: Path | None = None) -> str:
    """Run a bad command; check exit 2, one line, and that existing outputs were not touched."""
    d = files["dir"]
    for name in ("m.jsonl", "w.safetensors"):
        (d / name).write_text("keep")
    args = ["train", "--plan", str(plan or files["plan"]), "--data", str(data or files["data"]),
            "--metrics", str(d / "m.jsonl"), "--save-final", str(d / "w.safetensors"), "--no-progress", *extra]
    code, out = _run_cli(args)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith("error:"), out
    assert (d / "m.jsonl").read_text() == "keep" and (d / "w.safetensors").read_text() == "keep"
    return out


def test_bad_inputs_give_one_line_and_touch_nothing(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    d = files["dir"]
    assert "--steps" in _bad(files, ["--steps", "100"])
    prepare_tokens(["x" * 200], d / "wide.bin")  # byte 'x' = 120 > vocab 64
    small_vocab = make_plan(dataclasses.replace(LLAMA_LIKE, vocab_size=64), [([(0, (0, 3)), (1, (3, 6))], (2, 1))])
    small_vocab.save(d / "small_vocab.json")
    assert "vocab_size is 64" in _bad(files, ["--steps", "1"], plan=d / "small_vocab.json", data=d / "wide.bin")
    save_atomic(build_full_model(GPT_LIKE).state_dict(), d / "other.safetensors")
    assert "--init-from" in _bad(files, ["--steps", "1", "--init-from", str(d / "other.safetensors")])
    tp_plan = json.loads(files["plan"].read_text())
    tp_plan["pipelines"][0]["stages"][1].update(ranks=[1, 2, 3, 4], tp=4)  # GQA: 2 KV heads cannot split 4 ways
    tp_plan["blocks"][1]["ranks"] = [1, 2, 3, 4]
    (d / "tp.json").write_text(json.dumps(tp_plan))
    assert "has 2 KV heads, fewer than tp=4" in _bad(files, ["--steps", "1"], plan=d / "tp.json")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert "needs 2 ranks but the world has 3" in _bad(files, ["--steps", "1"])


@pytest.mark.timeout(120)  # a hang (ranks left waiting on the failed one) fails here
def test_crash_on_one_rank_ends_every_rank_and_keeps_its_traceback(files: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    real_build = step_module.build_stage

    def failing_build(spec, layers, first, last, **kw):  # type: ignore[no-untyped-def]
        if not first:
            raise RuntimeError("injected failure on the last stage")
        return real_build(spec, layers, first, last, **kw)

    monkeypatch.setattr(step_module, "build_stage", failing_build)  # inherited by the forked ranks
    monkeypatch.setenv(CRASH_DIR_ENV, str(files["dir"] / "crashes"))
    plan = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1))])
    config = TrainConfig(data=str(files["data"]), steps=1, progress=False, timeout_s=600.0)
    with pytest.raises(launch.TrainingFailed) as info, caplog.at_level(logging.WARNING):
        launch.run_local(plan, config)  # returns long before the 600 s collective timeout: the launcher ends rank 0
    assert "Terminating process" not in caplog.text  # torch's line per ended rank: ours says why, once
    message, report = str(info.value), info.value.report
    assert len(message.splitlines()) == 1 and "rank 1" in message and "injected failure" in message, message
    assert report is not None and str(report) in message and report.parent == files["dir"] / "crashes"
    kept = report.read_text()  # outlives the run's temporary directory
    assert "Traceback" in kept and "in failing_build" in kept and "RuntimeError: injected failure" in kept


def test_torchrun_launch_trains_in_the_plans_bf16(files: dict[str, Path]) -> None:
    """A plan made for bf16 trains in bf16 without --dtype (and says so once, from rank 0)."""
    d = files["dir"]
    make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1))], extra={"dtype": "bf16"}).save(d / "bf16.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ethpipe", "train",
           "--plan", str(d / "bf16.json"), "--data", str(files["data"]), "--steps", "2",
           "--recompute", "--metrics", str(d / "m.jsonl"), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ethpipe train: 2 ranks on cpu, 1 pipelines, bf16 (the plan's), 2 steps") == 1, proc.stdout
    losses = [json.loads(x)["loss"] for x in (d / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses)) and abs(losses[0] - np.log(256)) < 0.5


def test_run_toml_repeats_a_run_exactly_and_dashboards_get_its_scalars(files: dict[str, Path]) -> None:
    """A piped run with --log-every, --tensorboard and --wandb (offline) writes run.toml beside its checkpoints;
    `train --config ckpt/run.toml` with other outputs repeats it: the same losses, bit for bit, and its TensorBoard
    run goes into a folder of its own beside the first run's (run.toml names the same --tensorboard root)."""
    d = files["dir"]
    prepare_tokens([" ".join(["held", "out", "words", "."] * 600)], d / "val.bin")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_DIR": str(d), "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    first = [sys.executable, "-m", "ethpipe", "train", "--plan", str(files["plan"]), "--data", str(files["data"]),
             "--steps", "3", "--lr", "2e-3", "--clip-grad", "1.0", "--shuffle", "--metrics", str(d / "a.jsonl"),
             "--checkpoint-dir", str(d / "ckpt"), "--log-every", "1", "--tensorboard", str(d / "tb"),
             "--wandb", "ethpipe-test", "--val-data", str(d / "val.bin"), "--eval-every", "2", "--eval-batches", "1"]
    proc = subprocess.run(first, capture_output=True, text=True, timeout=120, env=env)  # piped: not a terminal
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    config = (d / "ckpt" / "run.toml").read_text()
    assert 'lr = 0.002' in config and "shuffle = true" in config and "log-every = 1" in config
    again = [sys.executable, "-m", "ethpipe", "train", "--config", str(d / "ckpt" / "run.toml"),
             "--metrics", str(d / "b.jsonl"), "--checkpoint-dir", str(d / "ckpt2")]
    proc = subprocess.run(again, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    runs = [[json.loads(x) for x in (d / name).read_text().splitlines()] for name in ("a.jsonl", "b.jsonl")]
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]] and len(runs[0]) == 3
    assert [r["grad_norm"] for r in runs[0]] == [r["grad_norm"] for r in runs[1]]
    assert all(len(r["peak_memory_bytes"]) == 2 and min(r["peak_memory_bytes"]) > 0 for r in runs[0])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    boards = sorted((d / "tb").iterdir())
    assert [b.name.startswith("run-") for b in boards] == [True, True], boards  # one TensorBoard run per run
    for board in boards:
        acc = EventAccumulator(str(board), size_guidance={"scalars": 0})
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]  # 1-based, as the console counts
    acc = EventAccumulator(str(boards[0]), size_guidance={"scalars": 0})
    acc.Reload()
    logged = acc.Scalars("train/loss")
    assert [e.step for e in logged] == [r["step"] for r in runs[0]]
    assert [e.value for e in logged] == pytest.approx([r["loss"] for r in runs[0]], rel=1e-6)  # kept as float32
    assert {"train/tokens_per_s", "train/grad_norm", "pipeline/0/idle_s", "sync/exposed_s",
            "memory/rank_1/peak_gib", "val/loss"} <= set(acc.Tags()["scalars"])
    validated = [r for r in runs[0] if "val_loss" in r]
    assert [e.step for e in acc.Scalars("val/loss")] == [r["step"] for r in validated] == [2, 3]  # every 2, the last
    assert [r["val_loss"] for r in validated] == [r["val_loss"] for r in runs[1] if "val_loss" in r]
    assert len(list((d / "wandb").glob("offline-run-*/run-*.wandb"))) == 2  # run.toml carries --wandb too
