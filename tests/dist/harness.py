"""Running a function on N forked gloo ranks from a test, with a hard deadline.

Fork (modules already imported here) starts a rank in milliseconds instead of seconds; each
rank uses one thread, rendezvous is a FileStore in the test's tmp dir (no port races), and
ranks die with the test process (PR_SET_PDEATHSIG). A hang fails the test at the deadline.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.optim  # noqa: F401  (imported before fork so children do not pay for it)
from torch.distributed.checkpoint import FileSystemReader

from ethpipe.runtime.start.launch import die_with_parent

TIMEOUT_S = 60.0


def _entry(rank: int, world_size: int, store_dir: str, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        fn(rank, world_size, *args)
    except Exception:
        Path(store_dir, f"failed-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable[..., None], args: tuple[Any, ...], tmp_path: Path,
              deadline_s: float = 180.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on every rank of a fresh gloo world; raise on any failure."""
    store_dir = tmp_path / "rdzv"
    store_dir.mkdir()
    ctx = mp.start_processes(_entry, args=(world_size, str(store_dir), fn, args), nprocs=world_size,
                             join=False, start_method="fork")
    try:
        end = time.monotonic() + deadline_s
        while not ctx.join(timeout=max(0.0, end - time.monotonic())):
            if time.monotonic() >= end:
                raise AssertionError(f"ranks still running after {deadline_s} s (hang?)")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        failures = sorted(store_dir.glob("failed-*.txt"))
        raise AssertionError("\n".join(f.read_text() for f in failures) or "a rank failed") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def load_everything(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimizer; not RNG), in this process."""
    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if not k.startswith("rng.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    return state
