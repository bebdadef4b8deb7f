"""One tp-2 stage's host memory at each moment of a run's life around training, measured on forked gloo ranks.

Each moment is measured as the peak resident set above the resident set just before it (Linux: writing 5 to
``/proc/self/clear_refs`` resets the peak, ``VmHWM``), in MiB, per rank. On a CPU run the stage's "device" is
the host, so a global tensor built on the device (a TP save's gather, a resume's global buffers) shows here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ethpipe.hf.export import export_hf
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.checkpoint.consolidated import load_into, save_atomic, save_consolidated
from ethpipe.runtime.checkpoint.layout import DataCursor, find_resume
from ethpipe.runtime.checkpoint.state import load_checkpoint, save_checkpoint
from ethpipe.runtime.checkpoint.weights import consolidated_weights, export_checkpoint
from ethpipe.runtime.model.decoder import build_stage, state_dict_shapes
from ethpipe.runtime.model.tensor_parallel import TPGroup

MIB = 2 ** 20
# 4 layers of 16 Mi parameters and two 8 Mi vocabulary matrices: 352 MiB in fp32, 176 MiB per tp-2 rank.
SPEC = ModelSpec(name="memory-life", num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=8,
                 ffn_hidden_size=4096, vocab_size=8192, max_seq_len=64)
SEQ = 16


def model_bytes(spec: ModelSpec = SPEC) -> int:
    return sum(torch.Size(s).numel() * 4 for s in state_dict_shapes(spec).values())


def largest_tensor_bytes(spec: ModelSpec = SPEC) -> int:
    return max(torch.Size(s).numel() * 4 for s in state_dict_shapes(spec).values())


def tp2_plan() -> Plan:
    pipes = (Pipeline((Stage((0, 1), "cpu", (0, SPEC.num_layers), 2),), (1,)),)
    return Plan("custom", SPEC.name, 1, SEQ, pipes, compute_blocks(pipes), model_spec=SPEC)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


class Peaks:
    """Peak resident memory above the start of each measured moment (MiB)."""

    def __init__(self) -> None:
        self.extra_mib: dict[str, float] = {}

    def measure(self, name: str, fn, *args, **kwargs):  # noqa: ANN001, ANN201 - any callable
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
        start = _rss_kib("VmRSS")
        out = fn(*args, **kwargs)
        self.extra_mib[name] = (_rss_kib("VmHWM") - start) / 1024
        return out


def _trained_stage(tp: TPGroup) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    module = build_stage(SPEC, (0, SPEC.num_layers), True, True, tp=tp)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's states exist, as after a step
    for p in module.parameters():
        p.grad = None
    return module, optimizer


def worker(rank: int, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    root = Path(out_dir)
    tp = TPGroup(dist.new_group([0, 1]), rank, 2)
    plan, peaks = tp2_plan(), Peaks()
    module, optimizer = peaks.measure("random init", _trained_stage, tp)
    cursor = DataCursor(next_sample=1, shuffle=False, seed=0, num_samples=100)
    peaks.measure("save", save_checkpoint, root / "ckpt", 1, module, optimizer, plan, SPEC, cursor, 2,
                  torch.device("cpu"))
    peaks.measure("save-final", save_consolidated, module, plan, rank, SPEC, None, root / "final.safetensors")
    if rank == 0:
        weights = consolidated_weights(root / "ckpt")[2]
        peaks.measure("export .safetensors", export_checkpoint, root / "ckpt", root / "export.safetensors")
        peaks.measure("export hf", export_hf, weights, SPEC, root / "hf", "64MiB")
        save_atomic(dict(weights), root / "model.pt")
    del module, optimizer
    dist.barrier()
    point = find_resume(root / "ckpt", SPEC, SEQ, False, 0, 100)
    fresh = build_stage(SPEC, (0, SPEC.num_layers), True, True, tp=tp, init=False)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    peaks.measure("resume", load_checkpoint, point, fresh, fresh_opt, torch.device("cpu"))
    for name, path in (("init-from .pt", "model.pt"), ("init-from .safetensors", "final.safetensors"),
                       ("init-from hf", "hf")):
        peaks.measure(name, load_into, fresh, root / path)
    (root / f"rank{rank}.json").write_text(json.dumps(peaks.extra_mib))


def main(out_dir: str) -> None:
    """Run the two ranks (from a fresh process: see the test's docstring for why)."""
    from tests.dist.harness import run_ranks

    run_ranks(2, worker, (out_dir,), Path(out_dir), deadline_s=600.0)


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
