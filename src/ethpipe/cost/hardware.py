"""Kernel times on one GPU: datasheet peaks times a few fitted constants per architecture.

A kernel takes ``max(flops / (peak x eff), bytes / (bandwidth x mem_eff), launch_s)``: the
roofline (a kernel is bound by its slower resource, compute or memory traffic, and never
beats its launch), and a layer pass adds ``layer_s`` (host-side work per module: Python,
hooks, synchronisation). ``peak`` is the datasheet peak of the math mode actually used
(``math_mode``): 16-bit tensor cores for bf16/fp16, TF32 tensor cores for fp32 on GPUs that
have them when TF32 is allowed, CUDA-core fp32 otherwise; the memory-efficient attention
kernel has its own (``ops.KernelUnit``). Each of the three units has its own efficiency: what a
GPU reaches of its TF32 peak says little about its 16-bit peak (other tile shapes, other power
draw), so fp32 measurements never set the efficiency bf16 plans are priced with. A GEMM's
efficiency grows with its arithmetic intensity up to the ridge point (``bandwidth x mem_eff /
(peak x eff)`` FLOP per byte), so skinny GEMMs and the ``s x s`` score GEMMs run far from peak
and wide ones reach ``eff``.

The constants (``ArchConstants``) are per architecture family, fitted to measured profiles
(``cost/calibrate.py``) and shipped in ``data/calibration.yaml`` with their sources; a family
nobody measured uses the calibration's ``fallback`` (the constants fitted across every
measured family: what measured GPUs reach of their datasheets) and is reported as such.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ethpipe.catalog import GpuSpec
from ethpipe.cost.ops import Kernel
from ethpipe.cost.sustained import LOAD_EXPONENT_MAX, LOAD_REF_S, sample_floor_s, slot_powered, slot_powered_id, sustained_s
from ethpipe.errors import UserError, parse_error_summary

CALIBRATION_VERSION = 5  # 2: roofline kernels and a fallback family; 3: TF32 apart from 16-bit tensor cores;
# 4: the runtime's gradient accumulation in every backward, per-GPU compute factors; 5: each runtime's own
# elementwise kernels (cost/elementwise.py), where 4's constants absorbed the runtime's unpriced ones
CONSTANT_NAMES = ("tensor_eff", "tf32_eff", "simd_eff", "mem_eff", "launch_s", "layer_s")
UNITS = ("tensor", "tf32", "simd")  # math units, in the order of their efficiencies in CONSTANT_NAMES
UNIT_LABELS = {"tensor": "16-bit tensor-core", "tf32": "TF32 tensor-core", "simd": "fp32 CUDA-core"}
assert CONSTANT_NAMES[:len(UNITS)] == tuple(f"{u}_eff" for u in UNITS), "unit efficiencies lead, in UNITS order"
TENSOR_ARCHS = ("volta", "turing", "ampere", "ada", "hopper", "cdna")


@dataclass(frozen=True)
class ArchConstants:
    """What one GPU architecture family reaches of its datasheet numbers."""

    tensor_eff: float  # fraction of the 16-bit (bf16 / fp16) tensor-core peak that large GEMMs reach
    tf32_eff: float  # fraction of the TF32 tensor-core peak that large fp32 GEMMs reach
    simd_eff: float  # fraction of the CUDA-core fp32 peak that large GEMMs reach
    mem_eff: float  # fraction of the datasheet memory bandwidth that streaming kernels reach
    launch_s: float  # per kernel (launch + tail)
    layer_s: float  # per layer pass (framework overhead)
    source: str = ""
    fitted: tuple[str, ...] = ()  # which constants came from measurements (the rest are defaults)

    def over(self, base: ArchConstants) -> ArchConstants:
        """These constants where ``fitted`` (measured), ``base``'s elsewhere."""
        if set(CONSTANT_NAMES) <= set(self.fitted):
            return self
        values = {n: getattr(self if n in self.fitted else base, n) for n in CONSTANT_NAMES}
        fitted = tuple(n for n in CONSTANT_NAMES if n in self.fitted or n in base.fitted)
        source = self.source if base.source in self.source else f"{self.source}; the other constants: {base.source}"
        return ArchConstants(**values, source=source, fitted=fitted)

    def unit_effs(self) -> tuple[float, float, float]:
        """The math units' efficiencies, indexed as ``UNITS``."""
        return self.tensor_eff, self.tf32_eff, self.simd_eff

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fitted"] = list(self.fitted)
        return out


# Physical defaults (the fit's prior, and what a calibration without a fallback uses): cuBLAS-class
# GEMMs reach ~70% of tensor peak (16-bit or TF32) and ~90% of CUDA-core fp32 peak; streaming kernels
# ~85% of the datasheet bandwidth (STREAM-like); ~5 us per launch; ~50 us of host work per module.
DEFAULT_CONSTANTS = ArchConstants(tensor_eff=0.7, tf32_eff=0.7, simd_eff=0.9, mem_eff=0.85, launch_s=5e-6,
                                  layer_s=50e-6, source="defaults (no measurement)")


@dataclass(frozen=True)
class DeviceScale:
    """What a training run measured of one device type against the model that priced it (`ethpipe calibrate
    --from-run`): its forward and backward compute take ``fwd_scale`` / ``bwd_scale`` times the model's time.

    Per device type, not per family: the user's GPUs of one type share clocks, power caps and drivers that
    others of the family need not (and emulated or inline types have no family at all)."""

    fwd_scale: float
    bwd_scale: float
    source: str = ""
    num_observations: int = 0

    def __post_init__(self) -> None:
        if not (self.fwd_scale > 0 and self.bwd_scale > 0):
            raise UserError(f"device scales must be positive, got {self.fwd_scale} / {self.bwd_scale}")

    @property
    def train_scale(self) -> float:
        """The scale of a whole training pass (backward ~2x the forward's FLOPs)."""
        return (self.fwd_scale + 2 * self.bwd_scale) / 3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuFactor:
    """What one GPU type (a SKU) sustains of its family's compute: a 70 W T4 or L4 runs its tensor cores at far
    lower clocks than the 280 W Titan RTX or the L40S of its family, under the same datasheet ratios. Fitted
    with the family (``cost/calibrate.py``); 1 for a GPU nobody measured (its family's constants alone)."""

    compute_scale: float  # multiplies the GPU's math-unit peaks (every unit: the power cap limits them all)
    num_observations: int = 0
    median_abs_error: float | None = None  # the fit's median |relative error| on this GPU's own data
    source: str = ""
    load_exponent: float = 0.0  # a slot-powered card's sustained-load slowdown (``sustained_s``); 0 elsewhere

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Calibration:
    """Fitted constants by architecture family (``data/calibration.yaml`` or `ethpipe calibrate`).

    ``fallback`` prices families nobody measured: the constants the fit puts at the centre of
    every measured family (datasheet peaks x what measured GPUs reach of theirs). ``devices`` scales
    the compute of single device types to what a run of them measured (``DeviceScale``).
    """

    architectures: Mapping[str, ArchConstants]
    source: str = ""
    fallback: ArchConstants | None = None
    devices: Mapping[str, DeviceScale] = field(default_factory=dict)
    gpus: Mapping[str, GpuFactor] = field(default_factory=dict)  # per catalog GPU id (``GpuFactor``)

    def compute_scale(self, gpu_id: str) -> float:
        """The GPU type's sustained share of its family's compute (1 where it was never measured)."""
        factor = self.gpus.get(gpu_id)
        return factor.compute_scale if factor is not None else 1.0

    def load_exponent(self, gpu: GpuSpec) -> float:
        """The GPU type's sustained-load exponent (``sustained_s``): its own where measured; a slot-powered card
        nobody measured takes the mean of the measured slot-powered cards' (0 where none was)."""
        if not slot_powered(gpu):
            return 0.0  # a card with its own power connector holds its clocks, whatever a file says
        factor = self.gpus.get(gpu.id)
        if factor is not None and factor.num_observations:
            return factor.load_exponent
        measured = [f.load_exponent for f in self.measured_slot_powered().values()]
        return sum(measured) / len(measured) if measured else 0.0

    def measured_slot_powered(self) -> dict[str, GpuFactor]:
        """The measured slot-powered cards' factors: what an unmeasured one's load exponent is made of."""
        return {g: f for g, f in self.gpus.items() if f.num_observations and slot_powered_id(g)}

    def price_source(self, gpu_id: str, arch: str) -> str:
        """Where a GPU type's compute price comes from: its own measurements, its family's, or the fallback."""
        factor = self.gpus.get(gpu_id)
        if factor is not None and factor.num_observations:
            error = "" if factor.median_abs_error is None else f", median |error| {factor.median_abs_error:.0%}"
            return f"measured on this GPU ({factor.num_observations} timings{error})"
        if arch in self.architectures and self.architectures[arch].fitted:
            return f"its family ({arch}) measured, this GPU not"
        return "no measurement of it or its family: the fallback constants"

    def constants(self, arch: str) -> tuple[ArchConstants, bool]:
        """(constants, calibrated?) of an architecture family."""
        if arch in self.architectures and self.architectures[arch].fitted:
            return self.architectures[arch], True
        return self.fallback or DEFAULT_CONSTANTS, False

    def merged(self, other: Calibration) -> Calibration:
        """``other``'s families win (a user's calibration over the shipped one), constant by constant: what
        ``other``'s profiles inform replaces the base's, the rest stays the base's (bf16 profiles say nothing of
        TF32, so they keep the family's fitted TF32 efficiency). The base's fallback stays, being fitted on more
        families than one user's GPUs."""
        archs = dict(self.architectures)
        for name, theirs in other.architectures.items():
            ours = archs.get(name)
            archs[name] = theirs.over(ours) if ours is not None and ours.fitted else theirs
        return Calibration(archs, other.source or self.source, self.fallback or other.fallback,
                           {**self.devices, **other.devices}, {**self.gpus, **other.gpus})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": CALIBRATION_VERSION, "source": self.source,
                               "architectures": {k: v.to_dict() for k, v in sorted(self.architectures.items())}}
        if self.fallback is not None:
            out["fallback"] = self.fallback.to_dict()
        if self.devices:
            out["devices"] = {k: v.to_dict() for k, v in sorted(self.devices.items())}
        if self.gpus:
            out["gpus"] = {k: v.to_dict() for k, v in sorted(self.gpus.items())}
        return out


def _constants_from_dict(raw: Any, where: str, name: str) -> ArchConstants:
    try:
        values = {k: float(raw[k]) for k in CONSTANT_NAMES}
        fitted = tuple(str(x) for x in raw.get("fitted", CONSTANT_NAMES))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(f"{where} field '{name}' is missing or has a malformed {err}") from None
    if min(values[k] for k in CONSTANT_NAMES if k.endswith("_eff")) <= 0:
        raise UserError(f"{where} field '{name}': efficiencies must be positive")
    return ArchConstants(**values, source=str(raw.get("source", "")), fitted=fitted)


CALIBRATE_FIX = "re-run `ethpipe calibrate` on the profiles it was fitted to"


def calibration_from_dict(data: Any, where: str = "calibration", fix: str = CALIBRATE_FIX) -> Calibration:
    if not isinstance(data, dict):
        raise UserError(f"{where} is not a mapping of calibration fields: {fix}")
    if data.get("version") != CALIBRATION_VERSION:
        found = f"not {data['version']!r}" if "version" in data else "and is missing"
        raise UserError(f"{where} field 'version' must be {CALIBRATION_VERSION} (the current compute model's "
                        f"constants), {found}: {fix}")
    archs = {str(name): _constants_from_dict(raw, where, f"architectures.{name}")
             for name, raw in (data.get("architectures") or {}).items()}
    fallback = _constants_from_dict(data["fallback"], where, "fallback") if data.get("fallback") else None
    devices = {}
    for name, raw in (data.get("devices") or {}).items():
        try:
            devices[str(name)] = DeviceScale(float(raw["fwd_scale"]), float(raw["bwd_scale"]),
                                             str(raw.get("source", "")), int(raw.get("num_observations", 0)))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UserError(f"{where} field 'devices.{name}' is missing or has a malformed {err}: {fix}") from None
    gpus = {}
    for name, raw in (data.get("gpus") or {}).items():
        try:
            error = raw.get("median_abs_error")
            gpus[str(name)] = GpuFactor(float(raw["compute_scale"]), int(raw.get("num_observations", 0)),
                                        None if error is None else float(error), str(raw.get("source", "")),
                                        float(raw.get("load_exponent", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UserError(f"{where} field 'gpus.{name}' is missing or has a malformed {err}: {fix}") from None
        if not gpus[str(name)].compute_scale > 0:
            raise UserError(f"{where} field 'gpus.{name}.compute_scale' must be positive: {fix}")
        if not 0.0 <= gpus[str(name)].load_exponent <= LOAD_EXPONENT_MAX:
            raise UserError(f"{where} field 'gpus.{name}.load_exponent' must be in [0, {LOAD_EXPONENT_MAX}]: {fix}")
    return Calibration(archs, str(data.get("source", "")), fallback, devices, gpus)


def recorded_calibration(data: Any, where: str) -> Calibration | None:
    """The constants a plan recorded; None where it records none, or records constants of an earlier compute
    model (a lower ``version``: they do not describe today's kernel times, so the shipped ones price it)."""
    if not data:
        return None
    if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] < CALIBRATION_VERSION:
        return None
    return calibration_from_dict(data, where, fix="re-make the plan with this ethpipe")


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
        raise UserError(f"catalog file '{path}' is not valid YAML: {parse_error_summary(err)}") from None
    return shipped_calibration().merged(calibration_from_dict(data, f"catalog file '{path}'"))


def math_mode(gpu: GpuSpec, dtype: str, tf32: bool) -> tuple[str, float]:
    """(unit, peak TFLOP/s) GEMMs run at: one of ``UNITS`` ('tensor' 16-bit, 'tf32', 'simd' CUDA cores)."""
    if dtype in ("bf16", "fp16"):
        return ("tensor" if gpu.arch in TENSOR_ARCHS else "simd"), gpu.peak_tflops
    if tf32 and gpu.tf32_tflops > 0:
        return "tf32", gpu.tf32_tflops
    return "simd", gpu.peak_fp32_tflops or gpu.peak_tflops


def has_hardware_model(gpu: GpuSpec) -> bool:
    """The per-kernel model needs an architecture family and a memory bandwidth (inline GPUs may lack both)."""
    return bool(gpu.arch) and gpu.memory_bandwidth_gbps > 0


KernelLines = tuple[tuple[int, float, float, float, float], ...]  # DeviceCompute.kernel_lines


def pass_s(constants: ArchConstants, terms: Iterable[tuple[int, float, float]]) -> float:
    """One layer pass: each kernel's ``max(compute_s / eff[unit], memory_s / mem_eff, launch_s)`` over its
    (unit, compute_s at 100% of peak, memory_s at 100% of bandwidth) terms, plus ``layer_s``."""
    effs = constants.unit_effs()
    return sum(max(compute_s / effs[unit], memory_s / constants.mem_eff, constants.launch_s)
               for unit, compute_s, memory_s in terms) + constants.layer_s


TF32X3_PASSES = 3  # 3xTF32 emulates one fp32 product with three TF32 MMAs (big*big + big*small + small*big)


@dataclass(frozen=True)
class DeviceCompute:
    """Prices kernels on one GPU type in one precision."""

    gpu: GpuSpec
    constants: ArchConstants
    calibrated: bool
    unit: str
    peak_tflops: float
    dtype: str = "bf16"
    compute_scale: float = 1.0  # the GPU type's sustained share of its family's compute (``GpuFactor``)
    load_exponent: float = 0.0  # a slot-powered card's sustained-load slowdown (``sustained_s``)

    @classmethod
    def build(cls, gpu: GpuSpec, calibration: Calibration, dtype: str, tf32: bool) -> DeviceCompute:
        unit, peak = math_mode(gpu, dtype, tf32)
        constants, calibrated = calibration.constants(gpu.arch)
        return cls(gpu, constants, calibrated, unit, peak, dtype, calibration.compute_scale(gpu.id),
                   calibration.load_exponent(gpu))

    def _unit_of(self, kernel: Kernel) -> tuple[int, float, float]:
        """(index in ``UNITS``, peak TFLOP/s, FLOPs executed) of a kernel's matrix work."""
        unit, peak, flops = self.unit, self.peak_tflops, kernel.flops
        if kernel.unit == "fmha" and self.dtype == "fp32":
            if self.gpu.tf32_tflops > 0:
                unit, peak, flops = "tf32", self.gpu.tf32_tflops, TF32X3_PASSES * kernel.flops
            else:
                unit, peak = "simd", self.gpu.peak_fp32_tflops or self.gpu.peak_tflops
        return UNITS.index(unit), peak, flops

    def kernel_terms(self, kernels: Iterable[Kernel]) -> list[tuple[int, float, float]]:
        """Per kernel: (unit index, compute seconds at 100% of peak, memory seconds at 100% of bandwidth).

        What the fit (``cost/calibrate.py``) needs: a kernel's time is ``max(compute_s / eff[unit],
        memory_s / mem_eff, launch_s)``.
        """
        bw = self.gpu.memory_bandwidth_gbps * 1e9
        out = []
        for k in kernels:
            unit, peak, flops = self._unit_of(k)
            out.append((unit, flops / (peak * 1e12 * self.compute_scale), k.num_bytes / bw))
        return out

    def layer_s(self, kernels: Iterable[Kernel]) -> float:
        return pass_s(self.constants, self.kernel_terms(kernels))

    def kernel_lines(self, at_one: Iterable[Kernel], at_two: Iterable[Kernel]) -> KernelLines:
        """Per kernel (unit, compute_s, compute step_s, memory_s, memory step_s) from one layer pass's kernels at
        micro-batch 1 and 2: exact lines, since FLOPs and bytes are affine in the micro-batch."""
        return tuple((u, c1, c2 - c1, m1, m2 - m1)
                     for (u, c1, m1), (_, c2, m2) in zip(self.kernel_terms(at_one), self.kernel_terms(at_two),
                                                         strict=True))

    def lines_s(self, lines: KernelLines, micro_batch: int) -> float:
        """``layer_s`` of the pass at ``micro_batch`` from its kernel lines (no kernel list to rebuild), under the
        card's sustained-load clocks (``sustained_s``)."""
        return float(sustained_s(self._full_clock_s(lines, micro_batch), self.load_exponent))

    def _full_clock_s(self, lines: KernelLines, micro_batch: int) -> float:
        extra = micro_batch - 1
        return pass_s(self.constants, ((u, c1 + extra * dc, m1 + extra * dm) for u, c1, dc, m1, dm in lines))

    def per_sample_s(self, lines: KernelLines) -> float:
        """Seconds per extra sample at large micro-batches: each kernel's compute or memory step, whichever
        binds. Pass times are convex in the micro-batch (rooflines over a floor), so no micro-batch runs a
        sample faster: ``lines_s(b) / b >= per_sample_s`` for every b; a slot-powered card's floor counts its
        slowdown too (``sustained.sample_floor_s``)."""
        c = self.constants
        effs = c.unit_effs()
        marginal = sum(max(dc / effs[u], dm / c.mem_eff) for u, _, dc, _, dm in lines)
        return sample_floor_s(lambda b: self._full_clock_s(lines, b), marginal, self.load_exponent)

    def describe(self) -> str:
        if self.calibrated:
            state = "calibrated"
        elif self.constants.fitted:
            state = "uncalibrated family (datasheet peaks x the efficiencies fitted across measured GPUs)"
        else:
            state = "uncalibrated (datasheet, default efficiencies)"
        out = f"{self.gpu.id} {state}: {self.unit} {self.peak_tflops:g} TFLOP/s, {self.gpu.memory_bandwidth_gbps:g} GB/s"
        if self.compute_scale != 1.0:
            out += f" (sustains x{self.compute_scale:.2f} of its family's compute, measured)"
        if self.load_exponent:
            ref_ms = f"{LOAD_REF_S * 1e3:g} ms"
            out += f" (slot-powered: a pass of t > {ref_ms} takes x (t / {ref_ms})^{self.load_exponent:.3f})"
        unit_index = UNITS.index(self.unit)
        if self.constants.fitted and CONSTANT_NAMES[unit_index] not in self.constants.fitted:
            out += (f" (no {UNIT_LABELS[self.unit]} GEMM measured: {self.constants.unit_effs()[unit_index]:.0%} of "
                    "that peak assumed)")
        return out
