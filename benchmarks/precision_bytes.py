"""Count the memory traffic of one 16-bit micro-batch through a decoder layer of ethpipe's runtime, before and after
its weights were cast once per step with the gradients added straight into fp32 (runtime/model/weight_cast.py).

Every aten op of the micro-batch (the second of a step, so ``.grad`` exists) is recorded by a dispatch mode that
sums each op's input and output tensor bytes (views, which move nothing, left out); the ops that put a gradient
into ``.grad`` are summed apart. "before" is plain autocast over the fp32 weights (what the runtime ran); "after"
the runtime as it is. The layer is llama2-7b's at its real width (202M parameters): the accumulation does not
depend on the token count, the rest grows with it, so both are given at the counted token count.

    python benchmarks/precision_bytes.py --tokens 512 --out docs/benchmarks/precision_bytes.md
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ethpipe.model_load import load_model_spec
from ethpipe.runtime.model.decoder import build_stage


class Traffic(TorchDispatchMode):
    """Every non-view aten op: its name, input (ptr, bytes) and output (ptr, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, int]], list[tuple[int, int]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or not func.is_view:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.ops.append((str(func), [(t.data_ptr(), t.numel() * t.element_size()) for t in ins],
                             [(t.data_ptr(), t.numel() * t.element_size()) for t in outs]))
        return out

    def total(self) -> int:
        return sum(b for _, ins, outs in self.ops for _, b in ins + outs)

    def accumulation(self, grads: set[int]) -> int:
        """The in-place adds into a ``.grad`` and the casts that made what they add (plain autocast's)."""
        adds = [(ins, outs) for name, ins, outs in self.ops if name.endswith("add_.Tensor") and ins[0][0] in grads]
        fed = {ptr for ins, _ in adds for ptr, _ in ins[1:]}
        casts = [(ins, outs) for name, ins, outs in self.ops if "_to_copy" in name and outs and outs[0][0] in fed]
        return sum(b for ins, outs in adds + casts for _, b in ins + outs)


def count(layer: torch.nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
          cast: bool) -> tuple[int, int, int]:
    """(total bytes, accumulation bytes, ops) of the second micro-batch of a bf16 step through ``layer``
    (``cast`` False: plain autocast)."""
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    with torch.autocast("cpu", dtype=torch.bfloat16), layer.weight_cast.step(torch.bfloat16 if cast else None):
        layer(x, rope).float().sum().backward()
        mode = Traffic()
        with mode:
            layer(x, rope).float().sum().backward()
    return mode.total(), mode.accumulation({p.grad.data_ptr() for p in layer.parameters()}), len(mode.ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(2)
    spec = load_model_spec(args.model)
    stage = build_stage(spec, (0, 1), first=False, last=False)
    layer = stage.layers["0"]
    layer.weight_cast = stage.weight_cast  # the layer alone, with its stage's cast
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, spec.hidden_size, generator=gen).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rope = stage.rope(args.tokens, torch.device("cpu"))  # the runtime's tables: bf16 under autocast
    params = sum(p.numel() for p in layer.parameters())
    rows = []
    for label, cast in (("before: plain autocast over fp32 weights", False), ("after: weight_cast (fused cast-and-add)", True)):
        total, accumulate, num_ops = count(layer, x, rope, cast)
        rows.append((label, total, accumulate))
        print(f"{label}: {total / 1e9:.3f} GB per micro-batch, accumulation {accumulate / 1e9:.3f} GB "
              f"({accumulate / params:.2f} B/param), {num_ops} ops", flush=True)
    lines = [
        "# Memory traffic of one bf16 micro-batch through a decoder layer, counted",
        "",
        f"`python benchmarks/precision_bytes.py --tokens {args.tokens}` on {platform.machine()} CPU, torch "
        f"{torch.__version__}, Python {sys.version.split()[0]}. One {spec.name} layer ({params / 1e6:.1f}M "
        f"parameters), micro-batch 1 x {args.tokens} tokens, forward + backward of a step's second micro-batch; "
        "every non-view aten op's input and output bytes summed (a dispatch mode; CPU eager, so what each kernel "
        "reads and writes, not what a fused GPU kernel would).",
        "",
        "| runtime | whole micro-batch (GB) | gradient accumulation (GB) | accumulation bytes per parameter |",
        "|---|---|---|---|",
    ]
    lines += [f"| {label} | {total / 1e9:.3f} | {acc / 1e9:.3f} | {acc / params:.2f} |" for label, total, acc in rows]
    saved = rows[0][1] - rows[1][1]
    lines += ["", f"The change saves {saved / 1e9:.3f} GB per micro-batch ({saved / params:.2f} bytes per parameter); "
              "the accumulation does not depend on the token count, the rest of the micro-batch grows with it."]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    with contextlib.suppress(BrokenPipeError):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
