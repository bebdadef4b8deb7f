"""Measure per-layer forward/backward times and memory on the local device (``ethpipe profile``).

Builds one embedding, one decoder block and the final norm + head (+ loss, which the last
stage computes) from the runtime's model code, so the profile times exactly the modules the
runtime trains. Each (layer kind, micro-batch size) is timed with warm-up runs and the median
of several repeats; CUDA is synchronised around every timed region. Activation memory is what
the backward keeps alive: on CUDA the allocator's peak above the baseline, on CPU the bytes of
the tensors autograd saves (``saved_tensors_hooks``), since CPU has no allocator statistics.
"""

from __future__ import annotations

import platform
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ethpipe.cost.ops import ATTENTION_CHOICES
from ethpipe.cost.profile import LAYER_KINDS, LayerTiming, MeasuredProfile
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.kernel_modes import kernel_mode_switches, restore_switches, set_switches
from ethpipe.runtime.model.decoder import Decoder, build_stage

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ProfileSettings:
    seq_len: int
    micro_batch_sizes: tuple[int, ...]
    device: str = "cpu"
    dtype: str = "fp32"
    repeats: int = 5
    warmup: int = 2
    num_threads: int = 1  # one compute thread per rank, as the CPU runtime runs
    seed: int = 0
    tf32: bool = True  # CUDA fp32 matmuls on TF32 tensor cores (what a default plan is priced and run with)
    attention: str = "auto"  # SDPA's own pick (the runtime's default), or "materialised" (its math path)

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise UserError(f"--seq-len must be positive, got {self.seq_len}")
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise UserError("--micro-batch-sizes must be a comma-separated list of positive integers, e.g. 1,2,4")
        if self.repeats < 1 or self.warmup < 0:
            raise UserError("--repeats must be >= 1 (and warm-up >= 0)")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got '{self.dtype}'")
        if self.device not in ("cpu", "cuda"):
            raise UserError(f"--device must be cpu or cuda, got '{self.device}'")
        if self.attention not in ATTENTION_CHOICES:
            raise UserError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got '{self.attention}'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda requested but torch sees no CUDA device: use --device cpu")
        if self.num_threads < 1:
            raise UserError(f"--threads must be >= 1, got {self.num_threads}")


def device_name(device: str) -> str:
    if device == "cuda":
        return f"cuda: {torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    """Wall time on accelerators; on a single-threaded CPU, this thread's CPU time, which other
    processes sharing the cores do not inflate (wall-timed CPU profiles grew 2-3x under load)."""
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    _sync(device)
    start = clock()
    out = fn()
    _sync(device)
    return clock() - start, out


class _SavedBytes:
    """Counts the bytes autograd saves for backward, skipping parameters and duplicates."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.param_ptrs = {p.data_ptr() for p in params}
        self.seen: set[tuple[int, int, torch.dtype]] = set()
        self.num_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.data_ptr() not in self.param_ptrs and key not in self.seen:
            self.seen.add(key)
            self.num_bytes += t.numel() * t.element_size()
        return t


def _backward(out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    out.backward(grad)
    return out


def _measure(
    forward: Callable[[], torch.Tensor], params: Sequence[torch.Tensor], settings: ProfileSettings,
    device: torch.device, weight_copies: Callable[[], list[torch.Tensor]] = list,
) -> tuple[LayerTiming, int]:
    """Median forward and backward seconds, and the activation bytes of one micro-batch."""
    fwd_times, bwd_times = [], []
    for i in range(settings.warmup + settings.repeats):
        fwd_s, out = _timed(forward, device)
        grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
        bwd_s, _ = _timed(functools.partial(_backward, out, grad), device)
        if i >= settings.warmup:
            fwd_times.append(fwd_s)
            bwd_times.append(bwd_s)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = forward()
        out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
        torch.cuda.synchronize(device)
        memory = torch.cuda.max_memory_allocated(device) - base
    else:
        counter = _SavedBytes([*params, *weight_copies()])  # the step's 16-bit weights are not activations
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            out = forward()
        out.backward(torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out))
        memory = counter.num_bytes
    del out
    return LayerTiming(statistics.median(fwd_times), statistics.median(bwd_times)), int(memory)


def _layer_forwards(
    module: Decoder, spec: ModelSpec, micro_batch: int, settings: ProfileSettings, device: torch.device,
) -> dict[str, tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]:
    """One forward closure (and its parameters) per layer kind, on fresh random inputs."""
    gen = torch.Generator(device="cpu").manual_seed(settings.seed + micro_batch)
    dtype = DTYPES[settings.dtype]
    s, h = settings.seq_len, spec.hidden_size
    tokens = torch.randint(0, spec.vocab_size, (micro_batch, s), generator=gen).to(device)
    targets = torch.randint(0, spec.vocab_size, (micro_batch, s), generator=gen).to(device)
    hidden = torch.randn(micro_batch, s, h, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    rope = module.rope(s, device) if spec.position == "rope" else None  # as the runtime's (its dtype)
    layer = module.layers[str(module.layer_range[0])]

    def embedding() -> torch.Tensor:
        out = module.tok_emb(tokens)
        if spec.position == "learned":
            out = out + module.pos_emb(torch.arange(s, device=device))
        return out

    def block() -> torch.Tensor:
        return layer(hidden, rope)

    def head() -> torch.Tensor:
        logits = module.head(module.norm(hidden))
        return F.cross_entropy(logits.float().view(-1, spec.vocab_size), targets.view(-1))

    emb_params = [module.tok_emb.weight] + ([module.pos_emb.weight] if spec.position == "learned" else [])
    return {
        "embedding": (embedding, emb_params),
        "block": (block, list(layer.parameters())),
        "head": (head, [module.head.weight, *module.norm.parameters()]),
    }


def _optimizer_s_per_param(module: Decoder, settings: ProfileSettings, device: torch.device) -> float:
    """AdamW step over one decoder block's parameters, per parameter (median of repeats)."""
    params = list(module.layers[str(module.layer_range[0])].parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for i in range(settings.warmup + settings.repeats):
        t, _ = _timed(lambda: opt.step() or params[0], device)
        if i >= settings.warmup:
            times.append(t)
    return statistics.median(times) / sum(p.numel() for p in params)


def profile_model(spec: ModelSpec, settings: ProfileSettings) -> MeasuredProfile:
    """Time every layer kind at every micro-batch size on ``settings.device``."""
    if settings.seq_len > spec.max_seq_len:
        raise UserError(f"--seq-len {settings.seq_len} exceeds model '{spec.name}' max_seq_len {spec.max_seq_len}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.num_threads)
    modes = _kernel_modes(settings)
    try:
        device = torch.device(settings.device)
        # The runtime's precision scheme (pipeline/executor.py): fp32 weights; in 16-bit one autocast region and
        # one weight-cast step per micro-batch size, so each pass is timed as a step runs it, without the
        # once-per-step weight copies (priced with the optimizer step).
        module = build_stage(spec, (0, 1), first=True, last=True, seed=settings.seed, device=device)
        low = DTYPES[settings.dtype] if settings.dtype != "fp32" else None
        layers: dict[str, dict[int, LayerTiming]] = {kind: {} for kind in LAYER_KINDS}
        memory: dict[str, dict[int, int]] = {kind: {} for kind in LAYER_KINDS}
        for micro_batch in sorted(set(settings.micro_batch_sizes)):
            with torch.autocast(device.type, dtype=low or torch.bfloat16, enabled=low is not None), \
                    module.weight_cast.step(low):
                for kind, (forward, params) in _layer_forwards(module, spec, micro_batch, settings, device).items():
                    layers[kind][micro_batch], memory[kind][micro_batch] = _measure(
                        forward, params, settings, device, module.weight_cast.copies)
        optimizer_s = _optimizer_s_per_param(module, settings, device)
    finally:
        torch.set_num_threads(previous_threads)
        restore_switches(modes)
    cuda_fp32 = settings.device == "cuda" and settings.dtype == "fp32"
    # Off CUDA nothing is switched: SDPA ran its own pick, so that is what the profile measured.
    attention = settings.attention if settings.device == "cuda" else "auto"
    return MeasuredProfile(
        device_name=device_name(settings.device),
        device_kind=settings.device,
        dtype=settings.dtype,
        model=spec.to_dict(),
        seq_len=settings.seq_len,
        layers=layers,
        optimizer_s_per_param=optimizer_s,
        peak_memory_bytes=memory,
        tf32=settings.tf32 if cuda_fp32 else None,
        attention=attention,
    )


def _kernel_modes(settings: ProfileSettings) -> list[tuple[Callable[[bool], None], bool]]:
    """Set CUDA's TF32 and SDPA switches for the profile as a plan sets them (``runtime/model/kernel_modes.py``);
    returns what ``restore_switches`` puts back. No-op off CUDA."""
    if settings.device != "cuda" or not torch.cuda.is_available():
        return []
    return set_switches(kernel_mode_switches(settings.tf32, settings.attention))
