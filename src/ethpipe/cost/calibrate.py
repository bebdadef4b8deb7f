"""Fit the per-architecture constants of ``cost/hardware.py`` to measured layer profiles.

Every measured layer pass is one equation: its time is the sum over its kernels (``cost/ops.py``)
of ``max(compute / eff, memory / mem_eff, launch_s)`` plus ``layer_s`` plus the tensor-parallel
all-reduces priced on the intra-node link. ``fit`` solves all families at once as a maximum a
posteriori estimate (``scipy.optimize.least_squares``), in log space so every constant stays
positive and inside its physical range:

* each measured pass has a relative error with standard deviation ``OBS_SD`` (10%: repeated runs
  of one GPU and model in the Sailor artifact scatter by that much);
* a family's constants sit around a common centre, a factor ``exp(FAMILY_SD)`` apart (GPUs reach
  different fractions of their datasheets, but not arbitrary ones);
* the centre sits around ``prior`` (physical defaults, or the shipped fallback for a user's fit).

So a constant a family's data cannot pin (no TF32 GEMM measured, no launch-bound kernel) takes the
centre's value rather than an arbitrary one, and the centre itself becomes the ``fallback`` that
prices families nobody measured. Profiles of several GPU types and models combine; any model
works because the kernel inventory, not the layer, is what is fitted.

An observation may also be a single op's timing rather than a layer pass (per-op profilers such as
Aceso's or vidur's): ``layer_passes=0`` leaves the per-layer overhead out of it, ``launch_floor=False``
drops the launch floor where the timing is the device's alone (CUDA events around a kernel whose host
launch overlapped earlier work), and ``weight`` scales its residual (so that a layer's dozen op timings
weigh about as much as one layer pass). The defaults are a layer pass as above: layer-pass
observations are priced and fitted exactly as they always were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ethpipe.catalog import GpuSpec, gpu_catalog
from ethpipe.cost import comm, links, ops
from ethpipe.cost.hardware import (
    CONSTANT_NAMES,
    DEFAULT_CONSTANTS,
    UNITS,
    ArchConstants,
    Calibration,
    DeviceCompute,
    GpuFactor,
    pass_s,
)
from ethpipe.cost.profile import LAYER_KINDS, MeasuredProfile
from ethpipe.cost.sustained import LOAD_EXPONENT_MAX, LOAD_EXPONENT_SD, slot_powered_id, sustained_s
from ethpipe.errors import UserError
from ethpipe.model_spec import spec_from_dict

INTRA_NODE_LATENCY_S = 5e-6
OBS_SD = 0.10  # relative scatter of one measured layer pass
FAMILY_SD = (0.3, 0.3, 0.3, 0.3, 1.0, 1.0)  # log-space spread of families around the centre (effs; launch, layer)
CENTRE_SD = (1.0, 1.0, 1.0, 1.0, 2.0, 2.0)  # log-space spread of the centre around the prior
# A GPU type's compute factor around its family (log space): power caps and clocks move a SKU by up to ~2x from
# its family's flagship (a 70 W T4 against the 280 W Titan RTX); bounded to [1/GPU_RANGE, GPU_RANGE].
GPU_SD, GPU_RANGE = 0.5, 4.0
# Physical ranges of x = (1/tensor_eff, 1/tf32_eff, 1/simd_eff, 1/mem_eff, launch_s, layer_s).
_LOWER = np.array([1.0, 1.0, 1.0, 1.0, 1e-7, 1e-7])
_UPPER = np.array([20.0, 20.0, 20.0, 20.0, 1e-3, 5e-3])
_NUM = len(CONSTANT_NAMES)
_MEM, _LAUNCH, _LAYER = 3, 4, 5  # columns of x after the math units' (indexed as hardware.UNITS)

# Link bandwidth (GB/s per direction) for a TP all-reduce of ``num_bytes`` over ``tp`` GPUs of a type.
LinkFn = Callable[[GpuSpec, int, float], float]


TP_ALLREDUCES_PER_BLOCK_PASS = 2  # Megatron: after attention and after the MLP (as CostModel.tp_message_bytes)


def catalog_link_gbps(gpu: GpuSpec, tp: int, num_bytes: float) -> float:
    return gpu.intra_node_gbps


def shipped_link_gbps(gpu: GpuSpec, tp: int, num_bytes: float) -> float:
    """The cost model's own TP all-reduce pricing: the shipped measured curve where the type has one
    (``links.allreduce_gbps``)."""
    return links.allreduce_gbps(gpu, tp, num_bytes)


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
    terms: tuple[tuple[int, float, float], ...]  # per kernel: DeviceCompute.kernel_terms
    comm_s: float  # TP all-reduces, priced on the link (not fitted)
    layer_passes: float = 1.0  # layer_s paid by the measurement: 1 for a layer pass, 0 for one op's timing
    launch_floor: bool = True  # kernels never beat launch_s (False: a device-side timing, no host floor)
    weight: float = 1.0  # multiplies the observation's residual in the fit

    def predict_s(self, constants: ArchConstants, compute_scale: float = 1.0, load_exponent: float = 0.0) -> float:
        """Seconds under ``constants`` and the GPU's ``compute_scale`` and ``load_exponent``
        (``hardware.GpuFactor``)."""
        terms = self.terms if compute_scale == 1.0 else tuple((u, c / compute_scale, m) for u, c, m in self.terms)
        if self.layer_passes == 1.0 and self.launch_floor:
            return float(sustained_s(pass_s(constants, terms), load_exponent)) + self.comm_s
        effs = constants.unit_effs()
        floor = constants.launch_s if self.launch_floor else 0.0
        work = (sum(max(compute_s / effs[unit], memory_s / constants.mem_eff, floor)
                    for unit, compute_s, memory_s in terms) + self.layer_passes * constants.layer_s)
        return float(sustained_s(work, load_exponent)) + self.comm_s

    def predict_with(self, calibration: Calibration) -> float:
        """Seconds as ``calibration`` prices this GPU (its family's constants and its own compute factors)."""
        gpu = gpu_catalog().get(self.gpu)
        exponent = calibration.load_exponent(gpu) if gpu is not None else 0.0
        return self.predict_s(calibration.constants(self.arch)[0], calibration.compute_scale(self.gpu), exponent)


def _x_of(c: ArchConstants) -> np.ndarray:
    return np.array([*(1.0 / e for e in c.unit_effs()), 1.0 / c.mem_eff, c.launch_s, c.layer_s])


def _constants_of(x: np.ndarray, source: str, fitted: tuple[str, ...]) -> ArchConstants:
    return ArchConstants(tensor_eff=float(1.0 / x[0]), tf32_eff=float(1.0 / x[1]), simd_eff=float(1.0 / x[2]),
                         mem_eff=float(1.0 / x[_MEM]), launch_s=float(x[_LAUNCH]), layer_s=float(x[_LAYER]),
                         source=source, fitted=fitted)


def profile_dtype_tf32(profile: MeasuredProfile) -> tuple[str, bool]:
    """The precision a profile was taken in; fp32 without a record assumes TF32 on (PyTorch/Megatron training)."""
    return profile.dtype, True if profile.tf32 is None else profile.tf32


def observations(profile: MeasuredProfile, gpu: GpuSpec, link_gbps: LinkFn = shipped_link_gbps) -> list[Observation]:
    """Every (kind, pass, micro-batch) of ``profile`` measured on ``gpu`` (zero times are 'not captured'),
    priced with the attention implementation, gradient accumulation and layer code the profile recorded."""
    if not gpu.arch or gpu.memory_bandwidth_gbps <= 0:
        raise UserError(f"GPU '{gpu.id}' has no architecture or memory bandwidth in the catalog: it cannot be calibrated")
    model = spec_from_dict(profile.model)
    dtype, tf32 = profile_dtype_tf32(profile)
    device = DeviceCompute.build(gpu, Calibration({}), dtype, tf32)
    attn = ops.attention_impl(gpu.arch, dtype, profile.attention)
    e = profile.dtype_bytes
    out = []
    for kind in LAYER_KINDS:
        for b, timing in sorted(profile.layers.get(kind, {}).items()):
            for backward, measured in ((False, timing.fwd_s), (True, timing.bwd_s)):
                if measured <= 0:
                    continue
                kernels = ops.layer_kernels(kind, model, profile.seq_len, b, profile.tp, e, attn, backward,
                                            profile.grad_accumulation, profile.layer_code)
                comm_s = sum(comm.ring_allreduce_s(profile.tp, n, link_gbps(gpu, profile.tp, n), INTRA_NODE_LATENCY_S)
                             for n in ops.tp_allreduce_bytes(kind, model, profile.seq_len, b, e, backward))
                out.append(Observation(gpu.arch, gpu.id, model.name, kind, backward, b, profile.tp, measured,
                                       tuple(device.kernel_terms(kernels)), comm_s))
    return out


@dataclass(frozen=True)
class _Problem:
    """The observations as flat arrays: one row per kernel, grouped by observation and family."""

    families: tuple[str, ...]
    obs_family: np.ndarray  # family index of each observation
    gpus: tuple[str, ...]
    obs_gpu: np.ndarray  # GPU index of each observation (its compute factor)
    slot_gpus: tuple[int, ...]  # indices of the slot-powered GPUs (``cost/sustained.py``): each has a load exponent
    measured_s: np.ndarray
    comm_s: np.ndarray
    kernel_obs: np.ndarray  # observation index of each kernel
    kernel_unit: np.ndarray
    kernel_compute_s: np.ndarray  # at 100% of peak
    kernel_memory_s: np.ndarray  # at 100% of bandwidth
    obs_layer: np.ndarray | None = None  # layer_passes of each observation (None: all 1)
    obs_weight: np.ndarray | None = None  # weight of each observation (None: all 1)
    kernel_floor: np.ndarray | None = None  # 1 where the kernel has the launch floor (None: all)

    @classmethod
    def of(cls, obs: Sequence[Observation]) -> _Problem:
        families = tuple(sorted({o.arch for o in obs}))
        index = {f: i for i, f in enumerate(families)}
        rows = [(i, u, c, m, float(o.launch_floor)) for i, o in enumerate(obs) for u, c, m in o.terms]
        k = np.array(rows, dtype=float).reshape(-1, 5)
        layer = np.array([o.layer_passes for o in obs], dtype=float)
        weight = np.array([o.weight for o in obs], dtype=float)
        floor = k[:, 4]
        gpus = tuple(sorted({o.gpu for o in obs}))
        gpu_index = {g: i for i, g in enumerate(gpus)}
        slot = tuple(i for i, g in enumerate(gpus) if slot_powered_id(g))
        return cls(families, np.array([index[o.arch] for o in obs]), gpus, np.array([gpu_index[o.gpu] for o in obs]),
                   slot,
                   np.array([o.measured_s for o in obs]),
                   np.array([o.comm_s for o in obs]), k[:, 0].astype(int), k[:, 1].astype(int), k[:, 2], k[:, 3],
                   None if np.all(layer == 1.0) else layer, None if np.all(weight == 1.0) else weight,
                   None if np.all(floor == 1.0) else floor)

    def _terms_s(self, x: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
        """(kernels x 3) compute, memory and launch seconds of every kernel for per-family constants ``x`` and
        per-GPU compute factors ``scale`` (None: all 1)."""
        fam = self.obs_family[self.kernel_obs]
        launch = x[fam, _LAUNCH] if self.kernel_floor is None else x[fam, _LAUNCH] * self.kernel_floor
        compute = self.kernel_compute_s * x[fam, self.kernel_unit]
        if scale is not None:
            compute = compute / scale[self.obs_gpu[self.kernel_obs]]
        return np.stack([compute, self.kernel_memory_s * x[fam, _MEM], launch], axis=1)

    def predict_s(self, x: np.ndarray, scale: np.ndarray | None = None,
                  exponent: np.ndarray | None = None) -> np.ndarray:
        """Predicted seconds of every observation for per-family constants ``x`` (families x constants),
        per-GPU compute factors ``scale`` and per-GPU load exponents ``exponent`` (None: all 0)."""
        kernel_s = self._terms_s(x, scale).max(axis=1)
        per_obs = np.bincount(self.kernel_obs, weights=kernel_s, minlength=len(self.measured_s))
        layer = x[self.obs_family, _LAYER] if self.obs_layer is None else x[self.obs_family, _LAYER] * self.obs_layer
        work = per_obs + layer
        if exponent is not None:
            work = sustained_s(work, exponent[self.obs_gpu])
        return work + self.comm_s

    def informed(self, x: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
        """(families x constants) which constants each family's data inform at ``x``: a unit's efficiency where
        one of its kernels is compute-bound, mem_eff where one is memory-bound, launch_s where one sits on the
        floor; layer_s where any observation pays it (every layer pass does)."""
        fam = self.obs_family[self.kernel_obs]
        binding = self._terms_s(x, scale).argmax(axis=1)
        floor = np.ones(len(fam), dtype=bool) if self.kernel_floor is None else self.kernel_floor > 0
        layer = np.ones(len(self.measured_s), dtype=bool) if self.obs_layer is None else self.obs_layer > 0
        out = np.zeros((len(self.families), _NUM), dtype=bool)
        for f in range(len(self.families)):
            mine = fam == f
            units = [bool(np.any(mine & (binding == 0) & (self.kernel_unit == u))) for u in range(len(UNITS))]
            out[f] = [*units, bool(np.any(mine & (binding == 1))), bool(np.any(mine & (binding == 2) & floor)),
                      bool(np.any(layer & (self.obs_family == f)))]
        return out


def fit(obs: Iterable[Observation], source: str = "", prior: ArchConstants = DEFAULT_CONSTANTS) -> Calibration:
    """One set of constants per architecture family found in ``obs``, their centre as the fallback, and each
    measured GPU type's compute factor around its family (``hardware.GpuFactor``)."""
    from scipy.optimize import least_squares  # imported here: planning never needs scipy

    obs = list(obs)
    if not obs:
        return Calibration({}, source)
    problem = _Problem.of(obs)
    num_families, num_gpus, num_slot = len(problem.families), len(problem.gpus), len(problem.slot_gpus)
    family_sd, centre_sd = np.array(FAMILY_SD), np.array(CENTRE_SD)
    log_prior = np.log(np.clip(_x_of(prior), _LOWER, _UPPER))
    num_x = _NUM * (num_families + 1)
    num_v = num_x + num_gpus
    slot = list(problem.slot_gpus)

    def unpack(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        exponents = np.zeros(num_gpus)
        exponents[slot] = v[num_v:]
        return v[:_NUM], v[_NUM:num_x].reshape(num_families, _NUM), np.exp(v[num_x:num_v]), exponents

    def residuals(v: np.ndarray) -> np.ndarray:
        centre, fams, gpus, exponents = unpack(v)
        rel = (problem.predict_s(np.exp(fams), gpus, exponents) - problem.measured_s) / problem.measured_s / OBS_SD
        if problem.obs_weight is not None:
            rel = rel * problem.obs_weight
        return np.concatenate([rel, ((fams - centre) / family_sd).ravel(), (centre - log_prior) / centre_sd,
                               v[num_x:num_v] / GPU_SD, v[num_v:] / LOAD_EXPONENT_SD])

    lo = np.concatenate([np.tile(np.log(_LOWER), num_families + 1), np.full(num_gpus, -np.log(GPU_RANGE)),
                         np.zeros(num_slot)])
    hi = np.concatenate([np.tile(np.log(_UPPER), num_families + 1), np.full(num_gpus, np.log(GPU_RANGE)),
                         np.full(num_slot, LOAD_EXPONENT_MAX)])
    start = np.clip(np.concatenate([np.tile(log_prior, num_families + 1), np.zeros(num_gpus + num_slot)]),
                    lo + 1e-9, hi - 1e-9)
    solution = least_squares(residuals, start, bounds=(lo, hi), x_scale=1.0, ftol=1e-12, xtol=1e-12, gtol=1e-12)
    log_centre, log_fams, scales, exponents = unpack(solution.x)
    centre, fams = np.exp(log_centre), np.exp(log_fams)
    informed = problem.informed(fams, scales)
    note = f"{source}; " if source else ""
    archs = {}
    for i, family in enumerate(problem.families):
        group = [o for o in obs if o.arch == family]
        gpus = ", ".join(sorted({o.gpu for o in group}))
        models = ", ".join(sorted({o.model for o in group}))
        fitted = tuple(name for name, ok in zip(CONSTANT_NAMES, informed[i]) if ok)
        passes = sum(o.layer_passes == 1.0 for o in group)
        what = f"{len(group)} layer passes" if passes == len(group) else \
            f"{passes} layer passes and {len(group) - passes} op timings"
        archs[family] = _constants_of(fams[i], f"{note}fitted to {what} ({gpus}; {models})", fitted)
    anywhere = tuple(name for name, ok in zip(CONSTANT_NAMES, informed.any(axis=0)) if ok)
    fallback = _constants_of(centre, f"{note}centre of {num_families} measured families "
                                     f"({', '.join(problem.families)}): for families nobody measured", anywhere)
    errors = np.abs(problem.predict_s(fams, scales, exponents) / problem.measured_s - 1)
    factors = {}
    for g, gpu in enumerate(problem.gpus):
        mine = problem.obs_gpu == g
        factors[gpu] = GpuFactor(float(scales[g]), int(mine.sum()), float(np.median(errors[mine])),
                                 f"{note}fitted with its family ({int(mine.sum())} timings)", float(exponents[g]))
    return Calibration(archs, source, fallback, gpus=factors)


def relative_errors(obs: Iterable[Observation], calibration: Calibration) -> list[float]:
    """(predicted - measured) / measured for each observation."""
    return [(o.predict_with(calibration) - o.measured_s) / o.measured_s for o in obs]
