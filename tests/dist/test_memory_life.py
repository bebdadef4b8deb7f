"""A tp-2 stage's host memory at every moment around training, measured (``memory_life.py``), within its bounds.

Model: 352 MiB in fp32 (4 layers, vocab 8192; the largest tensor T = 32 MiB), one tp-2 stage on two gloo ranks, so
each rank holds S = its parameters (~176 MiB) and 2S of AdamW state. Bounds, per rank, above the resident set
before the moment (SLACK = 32 MiB: the interpreter, DCP's metadata, allocator rounding):
- save: T + SLACK (each rank writes its slices by offset; before: a TP save gathered every global tensor,
  995 MiB measured on rank 0);
- resume: 3S (the parameters and AdamW states it fills, first touched here) + T + SLACK (before: a global
  buffer per sharded key, 1441 MiB);
- `--init-from` .pt / .safetensors / HF directory: T + SLACK (before: 244 MiB; every page of the file the
  rank read stayed mapped);
- `--save-final` (rank 0, streamed .safetensors): 2T + SLACK (one gathered tensor and its CPU copy; before 352);
- `export` .safetensors: T + SLACK (before 352); `export --format hf` at 64 MiB shards: 2 shards + SLACK
  (before 320).
The ranks run in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` fixed, so every large block is returned to
the kernel when freed and the resident set is what the process holds (glibc's dynamic threshold would keep
freed blocks resident and hide an allocation behind them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .memory_life import MIB, largest_tensor_bytes, model_bytes

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
SLACK_MIB = 32
HF_SHARD_MIB = 64


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")
def test_each_moment_of_a_tp2_stage_stays_within_its_bytes(tmp_path: Path) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "tests.dist.memory_life", str(tmp_path)], cwd=ROOT, env=env, check=True,
                   timeout=600, capture_output=True)
    tensor = largest_tensor_bytes() / MIB
    stage = model_bytes() / 2 / MIB  # a tp-2 rank's share (norms are replicated: a few KiB more)
    bounds = {"save": tensor + SLACK_MIB, "resume": 3 * stage + tensor + SLACK_MIB,
              "init-from .pt": tensor + SLACK_MIB, "init-from .safetensors": tensor + SLACK_MIB,
              "init-from hf": tensor + SLACK_MIB, "save-final": 2 * tensor + SLACK_MIB,
              "export .safetensors": tensor + SLACK_MIB, "export hf": 2 * HF_SHARD_MIB + SLACK_MIB}
    for rank in range(2):
        extra = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(extra) >= set(bounds) - ({"export .safetensors", "export hf"} if rank else set())
        over = {k: f"{v:.0f} MiB > {bounds[k]:.0f}" for k, v in extra.items() if k in bounds and v > bounds[k]}
        assert not over, f"rank {rank}: {over}"
        assert extra["resume"] >= 3 * stage, "the resume filled less than the stage: the measurement is broken"
