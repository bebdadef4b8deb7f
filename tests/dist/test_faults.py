"""Fault injection (CPU, gloo): every fault ends in automatic recovery or one clear line, never a hang,
and the last good checkpoint reproduces the next steps of plain single-process PyTorch.

Faults are pinpointed with the TEST-ONLY hooks of ``ethpipe.runtime.adapt.fault_hooks`` (env vars, set
before the ranks fork). Each test records a row of the fault table (tests/dist/fault_table.py);
``ETHPIPE_WRITE_FAULT_TABLE=1`` writes it into docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.runtime.checkpoint.layout import complete_checkpoints
from ethpipe.runtime.data import step_sample_ids
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.runtime.adapt.fault_hooks import ENOSPC_ENV, HANG_ENV, KILL_ENV
from ethpipe.runtime.start.launch import TrainingFailed, run_local
from ethpipe.runtime.train import TrainConfig

from . import fault_table
from .exactness import PARAM_ATOL, assert_matches_reference
from .plans import LLAMA_LIKE, make_plan
from .reference import ReferenceRun, reference_train

pytestmark = [pytest.mark.dist, pytest.mark.exactness]

STEPS, LR, BATCH = 4, 1e-3, 6
PLAN = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2, 1)), ([(2, (0, 6))], (2, 1))])
ROWS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("faults")
    rng = np.random.default_rng(5)
    data = str(tmp / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["faults", "never", "lose", "a", "sample", "."], size=3000))], data)
    PLAN.save(tmp / "plan.json")
    ref = reference_train(LLAMA_LIKE, data, BATCH, PLAN.seq_len, STEPS + 2, LR, weight_decay=0.1, clip_grad=0.0, seed=0)
    yield {"tmp": tmp, "data": data, "ref": ref, "plan": tmp / "plan.json"}
    fault_table.publish(ROWS)


def _config(env: dict[str, Any], ckpt: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(data=env["data"], steps=STEPS, lr=LR, progress=False, timeout_s=30.0,
                                checkpoint_dir=str(ckpt), save_every=1, keep=10, dtype="fp64")
    return TrainConfig(**{**base, **kw})


@contextmanager
def _env_var(name: str, value: str) -> Iterator[None]:
    os.environ[name] = value
    try:
        yield
    finally:
        del os.environ[name]


def _fail(config: TrainConfig, var: str, value: str) -> tuple[str, float]:
    """Run with a fault armed; it must fail with one line. Returns (message, seconds)."""
    start = time.monotonic()
    with _env_var(var, value), pytest.raises(TrainingFailed) as info:
        run_local(PLAN, config)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    return message, time.monotonic() - start


def _resume_and_check(env: dict[str, Any], ckpt: Path, from_step: int) -> tuple[float, float]:
    """Resume from the newest complete checkpoint; the next steps and the end state must equal PyTorch's."""
    assert complete_checkpoints(ckpt)[-1][0] == from_step
    final = env["tmp"] / f"final-{ckpt.name}.safetensors"
    start = time.monotonic()
    records = run_local(PLAN, _config(env, ckpt, auto_resume=True, save_final=str(final)))
    took_s = time.monotonic() - start
    ref: ReferenceRun = env["ref"]
    assert [r["step"] - 1 for r in records] == list(range(from_step, STEPS))  # record steps count from 1
    assert [r["samples"] for r in records] == [[BATCH * s, BATCH * (s + 1)] for s in range(from_step, STEPS)]
    ref_end = reference_train(LLAMA_LIKE, env["data"], BATCH, PLAN.seq_len, STEPS, LR, weight_decay=0.1,
                              clip_grad=0.0, seed=0)
    assert_matches_reference(f"resumed from step {from_step}", load_file(final), records, ref_end, from_step)
    worst = max(abs(r["loss"] - want) for r, want in zip(records, ref.losses[from_step:STEPS]))
    return took_s, worst


def _row(fault: str, how: str, outcome: str, message: str, failed_s: float, resume_s: float | None,
         from_step: int | None, worst: float | None) -> None:
    reproduced = (f"steps {from_step}..{STEPS - 1} from step-{from_step}: max |loss - PyTorch| {worst:.1e}; "
                  f"final params equal (fp64, atol {PARAM_ATOL:.0e})") if worst is not None else "n/a"
    ROWS.append({"fault": fault, "injected by": how, "outcome": outcome, "error line / recovery": message,
                 "detected after s": f"{failed_s:.1f}" + (f" (resume run {resume_s:.1f} s)" if resume_s else ""),
                 "next steps reproduced": reproduced})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank,point,step", [(1, "forward", 2), (2, "allreduce", 2), (0, "save", 3)],
                         ids=["mid-step", "mid-allreduce", "mid-checkpoint-write"])
def test_sigkill_stops_with_one_line_and_last_checkpoint_reproduces(env: dict[str, Any], rank: int, point: str,
                                                                    step: int) -> None:
    ckpt = env["tmp"] / f"kill-{point}"
    message, failed_s = _fail(_config(env, ckpt), KILL_ENV, f"{rank}:{point}@{step}")
    assert f"rank {rank} was killed by SIGKILL" in message
    names = sorted(p.name for p in ckpt.iterdir())
    if point == "save":  # the killed save left only its temporary directory; `latest` still names step 2
        assert ".tmp-step-00000003" in names and (ckpt / "latest").read_text().strip() == "step-00000002"
    last_good = complete_checkpoints(ckpt)[-1][0]
    assert last_good == 2  # steps 0 and 1 were committed; step 2 (or its save) was cut
    resume_s, worst = _resume_and_check(env, ckpt, last_good)
    _row(f"SIGKILL rank {rank} {'mid-checkpoint-write' if point == 'save' else 'mid-' + point} (step {step})",
         f"`{KILL_ENV}={rank}:{point}@{step}`", "stops; resumed by `--auto-resume`", message, failed_s, resume_s,
         last_good, worst)


@pytest.mark.timeout(120)
def test_corrupt_checkpoint_is_refused_and_the_previous_one_reproduces(env: dict[str, Any], tmp_path: Path) -> None:
    ckpt = env["tmp"] / "corrupt"
    start = time.monotonic()
    run_local(PLAN, _config(env, ckpt, steps=3))
    newest = ckpt / "step-00000003"
    shard = newest / "__2_0.distcp"
    payload = bytearray(shard.read_bytes())
    payload[len(payload) // 2] ^= 0xFF  # same size, one flipped byte
    shard.write_bytes(bytes(payload))
    result = CliRunner().invoke(app, ["train", "--plan", str(env["plan"]), "--data", env["data"], "--steps",
                                      str(STEPS), "--checkpoint-dir", str(ckpt), "--resume", "--no-progress"])
    out = (result.stdout or "") + (result.stderr or "")
    failed_s = time.monotonic() - start
    assert result.exit_code == 2 and len(out.strip().splitlines()) == 1 and "'__2_0.distcp' is corrupt" in out, out
    shutil.rmtree(newest)  # what the message tells the user to do
    resume_s, worst = _resume_and_check(env, ckpt, 2)
    _row("corrupt checkpoint shard (one flipped byte)", "test flips a byte of `step-3/__2_0.distcp`",
         "refused before training (exit 2); older checkpoint resumes", out.strip(), failed_s, resume_s, 2, worst)


def _mount_tmpfs(path: Path, size_bytes: int) -> bool:
    path.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                          capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.timeout(120)
def test_disk_full_during_save_stops_cleanly(env: dict[str, Any], tmp_path: Path) -> None:
    probe = env["tmp"] / "probe"
    run_local(PLAN, _config(env, probe, steps=1))
    one_ckpt_bytes = sum(p.stat().st_size for p in (probe / "step-00000001").iterdir())
    small = tmp_path / "small"
    mounted = _mount_tmpfs(small, int(one_ckpt_bytes * 1.6) // 4096 * 4096 + 4096)  # room for one save, not two
    try:
        config = _config(env, small)
        if mounted:
            start = time.monotonic()
            with pytest.raises(TrainingFailed) as info:
                run_local(PLAN, config)
            message, failed_s, how = str(info.value), time.monotonic() - start, "size-limited tmpfs (`mount -t tmpfs`)"
        else:
            message, failed_s = _fail(config, ENOSPC_ENV, "2")
            how = f"`{ENOSPC_ENV}=2` (no tmpfs: not root)"
        assert len(message.splitlines()) == 1 and "No space left on device" in message, message
        assert "could not" in message and "previous checkpoint is intact" in message
        assert [s for s, _ in complete_checkpoints(small)] == [1]
        good = tmp_path / "good"
        shutil.copytree(small, good)
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], timeout=30, check=False)
    resume_s, worst = _resume_and_check(env, good, 1)
    _row("disk full during checkpoint save (step 2)", how, "stops with one line; step-1 stays valid and resumes",
         message, failed_s, resume_s, 1, worst)


@pytest.mark.timeout(60)
def test_watchdog_ends_a_job_whose_ranks_all_hang(env: dict[str, Any]) -> None:
    message, failed_s = _fail(_config(env, env["tmp"] / "hang", watchdog_s=2.0, timeout_s=600.0), HANG_ENV, "*@1")
    assert "watchdog" in message and failed_s < 60  # far below the 600 s collective timeout
    _row("every rank hangs outside any collective (step 1)", f"`{HANG_ENV}=*@1`, `--watchdog-s 2`",
         "watchdog ends the ranks; stops with one line", message, failed_s, None, None, None)


def _torchrun(env: dict[str, Any], nproc: int, args: list[str], extra_env: dict[str, str]) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", "-m", "ethpipe", "train", "--data", env["data"], "--no-progress",
           "--timeout-s", "30", "--lr", str(LR), "--dtype", "fp64", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **extra_env})
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_restarts_after_sigkill_then_replans_for_a_smaller_world(env: dict[str, Any]) -> None:
    """A rank is SIGKILLed mid-step; torchrun restarts the job, which resumes by itself. Then the job is
    relaunched on 2 of the 3 devices: it re-plans (--replan-cluster) and continues. The metrics prove that
    every committed step consumed exactly its samples: none skipped, none twice."""
    tmp = env["tmp"]
    ckpt, metrics = tmp / "elastic", tmp / "elastic.jsonl"
    common = ["--checkpoint-dir", str(ckpt), "--save-every", "1", "--auto-resume", "--metrics", str(metrics),
              "--log-sample-ids"]
    code, err, run_s = _torchrun(env, 3, ["--plan", str(env["plan"]), "--steps", str(STEPS), *common],
                                 {KILL_ENV: "1:forward@2"})
    assert code == 0, err[-3000:]
    # The killed rank's peers print no gloo "Connection closed by peer ... GLHF!" and no crash report each (a peer
    # that sees the broken connection before torchrun ends it says so in one line: tests/unit/test_peer_loss.py);
    # torchrun's own summary names the rank and its signal (exitcode: -9).
    assert "exitcode: -9" in err and "GLHF" not in err and "crashed with" not in err, err[-3000:]
    cluster = tmp / "three.yaml"
    cluster.write_text("nodes:\n  - gpu: {id: cpu, memory_gib: 1, peak_tflops: 1.0}\n    num_nodes: 1\n"
                       "    gpus_per_node: 3\n    nic_gbit_s: 16\n")
    code2, err2, shrink_s = _torchrun(env, 2, ["--plan", str(env["plan"]), "--steps", str(STEPS + 2),
                                               "--replan-cluster", str(cluster),
                                               "--save-final", str(tmp / "elastic.safetensors"), *common], {})
    assert code2 == 0, err2[-3000:]
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    restarts = sorted({r["restart"] for r in lines})
    assert restarts == [0, 1], "the first attempt was not killed and restarted"
    committed = {r["step"] - 1: r for r in lines}  # by step index; the last line of a step is the one kept
    assert sorted(committed) == list(range(STEPS + 2))
    ids = [i for s in range(STEPS + 2) for i in committed[s]["sample_ids"]]
    assert ids == list(range(BATCH * (STEPS + 2))), "a sample was skipped or seen twice"
    assert all(committed[s]["sample_ids"] == step_sample_ids(s, BATCH, 10**9, False, 0).tolist()
               for s in committed)
    redone = sorted({r["step"] - 1 for r in lines if r["restart"] == 1})
    assert redone and redone[0] == 2  # resumed at the last checkpoint (step 2), not later
    ref: ReferenceRun = env["ref"]
    assert_matches_reference("elastic", load_file(tmp / "elastic.safetensors"),
                             [committed[s] for s in range(STEPS + 2)], ref)
    manifest = json.loads((complete_checkpoints(ckpt)[-1][1] / "ethpipe.json").read_text())
    assert sum(len(s["ranks"]) for p in manifest["plan"]["pipelines"] for s in p["stages"]) == 2  # re-planned
    worst = max(abs(committed[s]["loss"] - ref.losses[s]) for s in range(STEPS + 2))
    ROWS.append({"fault": "SIGKILL rank 1 mid-step under `torchrun --max-restarts 1`",
                 "injected by": f"`{KILL_ENV}=1:forward@2` (first attempt only)",
                 "outcome": "recovers automatically: restart, `--auto-resume` from step-2",
                 "error line / recovery": f"exit 0; steps 2..{STEPS - 1} redone by restart 1",
                 "detected after s": f"{run_s:.1f} (whole torchrun job incl. restart)",
                 "next steps reproduced": f"all {STEPS + 2} committed steps = PyTorch: max |loss diff| {worst:.1e}; "
                                          "sample ids 0..35 each once"})
    ROWS.append({"fault": "world shrinks 3 -> 2 ranks (relaunch on fewer devices)",
                 "injected by": "torchrun `--nproc-per-node 2` with `--replan-cluster`",
                 "outcome": "re-plans for 2 devices, resumes from step-4, continues",
                 "error line / recovery": "exit 0; the last manifest's plan has 2 ranks",
                 "detected after s": f"{shrink_s:.1f} (whole job)",
                 "next steps reproduced": f"steps {STEPS}..{STEPS + 1} on the new plan = PyTorch; final params equal"})
