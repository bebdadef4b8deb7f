"""Kernel times on one GPU: datasheet peaks times a few fitted constants per architecture.

A kernel takes ``launch_s + flops / (peak * eff) + bytes / (bandwidth * mem_eff)``, a layer pass
adds ``layer_s`` (host-side work per module: Python, hooks, synchronisation). ``peak`` is the
datasheet peak of the math mode actually used (``math_mode``): 16-bit tensor cores for
bf16/fp16, TF32 tensor cores for fp32 on GPUs that have them when TF32 is allowed, CUDA-core
fp32 otherwise. The sum (not the max) of compute and memory time is what makes a GEMM's
efficiency grow with its arithmetic intensity: ``eff_GEMM = eff / (1 + ridge / intensity)``,
so small or skinny GEMMs run far from peak and wide ones approach ``eff``.

The constants (``ArchConstants``) are per architecture family, fitted to measured profiles
(``cost/calibrate.py``) and shipped in ``data/calibration.yaml`` with their sources; a family
nobody measured falls back to ``DEFAULT_CONSTANTS`` and is reported as uncalibrated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ethpipe.catalog import GpuSpec
from ethpipe.cost.ops import Kernel
from ethpipe.errors import UserError

CALIBRATION_VERSION = 1
CONSTANT_NAMES = ("tensor_eff", "simd_eff", "mem_eff", "launch_s", "layer_s")
TENSOR_ARCHS = ("volta", "turing", "ampere", "ada", "hopper", "cdna")


@dataclass(frozen=True)
class ArchConstants:
    """What one GPU architecture family reaches of its datasheet numbers."""

    tensor_eff: float  # fraction of the tensor-core peak (TF32 / bf16 / fp16) that large GEMMs reach
    simd_eff: float  # fraction of the CUDA-core fp32 peak that large GEMMs reach
    mem_eff: float  # fraction of the datasheet memory bandwidth that streaming kernels reach
    launch_s: float  # per kernel (launch + tail)
    layer_s: float  # per layer pass (framework overhead)
    source: str = ""
    fitted: tuple[str, ...] = ()  # which constants came from measurements (the rest are defaults)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fitted"] = list(self.fitted)
        return out


# Defaults where nothing was measured: cuBLAS-class GEMMs reach ~60-70% of tensor peak and ~80%
# of CUDA-core fp32 peak; streaming kernels ~80% of HBM bandwidth (STREAM-like); ~5 us per launch.
DEFAULT_CONSTANTS = ArchConstants(0.6, 0.8, 0.8, 5e-6, 50e-6, "defaults (no measurement)")


@dataclass(frozen=True)
class Calibration:
    """Fitted constants by architecture family (``data/calibration.yaml`` or `ethpipe calibrate`)."""

    architectures: Mapping[str, ArchConstants]
    source: str = ""

    def constants(self, arch: str) -> tuple[ArchConstants, bool]:
        """(constants, calibrated?) of an architecture family."""
        if arch in self.architectures and self.architectures[arch].fitted:
            return self.architectures[arch], True
        return DEFAULT_CONSTANTS, False

    def merged(self, other: Calibration) -> Calibration:
        """``other``'s families win (a user's calibration over the shipped one)."""
        return Calibration({**self.architectures, **other.architectures}, other.source or self.source)

    def to_dict(self) -> dict[str, Any]:
        return {"version": CALIBRATION_VERSION, "source": self.source,
                "architectures": {k: v.to_dict() for k, v in sorted(self.architectures.items())}}


def calibration_from_dict(data: Any, where: str = "calibration") -> Calibration:
    if not isinstance(data, dict) or data.get("version") != CALIBRATION_VERSION:
        raise UserError(f"{where} field 'version' must be {CALIBRATION_VERSION}: re-run `ethpipe calibrate`")
    archs = {}
    for name, raw in (data.get("architectures") or {}).items():
        try:
            values = {k: float(raw[k]) for k in CONSTANT_NAMES}
            fitted = tuple(str(x) for x in raw.get("fitted", CONSTANT_NAMES))
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"{where} field 'architectures.{name}' is missing or has a malformed {err}") from None
        if min(values["tensor_eff"], values["simd_eff"], values["mem_eff"]) <= 0:
            raise UserError(f"{where} field 'architectures.{name}': efficiencies must be positive")
        archs[str(name)] = ArchConstants(**values, source=str(raw.get("source", "")), fitted=fitted)
    return Calibration(archs, str(data.get("source", "")))


@lru_cache(maxsize=1)
def shipped_calibration() -> Calibration:
    text = resources.files("ethpipe").joinpath("data/calibration.yaml").read_text()
    return calibration_from_dict(yaml.safe_load(text), "shipped calibration.yaml")


def load_calibration(path: str | Path | None) -> Calibration:
    """The shipped constants, overridden by a user file (`ethpipe calibrate --out`) when given."""
    if path is None:
        return shipped_calibration()
    path = Path(path)
    if not path.is_file():
        raise UserError(f"catalog file '{path}' not found: make one with `ethpipe calibrate PROFILE... --out {path}`")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"catalog file '{path}' is not valid YAML: {str(err).splitlines()[0]}") from None
    return shipped_calibration().merged(calibration_from_dict(data, f"catalog file '{path}'"))


def math_mode(gpu: GpuSpec, dtype: str, tf32: bool) -> tuple[str, float]:
    """(unit, peak TFLOP/s) GEMMs run at: 'tensor' or 'simd' (CUDA cores)."""
    if dtype in ("bf16", "fp16"):
        return ("tensor" if gpu.arch in TENSOR_ARCHS else "simd"), gpu.peak_tflops
    if tf32 and gpu.tf32_tflops > 0:
        return "tensor", gpu.tf32_tflops
    return "simd", gpu.peak_fp32_tflops or gpu.peak_tflops


def has_hardware_model(gpu: GpuSpec) -> bool:
    """The per-kernel model needs an architecture family and a memory bandwidth (inline GPUs may lack both)."""
    return bool(gpu.arch) and gpu.memory_bandwidth_gbps > 0


@dataclass(frozen=True)
class DeviceCompute:
    """Prices kernels on one GPU type in one precision."""

    gpu: GpuSpec
    constants: ArchConstants
    calibrated: bool
    unit: str
    peak_tflops: float

    @classmethod
    def build(cls, gpu: GpuSpec, calibration: Calibration, dtype: str, tf32: bool) -> DeviceCompute:
        unit, peak = math_mode(gpu, dtype, tf32)
        constants, calibrated = calibration.constants(gpu.arch)
        return cls(gpu, constants, calibrated, unit, peak)

    def features(self, kernels: Iterable[Kernel]) -> list[float]:
        """Coefficients of (1/tensor_eff, 1/simd_eff, 1/mem_eff, launch_s, layer_s) in the layer time."""
        kernels = list(kernels)
        compute_s = sum(k.flops for k in kernels) / (self.peak_tflops * 1e12)
        memory_s = sum(k.num_bytes for k in kernels) / (self.gpu.memory_bandwidth_gbps * 1e9)
        tensor = compute_s if self.unit == "tensor" else 0.0
        simd = compute_s if self.unit == "simd" else 0.0
        return [tensor, simd, memory_s, float(len(kernels)), 1.0]

    def layer_s(self, kernels: Iterable[Kernel]) -> float:
        c = self.constants
        f = self.features(kernels)
        return f[0] / c.tensor_eff + f[1] / c.simd_eff + f[2] / c.mem_eff + f[3] * c.launch_s + f[4] * c.layer_s

    def describe(self) -> str:
        state = "calibrated" if self.calibrated else "uncalibrated (datasheet, default efficiencies)"
        return f"{self.gpu.id} {state}: {self.unit} {self.peak_tflops:g} TFLOP/s, {self.gpu.memory_bandwidth_gbps:g} GB/s"
