"""The cost model every planner method, the estimator and the simulator share (docs/design.md §2.3).

Pure and torch-free. Compute is per kernel (``cost/hardware.py``), or a measured profile's per-layer times where
one is given for a device type (scaled by the FLOPs ratio when taken on another model or sequence length), or
analytic. Stage costs are exposed both per ``Stage`` and as (fixed, per-layer) terms, because decoder blocks are
identical: that linearity is what makes the exact partition search cheap (half layers: ``sublayer_pricing.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ethpipe.catalog import GpuSpec
from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.cost import comm, compute, links, memory, ops
from ethpipe.cost.model_comm import CommPricing
from ethpipe.cost.model_memory import MemoryPricing
from ethpipe.cost.split_pricing import SplitPricing
from ethpipe.cost.sublayer_pricing import SublayerPricing
from ethpipe.cost.p2p import P2pFlows, p2p_flows
from ethpipe.cost.hardware import (
    Calibration, DeviceCompute, KernelLines, has_hardware_model, recorded_calibration, shipped_calibration,
)
from ethpipe.cost.profile import MeasuredProfile
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec, spec_from_dict
from ethpipe.plan import Plan, Stage

# Launch/synchronisation overhead of one layer's kernels per pass: keeps tiny micro-batches
# from looking free. Negligible for real model sizes (a 7B block at b=1, s=4096 takes ~10 ms).
LAYER_OVERHEAD_S = 10e-6


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def dtype_bytes(dtype: str) -> int:
    """Bytes of an activation / gradient element for a training precision name."""
    if dtype not in DTYPE_BYTES:
        raise UserError(f"unknown dtype '{dtype}': use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class CostModel(MemoryPricing, SplitPricing, CommPricing, SublayerPricing):
    cluster: Cluster
    model: ModelSpec
    seq_len: int
    dtype_bytes: int = 2
    profiles: Mapping[str, MeasuredProfile] | None = field(default=None, compare=False)
    dtype: str | None = None  # precision name; None = from dtype_bytes (4 -> fp32, else bf16)
    tf32: bool = True  # fp32 matmuls on TF32 tensor cores where the GPU has them (PyTorch/Megatron training)
    # Attention kernels: "auto" = what PyTorch SDPA (ethpipe's runtime) picks per device and dtype,
    # "materialised" = the unfused s x s path (a Megatron-style runtime; ops.attention_impl).
    attention_mode: str = "auto"
    calibration: Calibration | None = field(default=None, compare=False)  # None = the shipped constants
    # Cross-node p2p NIC sharing of one plan (``cost/p2p.py``; ``with_plan_p2p``); None = every flow alone.
    p2p_flows: P2pFlows | None = field(default=None, compare=False)
    # ZeRO-1 across pipelines (``runtime/sync/zero.py``): each block's AdamW moments and update are split over this
    # many holders (the plan's pipelines); 1 = every rank keeps and updates its stage's whole state.
    optimizer_holders: int = 1
    # What the block sync sums gradients in (``memory.GRAD_REDUCE_CHOICES``): fp32, or bf16 (half the bytes, one copy).
    grad_reduce: str = "fp32"
    layer_code: str = "ethpipe"  # whose elementwise kernels a block runs (cost/elementwise.py): this runtime's
    # Achievable FLOP/s per type, shared by every pricing derived from this one (``replace``, ``on_cluster``) that
    # prices compute alike (else its own: ``__post_init__``): the planner derives one per holder count and idle
    # candidate; a slot-powered card's rate prices 64 batch sizes.
    shared_memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise UserError(f"seq_len must be a positive integer, got {self.seq_len}")
        if self.seq_len > self.model.max_seq_len:
            raise UserError(f"seq_len {self.seq_len} exceeds {self.model.name}'s max_seq_len "
                            f"{self.model.max_seq_len}: use a shorter --seq-len")
        gpus = self.cluster.gpu_specs()
        for name in self.profiles or {}:
            if name not in gpus:
                raise UserError(f"profile given for device type '{name}' which is not in the cluster ({', '.join(gpus)})")
        object.__setattr__(self, "_gpus", gpus)
        dtype = self.dtype or ("fp32" if self.dtype_bytes == 4 else "bf16")
        if dtype_bytes(dtype) != self.dtype_bytes:
            raise ValueError(f"dtype '{dtype}' has {dtype_bytes(dtype)}-byte elements, not {self.dtype_bytes}")
        object.__setattr__(self, "dtype", dtype)
        owner = (self.model, self.seq_len, dtype, self.tf32, self.attention_mode, self.layer_code)
        if self.shared_memo.get("owner") not in (None, owner) or any(  # a pricing derived with other compute
                self.shared_memo.get(k, v) is not v for k, v in (("calibration", self.calibration),
                                                                   ("profiles", self.profiles))):
            object.__setattr__(self, "shared_memo", {})
        self.shared_memo.update(owner=owner, calibration=self.calibration, profiles=self.profiles)
        if self.attention_mode not in ops.ATTENTION_CHOICES:
            raise UserError(f"attention must be one of {', '.join(ops.ATTENTION_CHOICES)}, got {self.attention_mode!r}: "
                            "use --attention auto (the fused kernels PyTorch SDPA runs) or materialised")
        for name, prof in (self.profiles or {}).items():
            prof.check_kernel_modes(name, self.attention_mode, dtype, self.tf32)
        cal = self.calibration or shipped_calibration()
        object.__setattr__(self, "_scales", {t: cal.devices[t] for t in gpus if t in cal.devices})
        object.__setattr__(self, "_price_sources", {t: cal.price_source(g.id, g.arch) for t, g in gpus.items()})
        object.__setattr__(self, "_hw", {t: DeviceCompute.build(g, cal, dtype, self.tf32)
                                         for t, g in gpus.items() if has_hardware_model(g)})
        object.__setattr__(self, "_kernel_memo", {})
        object.__setattr__(self, "_memo", {})  # memory terms and parameter counts: pure in their arguments
        object.__setattr__(self, "_p2p", {})  # p2p seconds by (src, dst, micro-batch): depend on p2p_flows
        s, m = self.seq_len, self.model
        object.__setattr__(self, "_block_flops", compute.block_fwd_flops(m, s))
        object.__setattr__(self, "_head_flops", compute.head_fwd_flops(m, s))
        object.__setattr__(self, "_act_bytes", float(m.hidden_size * s * self.dtype_bytes))
        if self.grad_reduce not in memory.GRAD_REDUCE_CHOICES:
            raise UserError(f"--grad-reduce must be one of {', '.join(memory.GRAD_REDUCE_CHOICES)}, got "
                            f"{self.grad_reduce!r}")
        object.__setattr__(self, "_state_bpp", memory.state_bytes_per_param(self.dtype_bytes, self.optimizer_holders,
                                                                            self.grad_reduce))
        speeds = {t: self.achievable_flops(t) for t in gpus}
        fastest = max(speeds.values())
        object.__setattr__(self, "_speeds", {t: v / fastest for t, v in speeds.items()})

    @classmethod
    def for_plan(cls, plan: Plan, profiles: Mapping[str, MeasuredProfile] | None = None) -> CostModel:
        if plan.cluster is None:
            raise UserError("plan field 'cluster' is missing: re-make the plan with `ethpipe plan`")
        dtype = str(plan.extra.get("dtype", "bf16"))
        calibration = recorded_calibration((plan.extra.get("compute_model") or {}).get("calibration"),
                                           "plan field 'compute_model.calibration'")
        full = cluster_from_dict(plan.cluster)
        cost = cls(full, plan.resolve_model(), plan.seq_len, dtype_bytes=dtype_bytes(dtype), profiles=profiles,
                   dtype=dtype, tf32=bool(plan.extra.get("tf32", True)), calibration=calibration,
                   attention_mode=str(plan.extra.get("attention", "auto")),
                   optimizer_holders=len(plan.pipelines) if plan.shard_optimizer else 1,
                   grad_reduce=str(plan.extra.get("grad_reduce", "fp32")),
                   layer_code=str(plan.extra.get("layer_code", "ethpipe")))
        # Ranks are the non-idle devices in cluster order (docs/plan-format.md, "Idle devices").
        return cost.on_cluster(full.without_devices(plan.idle_device_indices)) if plan.idle_devices else cost

    def with_optimizer_holders(self, holders: int) -> CostModel:
        """This pricing with the AdamW moments sharded over ``holders`` ranks (``planner/devices/sharding.py``);
        the compute memos are shared: kernel and TP times do not depend on it, memory does."""
        out = replace(self, optimizer_holders=holders)
        object.__setattr__(out, "_kernel_memo", self._kernel_memo)  # type: ignore[attr-defined]
        return out

    def on_cluster(self, cluster: Cluster) -> CostModel:
        """The same pricing on ``cluster`` (e.g. ``without_devices``); profiles of types it lacks are dropped."""
        profiles = {t: p for t, p in (self.profiles or {}).items() if t in cluster.gpu_types}
        return CostModel(cluster, self.model, self.seq_len, dtype_bytes=self.dtype_bytes, profiles=profiles or None,
                         dtype=self.dtype, tf32=self.tf32, calibration=self.calibration, attention_mode=self.attention_mode,
                         optimizer_holders=self.optimizer_holders, grad_reduce=self.grad_reduce,
                         layer_code=self.layer_code, shared_memo=self.shared_memo)

    # -- device facts ------------------------------------------------------------------

    def gpu(self, device_type: str) -> GpuSpec:
        try:
            return self._gpus[device_type]  # type: ignore[attr-defined]
        except KeyError:
            raise UserError(f"device type '{device_type}' is not in the cluster") from None

    def device_speed(self, device_type: str) -> float:
        """Relative achievable throughput of one device; the fastest type in the cluster is 1.0."""
        self.gpu(device_type)
        return self._speeds[device_type]  # type: ignore[attr-defined]

    def device_speeds(self) -> dict[str, float]:
        return dict(self._speeds)  # type: ignore[attr-defined]

    def usable_memory_bytes(self, device_type: str) -> int:
        """What a stage may use: the device's memory less the CUDA context and fragmentation
        (``USABLE_MEMORY_FRACTION``) and, on a catalog GPU, NCCL's communicators (``Cluster.comm_reserve_bytes``;
        an inline device's memory figure is the user's own)."""
        gpu = self.gpu(device_type)
        nccl = self.cluster.comm_reserve_bytes if gpu.vendor else 0
        return int(gpu.memory_bytes * memory.USABLE_MEMORY_FRACTION) - nccl

    def achievable_flops(self, device_type: str) -> float:
        """Achievable FLOP/s (over a run-measured ``DeviceScale`` where the calibration has one)."""
        scale = self._scales.get(device_type)  # type: ignore[attr-defined]
        key = ("model_flops", device_type, self.gpu(device_type))  # the spec too: an inline GPU may reuse an id
        flops = self.shared_memo[key] = self.shared_memo.get(key) or self._model_flops(device_type)
        return flops / (scale.train_scale if scale is not None else 1.0)

    def _model_flops(self, device_type: str) -> float:
        """Achievable FLOP/s: the catalog's, or the profile's implied rate on decoder blocks."""
        if self._priced_by_kernels(device_type):
            # Per-sample (marginal) rate over the whole model at large micro-batches: fixed costs
            # amortised, weight-bound GEMMs compute-bound. No micro-batch runs a sample faster
            # (DeviceCompute.per_sample_s), so no plan reaches more (balance efficiency <= 1).
            hw = self._hw[device_type]  # type: ignore[attr-defined]  # a slot-powered card: TP's shorter passes too
            tps = [t for t in (1, 2, 4, 8) if hw.load_exponent and self.model.num_kv_heads % t == 0] or [1]
            block, emb, head = (min(t * sum(hw.per_sample_s(lines) for lines in self._kernel_lines(device_type, k, t))
                                    for t in tps) for k in ("block", "embedding", "head"))
            per_sample_s = self.model.num_layers * block + emb + head
            return compute.model_train_flops(self.model, self.seq_len, 1) / per_sample_s
        if self.profiles and device_type in self.profiles:
            # The whole model's fastest per-sample time over the micro-batch sizes a plan may use (measured, and
            # the profile's extrapolation past them): at micro-batch 1 alone the rate was the slowest, and plans
            # at larger micro-batches priced above the ideal (balance efficiency 1.49 on a CPU profile).
            largest = max((max(points) for points in self.profiles[device_type].layers.values() if points), default=1)
            sizes = sorted({1, *range(1, largest + 1), *(largest * 2 ** k for k in range(1, 7))})
            per_sample_s = min(sum(self.model.num_layers * sum(self._profile_or_analytic(device_type, "block", b))
                                   if kind == "block" else sum(self._profile_or_analytic(device_type, kind, b))
                                   for kind in ("block", "embedding", "head")) / b for b in sizes)
            return compute.model_train_flops(self.model, self.seq_len, 1) / per_sample_s
        return self.gpu(device_type).achievable_flops

    def attention(self, device_type: str) -> ops.Attention:
        """The attention kernel this device type runs (``ops.attention_impl``): SDPA's flash or
        memory-efficient kernel under ``auto``, or the materialised s x s scores when forced."""
        hw = self._hw.get(device_type)  # type: ignore[attr-defined]
        if hw is None:
            return "materialised" if self.attention_mode == "materialised" else "flash"
        return ops.attention_impl(hw.gpu.arch, str(self.dtype), self.attention_mode)

    def compute_model_notes(self) -> dict[str, str]:
        """Per device type, how its compute is priced (calibrated / datasheet / profile / legacy)."""
        notes = {}
        for t in self._gpus:  # type: ignore[attr-defined]
            hw = self._hw.get(t)  # type: ignore[attr-defined]
            if self.profiles and t in self.profiles:
                notes[t] = f"{t} measured profile ({self.profiles[t].device_name})"
            elif hw is None:
                notes[t] = f"{t} uncalibrated (peak x efficiency {self.gpu(t).efficiency:g}: no architecture / bandwidth)"
            else:
                notes[t] = f"{hw.describe()}, {self.attention(t)} attention; price: {self._price_sources[t]}"  # type: ignore[attr-defined]
            scale = self._scales.get(t)  # type: ignore[attr-defined]
            if scale is not None:
                notes[t] += (f"; x{scale.fwd_scale:.3f} forward, x{scale.bwd_scale:.3f} backward as a run measured "
                             f"({scale.num_observations} stage observations)")
            notes[t] += f"; {links.link_note(self.gpu(t))}"
        return notes

    # -- compute -----------------------------------------------------------------------

    def _profile_or_analytic(self, device_type: str, kind: str, micro_batch: int) -> tuple[float, float]:
        """(fwd, bwd) seconds of one layer of ``kind`` at tp=1 without recomputation."""
        prof = self.profiles.get(device_type) if self.profiles else None
        if prof is not None and prof.layers.get(kind):
            fwd, bwd = prof.layer_times_s(kind, micro_batch)  # type: ignore[arg-type]
            scale = self._profile_scale(prof, kind)
            return fwd * scale, bwd * scale
        if device_type in self._hw:  # type: ignore[attr-defined]
            return self._kernel_times_s(device_type, kind, micro_batch, 1)
        if kind == "embedding":
            return LAYER_OVERHEAD_S, LAYER_OVERHEAD_S
        flops = self._block_flops if kind == "block" else self._head_flops  # type: ignore[attr-defined]
        rate = self.gpu(device_type).achievable_flops
        fwd = micro_batch * flops / rate
        return fwd + LAYER_OVERHEAD_S, compute.BACKWARD_FLOPS_FACTOR * fwd + LAYER_OVERHEAD_S

    def _kernel_lines(self, device_type: str, kind: str, tp: int) -> tuple[KernelLines, KernelLines]:
        """(fwd, bwd) per-kernel lines of one layer (``DeviceCompute.kernel_lines``), memoised."""
        key = (device_type, kind, tp)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            hw, attn = self._hw[device_type], self.attention(device_type)  # type: ignore[attr-defined]

            def kernels(b: int, backward: bool) -> list[ops.Kernel]:
                return ops.layer_kernels(kind, self.model, self.seq_len, b, tp, self.dtype_bytes, attn, backward,
                                         code=self.layer_code)
            memo[key] = tuple(hw.kernel_lines(kernels(1, bw), kernels(2, bw)) for bw in (False, True))
        return memo[key]

    def _kernel_times_s(self, device_type: str, kind: str, micro_batch: int, tp: int) -> tuple[float, float]:
        """(fwd, bwd) of one layer from the per-kernel model: each kernel's roofline at this micro-batch
        (piecewise-linear in it, so priced per size from the memoised lines)."""
        key = (device_type, kind, micro_batch, tp)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            hw = self._hw[device_type]  # type: ignore[attr-defined]
            fwd, bwd = self._kernel_lines(device_type, kind, tp)
            memo[key] = hw.lines_s(fwd, micro_batch), hw.lines_s(bwd, micro_batch)
        return memo[key]

    def _priced_by_kernels(self, device_type: str) -> bool:
        """The per-kernel hardware model prices this type: it has one, and no measured profile replaces it."""
        return device_type in self._hw and not (self.profiles and device_type in self.profiles)  # type: ignore[attr-defined]

    def _compute_s(self, device_type: str, kind: str, micro_batch: int, tp: int) -> tuple[float, float]:
        """(fwd, bwd) compute of one layer on one of ``tp`` ranks (no TP communication), scaled to what a run of
        the type measured where the calibration says (``DeviceScale``)."""
        if self._priced_by_kernels(device_type):
            fwd, bwd = self._kernel_times_s(device_type, kind, micro_batch, tp)
        else:
            fwd, bwd = self._profile_or_analytic(device_type, kind, micro_batch)
            fwd, bwd = fwd / tp, bwd / tp
        scale = self._scales.get(device_type)  # type: ignore[attr-defined]
        return (fwd * scale.fwd_scale, bwd * scale.bwd_scale) if scale is not None else (fwd, bwd)

    def _profile_scale(self, prof: MeasuredProfile, kind: str) -> float:
        if prof.seq_len == self.seq_len and prof.model == self.model.to_dict():
            return 1.0
        other = spec_from_dict(prof.model)
        if kind == "block":
            return self._block_flops / compute.block_fwd_flops(other, prof.seq_len)  # type: ignore[attr-defined]
        if kind == "head":
            return self._head_flops / compute.head_fwd_flops(other, prof.seq_len)  # type: ignore[attr-defined]
        return (self.seq_len * self.model.hidden_size) / (prof.seq_len * other.hidden_size)

    def tp_message_bytes(self, kind: str, micro_batch: int, backward: bool) -> list[float]:
        """The runtime's TP all-reduces of one layer pass (``ops.tp_allreduce_bytes``): blocks in the compute
        dtype, the embedding and loss sums in the weights' dtype (fp32 under 16-bit autocast)."""
        return ops.tp_allreduce_bytes(kind, self.model, self.seq_len, micro_batch, self.dtype_bytes, backward,
                                      wide_bytes=memory.GRAD_BYTES_PER_PARAM)

    def tp_allreduce_s(self, device_type: str, tp: int, micro_batch: int, num_bytes: float | None = None) -> float:
        """One TP all-reduce (default: of a micro-batch's activation) on the intra-node link (measured curve if any)."""
        if tp <= 1:
            return 0.0
        n = micro_batch * self._act_bytes if num_bytes is None else num_bytes  # type: ignore[attr-defined]
        return comm.ring_allreduce_s(tp, n, links.allreduce_gbps(self.gpu(device_type), tp, n),
                                     self.cluster.intra_node_latency_s)

    def _tp_comm_s(self, device_type: str, tp: int, kind: str, micro_batch: int, backward: bool) -> float:
        """A layer pass's TP all-reduces (memoised: the planner's bounds ask for every stage of every shape)."""
        if tp <= 1:
            return 0.0
        key = ("tp_comm", device_type, tp, kind, micro_batch, backward)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            memo[key] = sum(self.tp_allreduce_s(device_type, tp, micro_batch, n)
                            for n in self.tp_message_bytes(kind, micro_batch, backward))
        return memo[key]  # type: ignore[no-any-return]

    def layer_times_s(self, device_type: str, micro_batch: int, tp: int = 1, recompute: bool = False) -> tuple[float, float]:
        """(fwd, bwd) seconds of ONE decoder block for one micro-batch (bwd includes recomputation)."""
        fwd, bwd = self._compute_s(device_type, "block", micro_batch, tp)
        fwd_total = fwd + self._tp_comm_s(device_type, tp, "block", micro_batch, False)
        bwd_total = bwd + self._tp_comm_s(device_type, tp, "block", micro_batch, True)
        if recompute:
            bwd_total += self.recompute_s(device_type, micro_batch, tp)
        return fwd_total, bwd_total

    def recompute_s(self, device_type: str, micro_batch: int, tp: int) -> float:
        """What a recomputing block's backward re-runs of its forward (``ops.recompute_kernels``), with its TP
        all-reduce (one of the forward's two)."""
        key = ("recompute", device_type, micro_batch, tp)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            fwd, _ = self._compute_s(device_type, "block", micro_batch, tp)
            attn = self.attention(device_type)
            again = ops.recompute_kernels(self.model, self.seq_len, micro_batch, tp, self.dtype_bytes, attn,
                                          self.layer_code)
            whole = ops.block_kernels(self.model, self.seq_len, micro_batch, tp, self.dtype_bytes, attn, False,
                                      self.layer_code)
            if self._priced_by_kernels(device_type):
                hw = self._hw[device_type]  # type: ignore[attr-defined]
                share = hw.layer_s(again) / hw.layer_s(whole)
            else:  # a measured or analytic layer: the re-run share of the forward's FLOPs
                share = sum(k.flops for k in again) / sum(k.flops for k in whole)
            comm = self._tp_comm_s(device_type, tp, "block", micro_batch, False) * ops.RECOMPUTE_TP_ALLREDUCES / 2
            memo[key] = fwd * share + comm
        return memo[key]  # type: ignore[no-any-return]

    def end_times_s(self, device_type: str, micro_batch: int, tp: int, *, first: bool, last: bool) -> tuple[float, float]:
        """(fwd, bwd) seconds of the embedding (first stage) and final norm + head (last stage), TP comm included."""
        fwd = bwd = 0.0
        for kind in ("embedding",) * first + ("head",) * last:
            f, b = self._compute_s(device_type, kind, micro_batch, tp)
            fwd += f + self._tp_comm_s(device_type, tp, kind, micro_batch, False)
            bwd += b + self._tp_comm_s(device_type, tp, kind, micro_batch, True)
        return fwd, bwd

    def stage_tp_comm_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        """The TP all-reduces inside one micro-batch's passes on ``stage``: part of ``stage_compute_s``, priced on
        the link, so what a run's fit of the compute leaves out (``cost/run_fit.py``)."""
        d, tp, b = stage.device, stage.tp, micro_batch
        if tp <= 1:
            return 0.0, 0.0
        layers = stage.num_layers / stage.sublayers  # each half runs one of a block's two all-reduces
        fwd = layers * (per_layer := self._tp_comm_s(d, tp, "block", b, False))
        rerun = stage.halves[0] - stage.lone_attention if stage.recompute else 0  # ``recompute_s``'s: a lone one, none
        bwd = layers * self._tp_comm_s(d, tp, "block", b, True) + rerun * per_layer * ops.RECOMPUTE_TP_ALLREDUCES / 2
        for kind in ("embedding",) * first + ("head",) * last:
            fwd += self._tp_comm_s(d, tp, kind, b, False)
            bwd += self._tp_comm_s(d, tp, kind, b, True)
        return fwd, bwd

    def stage_compute_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> tuple[float, float]:
        """(fwd, bwd) seconds of one micro-batch on ``stage`` (no p2p; half layers: ``half_stage_compute_s``)."""
        ef, eb = self.end_times_s(stage.device, micro_batch, stage.tp, first=first, last=last)
        if stage.sublayers != 1:
            lf, lb = self.half_stage_compute_s(stage, micro_batch)
            return lf + ef, lb + eb
        lf, lb = self.layer_times_s(stage.device, micro_batch, stage.tp, stage.recompute)
        return stage.num_layers * lf + ef, stage.num_layers * lb + eb

    # -- communication -----------------------------------------------------------------

    def with_plan_p2p(self, plan: Plan) -> CostModel:
        """This cost model with ``plan``'s cross-node p2p NIC sharing (caches shared: they do not depend on it)."""
        out = copy.copy(self)
        object.__setattr__(out, "p2p_flows", p2p_flows(plan, self.cluster))
        object.__setattr__(out, "_p2p", {})
        return out
