"""Fit the per-architecture constants of ``cost/hardware.py`` to measured layer profiles.

Every measured layer pass gives one equation: its time is linear in ``x = (1/tensor_eff,
1/simd_eff, 1/mem_eff, launch_s, layer_s)`` with coefficients from the kernel inventory
(``cost/ops.py``) and the GPU's datasheet numbers, plus the tensor-parallel all-reduces priced
on the intra-node link. ``fit`` solves these per architecture family by least squares on the
*relative* error (numpy), keeping every constant physical (efficiencies in (0, 1], times >= 0):
a constant the data cannot pin (no fp32 CUDA-core GEMMs measured, say) or that would leave its
range keeps its default and is not listed in ``fitted``. Profiles of several GPU types and
models combine; any model works because the inventory, not the layer, is what is fitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ethpipe.catalog import GpuSpec
from ethpipe.cost import comm, links, ops
from ethpipe.cost.hardware import CONSTANT_NAMES, DEFAULT_CONSTANTS, ArchConstants, Calibration, DeviceCompute
from ethpipe.cost.profile import LAYER_KINDS, MeasuredProfile
from ethpipe.errors import UserError
from ethpipe.model_spec import spec_from_dict

INTRA_NODE_LATENCY_S = 5e-6
# Physical ranges of x = (1/tensor_eff, 1/simd_eff, 1/mem_eff, launch_s, layer_s).
_LOWER = np.array([1.0, 1.0, 1.0, 0.0, 0.0])
_UPPER = np.array([20.0, 20.0, 20.0, 1e-3, 5e-3])

# Link bandwidth (GB/s per direction) for a TP all-reduce of ``num_bytes`` over ``tp`` GPUs of a type.
LinkFn = Callable[[GpuSpec, int, float], float]


TP_ALLREDUCES_PER_BLOCK_PASS = 2  # Megatron: after attention and after the MLP (= CostModel's)


def catalog_link_gbps(gpu: GpuSpec, tp: int, num_bytes: float) -> float:
    return gpu.intra_node_gbps


def shipped_link_gbps(gpu: GpuSpec, tp: int, num_bytes: float) -> float:
    """The cost model's own intra-node pricing: the shipped measured curve where the type has one."""
    return links.intra_gbps(gpu, tp, num_bytes)


@dataclass(frozen=True)
class Observation:
    """One measured layer pass and what the model needs to price it."""

    arch: str
    gpu: str
    model: str
    kind: str
    backward: bool
    micro_batch: int
    tp: int
    measured_s: float
    features: tuple[float, ...]  # coefficients of x (DeviceCompute.features)
    comm_s: float  # TP all-reduces, priced on the link (not fitted)

    def predict_s(self, constants: ArchConstants) -> float:
        x = _x_of(constants)
        return float(np.dot(self.features, x)) + self.comm_s


def _x_of(c: ArchConstants) -> np.ndarray:
    return np.array([1.0 / c.tensor_eff, 1.0 / c.simd_eff, 1.0 / c.mem_eff, c.launch_s, c.layer_s])


def profile_dtype_tf32(profile: MeasuredProfile) -> tuple[str, bool]:
    """The precision a profile was taken in; fp32 without a record assumes TF32 on (PyTorch/Megatron training)."""
    return profile.dtype, True if profile.tf32 is None else profile.tf32


def observations(profile: MeasuredProfile, gpu: GpuSpec, link_gbps: LinkFn = shipped_link_gbps,
                 attention: ops.Attention | None = None) -> list[Observation]:
    """Every (kind, pass, micro-batch) of ``profile`` measured on ``gpu`` (zero times are 'not captured')."""
    if not gpu.arch or gpu.memory_bandwidth_gbps <= 0:
        raise UserError(f"GPU '{gpu.id}' has no architecture or memory bandwidth in the catalog: it cannot be calibrated")
    model = spec_from_dict(profile.model)
    dtype, tf32 = profile_dtype_tf32(profile)
    device = DeviceCompute.build(gpu, Calibration({}), dtype, tf32)
    attn = attention or ops.attention_impl(gpu.arch, dtype)
    e = profile.dtype_bytes
    out = []
    for kind in LAYER_KINDS:
        for b, timing in sorted(profile.layers.get(kind, {}).items()):
            for backward, measured in ((False, timing.fwd_s), (True, timing.bwd_s)):
                if measured <= 0:
                    continue
                kernels = ops.layer_kernels(kind, model, profile.seq_len, b, profile.tp, e, attn, backward)
                comm_s = sum(comm.ring_allreduce_s(profile.tp, n, link_gbps(gpu, profile.tp, n), INTRA_NODE_LATENCY_S)
                             for n in ops.tp_allreduce_bytes(kind, model, profile.seq_len, b, e, backward))
                out.append(Observation(gpu.arch, gpu.id, model.name, kind, backward, b, profile.tp, measured,
                                       tuple(device.features(kernels)), comm_s))
    return out


def _solve(rows: np.ndarray, target: np.ndarray, fixed: dict[int, float]) -> np.ndarray:
    free = [i for i in range(rows.shape[1]) if i not in fixed]
    x = np.array([fixed.get(i, 0.0) for i in range(rows.shape[1])])
    if free:
        rhs = target - rows[:, list(fixed)] @ np.array(list(fixed.values())) if fixed else target
        sol, *_ = np.linalg.lstsq(rows[:, free], rhs, rcond=None)
        x[free] = sol
    return x


def fit_architecture(obs: Sequence[Observation], defaults: ArchConstants = DEFAULT_CONSTANTS,
                     source: str = "") -> ArchConstants:
    """Least squares on relative error; out-of-range or unidentified constants stay at their defaults."""
    if not obs:
        return defaults
    feats = np.array([o.features for o in obs])
    meas = np.array([o.measured_s for o in obs])
    comm_s = np.array([o.comm_s for o in obs])
    rows, target = feats / meas[:, None], (meas - comm_s) / meas
    default_x = _x_of(defaults)
    # A column pins its constant only if it varies enough relative to the others.
    fixed = {i: default_x[i] for i in range(5) if not np.any(feats[:, i] > 0)}
    for _ in range(6):
        x = _solve(rows, target, fixed)
        bad = [i for i in range(5) if i not in fixed and not (_LOWER[i] <= x[i] <= _UPPER[i])]
        if not bad:
            break
        worst = max(bad, key=lambda i: max(_LOWER[i] - x[i], x[i] - _UPPER[i]) / max(_UPPER[i], 1e-12))
        fixed[worst] = float(np.clip(x[worst], _LOWER[worst], _UPPER[worst]))
    else:  # pragma: no cover - 5 constants, each fixed at most once
        x = _solve(rows, target, fixed)
    fitted = tuple(CONSTANT_NAMES[i] for i in range(5) if i not in fixed or fixed[i] != default_x[i])
    return ArchConstants(tensor_eff=float(1.0 / x[0]), simd_eff=float(1.0 / x[1]), mem_eff=float(1.0 / x[2]),
                         launch_s=float(x[3]),
                         layer_s=float(x[4]), source=source, fitted=fitted)


def fit(obs: Iterable[Observation], source: str = "") -> Calibration:
    """One set of constants per architecture family found in ``obs``."""
    by_arch: dict[str, list[Observation]] = {}
    for o in obs:
        by_arch.setdefault(o.arch, []).append(o)
    archs = {}
    for arch, group in sorted(by_arch.items()):
        gpus = ", ".join(sorted({o.gpu for o in group}))
        models = ", ".join(sorted({o.model for o in group}))
        note = f"{source}; " if source else ""
        archs[arch] = fit_architecture(group, source=f"{note}fitted to {len(group)} layer passes ({gpus}; {models})")
    return Calibration(archs, source)


def relative_errors(obs: Iterable[Observation], calibration: Calibration) -> list[float]:
    """(predicted - measured) / measured for each observation."""
    return [(o.predict_s(calibration.constants(o.arch)[0]) - o.measured_s) / o.measured_s for o in obs]
