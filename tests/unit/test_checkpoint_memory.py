"""Host memory of `--init-from` and `--save-final`, measured (peak RSS of a fresh process) on a 256 MiB model.

A rank that loads one 32 MiB tensor of a 256 MiB `.pt` file reads that tensor's pages only (``torch.load(mmap=True)``,
shapes from the same mapping): before, it loaded the whole file twice (+291 MiB measured). Writing a state already
on the CPU copies nothing (+1 MiB; before, every tensor was cloned: +258 MiB).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ethpipe.runtime.checkpoint.consolidated import _slice_read, local_slice
from ethpipe.runtime.model.tensor_parallel import TPGroup

MIB = 2 ** 20
TENSOR_MIB, NUM_TENSORS = 32, 8  # a 256 MiB model of 32 MiB tensors
SLACK_MIB = 16  # allocator and interpreter noise between two RSS readings

SCRIPT = textwrap.dedent(f"""
    import resource, sys, torch
    from ethpipe.runtime.checkpoint.consolidated import checkpoint_shapes, load_into, save_atomic
    torch.set_num_threads(1)
    def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    what, path = sys.argv[1], sys.argv[2]
    if what == "save":
        state = {{f"t{{i}}": torch.randn({TENSOR_MIB // 4} * 2**20) for i in range({NUM_TENSORS})}}
        base = peak()
        save_atomic(state, path)
    else:
        stage = torch.nn.Module()
        stage.register_parameter("t3", torch.nn.Parameter(torch.zeros({TENSOR_MIB // 4} * 2**20)))
        base = peak()
        assert len(checkpoint_shapes(path)) == {NUM_TENSORS}
        load_into(stage, path)
    print((peak() - base) / 2**20)
""")


def _extra_mib(what: str, path: Path) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, what, str(path)], capture_output=True, text=True, timeout=120,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_save_final_and_init_from_stay_within_a_stage_and_one_tensor(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    saved = _extra_mib("save", path)
    assert path.stat().st_size >= NUM_TENSORS * TENSOR_MIB * MIB
    assert saved <= TENSOR_MIB + SLACK_MIB, f"writing a CPU state took {saved:.0f} MiB more: a copy of the model?"
    loaded = _extra_mib("load", path)  # the stage's own 32 MiB are allocated before the reading starts
    assert loaded <= 2 * TENSOR_MIB + SLACK_MIB, f"loading one tensor of {suffix} took {loaded:.0f} MiB more"


def test_a_tensor_parallel_rank_reads_its_slice_of_a_safetensors_file(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = {"tok_emb.weight": torch.randn(8, 6), "layers.0.attn.wo.weight": torch.randn(6, 8),
            "norm.weight": torch.randn(6)}
    save_file(full, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        for rank in range(2):
            tp = TPGroup(None, rank, 2)
            for name, tensor in full.items():
                assert torch.equal(_slice_read(f.get_slice(name), name, tp), local_slice(tensor, name, tp)), name
