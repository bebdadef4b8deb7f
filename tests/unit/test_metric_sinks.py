"""--tensorboard and --wandb: the scalars a run logs read back from what each library wrote."""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

import pytest

from ethpipe.runtime.observe.sinks import TensorBoardSink, WandbSink, events, scalars


def _records() -> list[dict]:
    return [{"step": s, "loss": 5.0 - s, "grad_norm": 1.5, "tokens_per_s": 1000.0 + s, "iteration_time_s": 0.5,
             "predicted_step_s": 0.45, "mfu": 0.3, "lr": 1e-3, "pipeline_compute_s": [0.3, 0.2],
             "pipeline_idle_s": [0.1, 0.2], "grad_sync_exposed_s": 0.01, "peak_memory_bytes": [2**30, 2**31],
             **({"rebalance": {"split": [3, 1]}} if s == 1 else {})} for s in range(3)]


def test_scalars_and_events_name_every_field() -> None:
    values = scalars(_records()[0], plan_memory_bytes=[2**31, 2**31])
    assert values["train/loss"] == 5.0 and values["train/predicted_step_time_s"] == 0.45
    assert values["pipeline/1/idle_s"] == 0.2 and values["sync/exposed_s"] == 0.01
    assert values["memory/rank_1/peak_gib"] == 2.0 and values["memory/rank_0/peak_vs_plan"] == 0.5
    assert "memory/rank_0/peak_vs_plan" not in scalars(_records()[0])  # CPU: no plan figure to compare with
    assert events(_records()[1]) == ["rebalance at step 1: {'split': [3, 1]}"] and events(_records()[0]) == []


def test_tensorboard_event_files_read_back_with_the_logged_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(str(tmp_path / "tb"), plan_memory_bytes=[2**31, 2**31])
    for record in _records():
        sink.write(record)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(0, 5.0), (1, 4.0), (2, 3.0)]
    assert [e.value for e in acc.Scalars("memory/rank_1/peak_vs_plan")] == [1.0, 1.0, 1.0]
    assert [e.value for e in acc.Scalars("pipeline/0/compute_s")] == pytest.approx([0.3] * 3)
    texts = acc.Tensors("events/text_summary")
    assert [t.step for t in texts] == [1] and b"rebalance at step 1" in texts[0].tensor_proto.string_val[0]


def test_wandb_offline_writes_its_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    sink = WandbSink("ethpipe-test", {"lr": 1e-3})
    for record in _records():
        sink.write(record)
    sink.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    path = Path(glob.glob(os.path.join(runs[0], "run-*.wandb"))[0])
    deadline = time.monotonic() + 60.0  # wandb's service process may still be writing the run file
    while b"rebalance at step 1" not in path.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    data = path.read_bytes()
    # the run file is protobuf records: the logged keys and the event text are stored verbatim
    assert b"train/loss" in data and b"memory/rank_1/peak_gib" in data and b"rebalance at step 1" in data


def test_each_run_gets_its_own_tensorboard_folder_and_a_resume_continues_its_own(tmp_path: Path) -> None:
    """A fresh run: a new ``run-<UTC time>`` folder (never an earlier run's); a resume: the folder its checkpoint
    recorded, purged from the step after it; a checkpoint from before run folders: the root, as then. The sink
    creates no event file before its first record (a run that fails to start leaves none)."""
    import datetime

    from ethpipe.runtime.checkpoint.layout import DataCursor, Manifest, ResumePoint
    from ethpipe.runtime.observe.sinks import TENSORBOARD_RUN, TensorBoardSink, tensorboard_run_dir

    when = datetime.datetime(2026, 12, 6, 7, 5, 0, tzinfo=datetime.timezone.utc)
    first, purge = tensorboard_run_dir(tmp_path, ResumePoint(), when)
    assert first == tmp_path / "run-20261206-070500" and purge is None
    first.mkdir()
    second, _ = tensorboard_run_dir(tmp_path, ResumePoint(), when)  # the same second: another folder
    assert second == tmp_path / "run-20261206-070500-2"

    def resumed(extra: dict) -> ResumePoint:
        manifest = Manifest(10, DataCursor(80, False, 0, 1000), {}, {}, {}, extra=extra)
        return ResumePoint(10, 80, tmp_path / "step-000010", manifest)

    assert tensorboard_run_dir(tmp_path, resumed({TENSORBOARD_RUN: first.name})) == (first, 11)
    assert tensorboard_run_dir(tmp_path, resumed({})) == (tmp_path, 11)
    pytest.importorskip("tensorboard")
    sink = TensorBoardSink(str(tmp_path / "never"))
    sink.close()
    assert not (tmp_path / "never").exists()
