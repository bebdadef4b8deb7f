"""Piped runs (SLURM logs, `| tee`) get a plain console line at least every LOG_EVERY_S, not a silent bar."""

from __future__ import annotations

import io

import ethpipe.runtime.observe.metrics as metrics
from ethpipe.runtime.observe.metrics import LOG_EVERY_S, MetricsWriter


def _record(step: int, **extra: object) -> dict:
    """The metrics line of the step of 0-based index ``step`` (``step_record`` numbers it from 1)."""
    return {"step": step + 1, "loss": 3.0 - 0.1 * step, "tokens_per_s": 12345.6, "iteration_time_s": 0.5, **extra}


def test_piped_runs_print_a_line_at_least_every_ten_seconds(monkeypatch) -> None:
    clock = iter(4.0 * k for k in range(100))  # every step takes 4 s
    monkeypatch.setattr(metrics.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    writer = MetricsWriter(None, 9, progress=True, interactive=False, out=out, predicted_step_s=0.48, total_steps=12)
    for step in range(3, 12):  # a resumed run: steps 3..11 of 12
        writer.write(_record(step, loss_scale=65536.0, skipped=step == 5))
    writer.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["4/12", "7/12", "10/12", "12/12"]  # 12 s apart, and the last
    assert LOG_EVERY_S == 10.0
    assert lines[0] == ("step 4/12  loss 2.7000  12,346 tok/s  step 0.500 s (plan predicted 0.480 s)  "
                        "loss scale 65536")


def test_a_terminal_gets_the_bar_and_no_lines() -> None:
    out = io.StringIO()
    writer = MetricsWriter(None, 2, progress=True, interactive=True, out=out)
    writer.write(_record(0))
    writer.close()
    assert out.getvalue() == ""
    quiet = io.StringIO()
    writer = MetricsWriter(None, 1, progress=False, interactive=False, out=quiet)  # --no-progress: nothing
    writer.write(_record(0))
    assert quiet.getvalue() == ""


def test_log_every_steps_prints_every_nth_step_and_the_last_with_mfu_from_the_prediction() -> None:
    out = io.StringIO()
    writer = MetricsWriter(None, 5, progress=True, interactive=False, out=out, predicted_step_s=0.25,
                           predicted_mfu=0.4, log_every_steps=2)
    for step in range(5):
        writer.write(_record(step))
    writer.close()
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["2/5", "4/5", "5/5"]
    record = writer.records[0]
    assert record["predicted_step_s"] == 0.25
    assert abs(record["mfu"] - 0.4 * 0.25 / 0.5) < 1e-12  # same FLOPs and peak: MFU scales with 1 / step time


def test_log_every_steps_prints_on_a_terminal_too() -> None:
    out = io.StringIO()
    writer = MetricsWriter(None, 2, progress=True, interactive=True, out=out, log_every_steps=1)
    writer._progress.console.file = out  # the bar's console: where the lines go above the bar
    writer.write(_record(0))
    writer.write(_record(1))
    writer.close()
    assert "step 1/2" in out.getvalue() and "step 2/2" in out.getvalue()


def test_the_console_line_says_what_torchtitan_prints() -> None:
    """Loss, grad norm, lr, memory (GiB and the fullest rank's share of its device), throughput, MFU."""
    out = io.StringIO()
    gib = 2 ** 30
    writer = MetricsWriter(None, 1, progress=True, interactive=False, out=out, predicted_step_s=0.25,
                           predicted_mfu=0.4, capacity_bytes=[80 * gib, 16 * gib])
    writer.write(_record(0, grad_norm=1.2345, lr=3e-4, peak_memory_bytes=[40 * gib, 12 * gib]))
    writer.close()
    assert out.getvalue().splitlines() == [
        "step 1/1  loss 3.0000  grad norm 1.23  lr 0.0003  memory 12.00 GiB (75% of rank 1's device)  "
        "12,346 tok/s  step 0.500 s (plan predicted 0.250 s)  MFU 20.0%"]


def test_the_memory_the_device_shows_is_reported_beside_the_allocators_peak() -> None:
    """On CPU the resident set now (torch alone is well over 50 MiB); on a GPU total - free (tests/gpu)."""
    import torch

    from ethpipe.runtime.observe.metrics import HOST_FIELDS, device_used_bytes

    assert "device_used_bytes" in HOST_FIELDS and "peak_memory_bytes" in HOST_FIELDS
    assert device_used_bytes(torch.device("cpu")) > 50 * 2 ** 20
