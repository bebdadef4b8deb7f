"""Measured per-layer profiles: the seam through which measurements replace analytic estimates.

``ethpipe profile`` writes this format; ``ethpipe plan --profile`` reads it. Times are per
micro-batch for one layer of each kind, at the recorded sequence length; other micro-batch
sizes are interpolated with a least-squares line ``t = a + b * micro_batch`` (kernel launch
cost + per-sample work), which is what small-batch layer timings look like.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ethpipe.cost.ops import ACCUMULATIONS, ATTENTION_CHOICES, LAYER_CODES
from ethpipe.errors import UserError
from ethpipe.atomic import write_text_atomic

PROFILE_VERSION = 1
LayerKind = Literal["embedding", "block", "head"]
LAYER_KINDS: tuple[LayerKind, ...] = ("embedding", "block", "head")


@dataclass(frozen=True)
class LayerTiming:
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class MeasuredProfile:
    device_name: str  # what was measured, e.g. "cpu: AMD EPYC 7B13" or "cuda: NVIDIA H200"
    device_kind: str  # "cpu" | "cuda"
    dtype: str  # "fp32" | "bf16" | "fp16"
    model: dict[str, Any]  # ModelSpec.to_dict() of the profiled model
    seq_len: int
    layers: dict[str, dict[int, LayerTiming]]  # kind -> micro_batch_size -> timing
    optimizer_s_per_param: float
    peak_memory_bytes: dict[str, dict[int, int]] = field(default_factory=dict)  # kind -> mbs -> bytes
    version: int = PROFILE_VERSION
    tp: int = 1  # tensor-parallel degree the times were taken at (times include its all-reduces)
    tf32: bool | None = None  # fp32 matmuls on TF32 tensor cores? (None: not recorded; fp32 on Ampere+ assumes on)
    # Attention of the measured runtime: "auto" = PyTorch SDPA's fused kernels (ethpipe's runtime),
    # "materialised" = the unfused s x s path (Megatron-DeepSpeed in fp32, e.g. the Sailor profiles).
    attention: str = "auto"
    # How the measured backward puts each new gradient into ``.grad`` (``ops.GRAD_ACCUM_BYTES_16BIT``): "cast_add"
    # (ethpipe's runtime), "autocast" (plain autocast over fp32 weights; profiles written before ethpipe cast
    # its own weights record ``true``) or "fused" into the weight-gradient GEMM (Megatron; ``false``).
    grad_accumulation: str = "cast_add"
    # Whose block was timed (``cost/elementwise.py``): "ethpipe" (this runtime: ``ethpipe profile``), "megatron"
    # (fused norms and RoPE: the Sailor profiles) or "hf" (transformers' eager Llama layer: the Zorse data).
    layer_code: str = "ethpipe"

    def layer_times_s(self, kind: LayerKind, micro_batch: int) -> tuple[float, float]:
        """(forward, backward) seconds of one layer of ``kind`` for one micro-batch."""
        points = self.layers.get(kind)
        if not points:
            raise UserError(f"profile has no timings for layer kind '{kind}': re-run `ethpipe profile`")
        if micro_batch in points:
            t = points[micro_batch]
            return t.fwd_s, t.bwd_s
        return _fit(points, micro_batch, "fwd_s"), _fit(points, micro_batch, "bwd_s")

    def activation_bytes(self, kind: LayerKind, micro_batch: int) -> float | None:
        """Measured activation bytes one layer of ``kind`` keeps for backward, or None if not measured."""
        points = self.peak_memory_bytes.get(kind)
        if not points:
            return None
        if micro_batch in points:
            return float(points[micro_batch])
        return _fit({b: LayerTiming(float(v), 0.0) for b, v in points.items()}, micro_batch, "fwd_s")

    def check_kernel_modes(self, device_type: str, attention: str, dtype: str, tf32: bool) -> None:
        """This profile's times replace the model's for ``device_type``: they must have been measured with the
        kernels the plan runs (its attention implementation, and for fp32 its TF32 setting)."""
        if self.attention != attention:
            raise UserError(f"profile for device type '{device_type}' was measured with attention '{self.attention}' "
                            f"but the plan is priced for '{attention}': re-profile with `ethpipe profile --attention "
                            f"{attention}` or plan with --attention {self.attention}")
        if dtype == "fp32" and self.dtype == "fp32" and self.tf32 is not None and self.tf32 != tf32:
            have, want = ("--tf32", "--no-tf32") if self.tf32 else ("--no-tf32", "--tf32")
            raise UserError(f"profile for device type '{device_type}' was measured with TF32 "
                            f"{'on' if self.tf32 else 'off'} but the plan is priced {want}: re-profile with "
                            f"`ethpipe profile {want}` or plan with {have}")

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "device_name": self.device_name,
            "device_kind": self.device_kind,
            "dtype": self.dtype,
            "model": self.model,
            "seq_len": self.seq_len,
            "layers": {
                kind: {str(b): {"fwd_s": t.fwd_s, "bwd_s": t.bwd_s} for b, t in sorted(pts.items())}
                for kind, pts in self.layers.items()
            },
            "optimizer_s_per_param": self.optimizer_s_per_param,
            "peak_memory_bytes": {k: {str(b): v for b, v in d.items()} for k, d in self.peak_memory_bytes.items()},
            "tp": self.tp,
            "tf32": self.tf32,
            "attention": self.attention,
            "grad_accumulation": self.grad_accumulation,
            "layer_code": self.layer_code,
            "rope": "compute_dtype",  # RoPE rotated in the compute dtype (profiles without it: ethpipe_fp32_rope)
        }

    def save(self, path: str | Path) -> None:
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")


def _fit(points: dict[int, LayerTiming], micro_batch: int, attr: str) -> float:
    """An unmeasured micro-batch size: the least-squares line through the measured sizes, kept where a noisy
    profile would bend it past what a size costs (a short `ethpipe profile` run's first, cold size can read
    slower than the next one, and the line then fell to 0 at larger sizes): above the measured sizes at least the
    largest one's value, below them at least its share of the smallest's, between two measured sizes between
    their values."""
    if micro_batch in points:
        return float(getattr(points[micro_batch], attr))
    xs = sorted(points)
    ys = [getattr(points[x], attr) for x in xs]
    if len(xs) == 1:
        return ys[0] * micro_batch / xs[0]
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var
    line = mean_y - slope * mean_x + slope * micro_batch
    if micro_batch > xs[-1]:
        return max(line, ys[-1])
    if micro_batch < xs[0]:
        return max(line, ys[0] * micro_batch / xs[0])
    right = next(i for i, x in enumerate(xs) if x > micro_batch)
    low, high = sorted((ys[right - 1], ys[right]))
    return min(max(line, low), high)


def profile_from_dict(data: Any) -> MeasuredProfile:
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise UserError(f"profile field 'version' must be {PROFILE_VERSION}: re-run `ethpipe profile`")
    try:
        layers = {
            kind: {int(b): LayerTiming(float(t["fwd_s"]), float(t["bwd_s"])) for b, t in pts.items()}
            for kind, pts in data["layers"].items()
        }
        memory = {k: {int(b): int(v) for b, v in d.items()} for k, d in data.get("peak_memory_bytes", {}).items()}
        return MeasuredProfile(
            device_name=str(data["device_name"]),
            device_kind=str(data["device_kind"]),
            dtype=str(data["dtype"]),
            model=dict(data["model"]),
            seq_len=int(data["seq_len"]),
            layers=layers,
            optimizer_s_per_param=float(data["optimizer_s_per_param"]),
            peak_memory_bytes=memory,
            tp=int(data.get("tp", 1)),
            tf32=None if data.get("tf32") is None else bool(data["tf32"]),
            attention=_attention(data.get("attention", "auto")),
            grad_accumulation=_accumulation(data.get("grad_accumulation", True)),
            layer_code=_layer_code(data.get("layer_code", "ethpipe"), data.get("rope")),
        )
    except (KeyError, TypeError, AttributeError) as err:
        raise UserError(f"profile is missing or has a malformed field {err}: re-run `ethpipe profile`") from None


def _attention(value: Any) -> str:
    if value not in ATTENTION_CHOICES:
        raise UserError(f"profile field 'attention' must be one of {', '.join(ATTENTION_CHOICES)}, got {value!r}: "
                        "re-run `ethpipe profile --attention auto|materialised`")
    return str(value)


def _accumulation(value: Any) -> str:
    """A profile's ``grad_accumulation``: a name, or the boolean older profiles wrote (true: plain autocast)."""
    if isinstance(value, bool):
        return "autocast" if value else "fused"
    if value not in ACCUMULATIONS:
        raise UserError(f"profile field 'grad_accumulation' must be one of {', '.join(ACCUMULATIONS)}, got {value!r}")
    return str(value)


def _layer_code(value: Any, rope: Any = None) -> str:
    """A profile's ``layer_code``; an ``ethpipe`` profile written before RoPE rotated in the compute dtype (no
    ``rope`` field) measured the runtime that rotated in fp32, and is priced as that one."""
    if value == "ethpipe" and rope is None:
        return "ethpipe_fp32_rope"
    if value not in LAYER_CODES:
        raise UserError(f"profile field 'layer_code' must be one of {', '.join(LAYER_CODES)}, got {value!r}")
    return str(value)


def load_profile(path: str | Path) -> MeasuredProfile:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"profile file '{path}' not found: make one with `ethpipe profile --out {path}`")
    try:
        return profile_from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise UserError(f"profile file '{path}' is not valid JSON: {err}") from None
