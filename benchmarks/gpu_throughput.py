"""One-stage training throughput: ethpipe's runtime vs a plain PyTorch loop of the same model on the same GPU.

Both sides train the same decoder (``ethpipe.runtime.model.decoder``: SDPA attention, F.rms_norm, RoPE tables cached)
with the same kernels: bf16 autocast over fp32 weights, fused AdamW on CUDA, the same micro-batches read
from the same token file. ethpipe runs ``ethpipe.runtime.train.train`` on a one-rank world (its executor,
the gradient buckets, the one stats read per step); the plain loop is forward, loss, backward,
``optimizer.step()`` and one ``loss.item()`` per step. With ``compile`` both compile each decoder block
(``torch.compile``, as ``ethpipe train --compile`` does). Reported: median tokens/s over the steps after
the warm-up, and ethpipe/plain.

Run by ``benchmarks/gpu_check.py`` (on CUDA; ``--device cpu`` does a tiny dry run of the same logic).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

WARMUP_STEPS = 3


def _spec(width: int, seq_len: int, num_layers: int):  # type: ignore[no-untyped-def]
    from ethpipe.model_spec import ModelSpec

    heads = max(1, width // 128)
    return ModelSpec(name=f"throughput-{width}", num_layers=num_layers, hidden_size=width, num_heads=heads,
                     num_kv_heads=max(1, heads // 4) if heads % 4 == 0 else heads,
                     ffn_hidden_size=(8 * width // 3 + 127) // 128 * 128, vocab_size=32000, max_seq_len=seq_len)


def _plain_loop(spec: Any, data: str, seq_len: int, micro_batch: int, num_mb: int, steps: int,
                device: torch.device, compile_blocks: bool) -> list[float]:
    from ethpipe.runtime.config import TrainConfig, make_optimizer
    from ethpipe.runtime.data import gather_samples, open_tokens
    from ethpipe.runtime.model.decoder import build_stage, compile_blocks as compile_model

    model = build_stage(spec, (0, spec.num_layers), True, True, device=device)
    if compile_blocks:
        compile_model(model)
    optimizer = make_optimizer(model, TrainConfig(data="", steps=1, lr=1e-4))
    tokens = open_tokens(data, spec.vocab_size)
    batch = micro_batch * num_mb
    scale = 1.0 / (batch * seq_len)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        rows = torch.from_numpy(gather_samples(tokens, np.arange(step * batch, (step + 1) * batch), seq_len)).to(device)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for chunk in rows.split(micro_batch):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                   reduction="sum") * scale
            loss.backward()
            total += loss.detach()
        optimizer.step()
        total.item()  # the logged loss: one host read per step, as ethpipe's
        times.append(time.perf_counter() - start)
    return times


def _ethpipe(spec: Any, data: str, seq_len: int, micro_batch: int, num_mb: int, steps: int,
             device: torch.device, compile_blocks: bool, tmp: str) -> list[float]:
    from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
    from ethpipe.runtime.train import TrainConfig, train

    pipes = (Pipeline((Stage((0,), "gpu", (0, spec.num_layers)),), (micro_batch,) * num_mb),)
    plan = Plan("custom", spec.name, micro_batch * num_mb, seq_len, pipes, compute_blocks(pipes), model_spec=spec,
                extra={"dtype": "bf16"})
    config = TrainConfig(data=data, steps=steps, lr=1e-4, progress=False, compile=compile_blocks, timeout_s=600.0,
                         device="auto" if device.type != "cpu" else "cpu")
    records = train(plan, config, 0, 1, device, init_method=f"file://{tmp}/store-{compile_blocks}")
    return [r["iteration_time_s"] for r in records]


def measure_throughput(device: str = "cuda", width: int = 2048, num_layers: int = 8, seq_len: int = 2048,
                       micro_batch: int = 2, num_mb: int = 4, steps: int = 12,
                       compile_modes: tuple[bool, ...] = (False, True)) -> list[dict[str, Any]]:
    """ethpipe vs the plain loop, alternating, per compile mode."""
    from ethpipe.tokens.texts import prepare_tokens

    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    spec = _spec(width, seq_len, num_layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "tokens.bin")
        rng = np.random.default_rng(0)
        needed = steps * micro_batch * num_mb * seq_len + 1
        prepare_tokens([" ".join(rng.choice(["the", "pipeline", "trains", "fast"], size=needed // 4 + 16))], data)
        for compiled in compile_modes:
            plain = _plain_loop(spec, data, seq_len, micro_batch, num_mb, steps, dev, compiled)
            ours = _ethpipe(spec, data, seq_len, micro_batch, num_mb, steps, dev, compiled, tmp)
            tokens = micro_batch * num_mb * seq_len
            plain_tps = tokens / statistics.median(plain[WARMUP_STEPS:])
            ours_tps = tokens / statistics.median(ours[WARMUP_STEPS:])
            rows.append({"compile": compiled, "width": width, "num_layers": num_layers, "seq_len": seq_len,
                         "micro_batch": micro_batch, "num_microbatches": num_mb, "plain_tokens_per_s": plain_tps,
                         "ethpipe_tokens_per_s": ours_tps, "ratio": ours_tps / plain_tps})
    return rows


def render_throughput(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## One-stage throughput: ethpipe vs a plain PyTorch loop (`benchmarks/gpu_throughput.py`)", "",
             "Same model, kernels (bf16 autocast, SDPA, fused AdamW on CUDA) and micro-batches; median tokens/s "
             f"after {WARMUP_STEPS} warm-up steps.", "",
             "| compile | model | plain tokens/s | ethpipe tokens/s | ethpipe / plain |", "|---|---|---|---|---|"]
    lines += [f"| {'yes' if r['compile'] else 'no'} | h={r['width']}, {r['num_layers']} layers, {r['num_microbatches']} x "
              f"{r['micro_batch']} x {r['seq_len']} | {r['plain_tokens_per_s']:.0f} | {r['ethpipe_tokens_per_s']:.0f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    return lines
