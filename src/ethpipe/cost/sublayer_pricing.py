"""CostModel's pricing of stages cut between a layer's attention and its MLP (a mixin: ``cost/model.py`` holds the
state; ``ethpipe.sublayers``).

A half layer is priced from the same kernel inventory as a whole one (``ops.block_kernels(half=...)``: the two
halves' kernels partition the block's): its compute is the block's times the half's share of the block's kernel
time on that device (of its FLOPs where a measured profile or the analytic rate prices the block), so an attention
half and an MLP half add up to the block exactly; each half runs one of the block's two TP all-reduces; a
recomputing half re-runs what torch's checkpoint re-runs of it (a lone attention half: not its output projection).
Parameters, gradients and activations are counted per half (``ModelSpec.attention_params_per_layer``,
``memory.runtime_block_activation_bytes(half=...)``).
"""

from __future__ import annotations

from ethpipe.cost import ops
from ethpipe.plan import Stage
from ethpipe.sublayers import PARTS

HalfTimes = tuple[tuple[float, float], tuple[float, float]]


class SublayerPricing:
    def attention_share(self, device_type: str, micro_batch: int, tp: int, backward: bool) -> float:
        """The attention half's share of one block pass's compute on ``device_type`` (its kernel time, or its
        FLOPs where no kernel model prices the type); the MLP half has the rest."""
        key = ("attention share", device_type, micro_batch, tp, backward)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            halves = [ops.layer_kernels("block", self.model, self.seq_len, micro_batch, tp,  # type: ignore[attr-defined]
                                        self.dtype_bytes, self.attention(device_type), backward,  # type: ignore[attr-defined]
                                        code=self.layer_code, half=half) for half in PARTS]  # type: ignore[attr-defined]
            if self._priced_by_kernels(device_type):  # type: ignore[attr-defined]
                hw = self._hw[device_type]  # type: ignore[attr-defined]
                attn, mlp = (hw.layer_s(ks) for ks in halves)
            else:
                attn, mlp = (sum(k.flops for k in ks) for ks in halves)
            memo[key] = attn / (attn + mlp) if attn + mlp > 0 else 0.5
        return memo[key]  # type: ignore[no-any-return]

    def half_layer_times_s(self, device_type: str, micro_batch: int, tp: int = 1, recompute: bool = False
                           ) -> HalfTimes:
        """((fwd, bwd) of an attention half, (fwd, bwd) of an MLP half) of a whole layer for one micro-batch: the
        block's compute split by ``attention_share``, one of its two TP all-reduces each; recomputing, the MLP half
        re-runs what it re-runs alone (``ops.recompute_kernels(half="mlp")``) and the attention half the rest of
        the layer's re-run, its all-reduce included, so the two add up to ``layer_times_s``. A stage that ends
        after an attention half re-runs less there: ``lone_attention_saving_s``."""
        d, b = device_type, micro_batch
        fwd, bwd = self._compute_s(d, "block", b, tp)  # type: ignore[attr-defined]
        comm_f = self._tp_comm_s(d, tp, "block", b, False) / 2  # type: ignore[attr-defined]
        comm_b = self._tp_comm_s(d, tp, "block", b, True) / 2  # type: ignore[attr-defined]
        share_f, share_b = self.attention_share(d, b, tp, False), self.attention_share(d, b, tp, True)
        again_mlp = self.lone_recompute_s(d, b, tp, "mlp") if recompute else 0.0
        again_attn = self.recompute_s(d, b, tp) - again_mlp if recompute else 0.0  # type: ignore[attr-defined]
        return ((fwd * share_f + comm_f, bwd * share_b + comm_b + again_attn),
                (fwd * (1 - share_f) + comm_f, bwd * (1 - share_b) + comm_b + again_mlp))

    def lone_recompute_s(self, device_type: str, micro_batch: int, tp: int, half: str) -> float:
        """What a lone half layer's recomputing backward re-runs (``ops.recompute_kernels(half=...)``): no TP
        all-reduce (each half's follows its last GEMM, which is not re-run)."""
        key = ("lone recompute", device_type, micro_batch, tp, half)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            fwd, _ = self._compute_s(device_type, "block", micro_batch, tp)  # type: ignore[attr-defined]
            args = (self.model, self.seq_len, micro_batch, tp, self.dtype_bytes,  # type: ignore[attr-defined]
                    self.attention(device_type))  # type: ignore[attr-defined]
            again = ops.recompute_kernels(*args, self.layer_code, half=half)  # type: ignore[attr-defined]
            whole = ops.block_kernels(*args, False, self.layer_code)  # type: ignore[attr-defined]
            if self._priced_by_kernels(device_type):  # type: ignore[attr-defined]
                hw = self._hw[device_type]  # type: ignore[attr-defined]
                share = hw.layer_s(again) / hw.layer_s(whole)
            else:
                share = sum(k.flops for k in again) / sum(k.flops for k in whole)
            memo[key] = fwd * share
        return memo[key]  # type: ignore[no-any-return]

    def lone_attention_saving_s(self, device_type: str, micro_batch: int, tp: int, recompute: bool) -> float:
        """Backward seconds a recomputing stage saves on an attention half that ends it: the half's re-run inside a
        whole layer (``half_layer_times_s``: the layer's re-run less the MLP half's) less its re-run alone (no output
        projection, no all-reduce)."""
        if not recompute:
            return 0.0
        d, b = device_type, micro_batch
        return (self.recompute_s(d, b, tp)  # type: ignore[attr-defined]
                - self.lone_recompute_s(d, b, tp, "mlp") - self.lone_recompute_s(d, b, tp, "attn"))

    def half_stage_compute_s(self, stage: Stage, micro_batch: int) -> tuple[float, float]:
        """(fwd, bwd) of a sub-layer stage's layers for one micro-batch (its ends not included)."""
        return self.halves_compute_s(stage.device, micro_batch, stage.tp, stage.recompute,
                                     (*stage.halves, stage.lone_attention))

    def halves_compute_s(self, device_type: str, micro_batch: int, tp: int, recompute: bool,
                         halves: tuple[int, int, int]) -> tuple[float, float]:
        """(fwd, bwd) of (attention halves, MLP halves, lone attention halves ending the stage) for one micro-batch:
        the one pricing of a half-layer count, for a stage and for the planner's rows (``layers/timing.py``)."""
        (af, ab), (mf, mb) = self.half_layer_times_s(device_type, micro_batch, tp, recompute)
        num_attn, num_mlp, lone = halves
        saved = lone * self.lone_attention_saving_s(device_type, micro_batch, tp, recompute) if lone else 0.0
        return num_attn * af + num_mlp * mf, num_attn * ab + num_mlp * mb - saved

    def half_weight_grad_s(self, stage: Stage, micro_batch: int) -> float:
        """A sub-layer stage's layers' W (``SplitPricing.weight_grad_s``): a whole layer's W split between its
        halves by their weight GEMMs' FLOPs, so the two halves' W add up to the layer's."""
        d, tp, b = stage.device, stage.tp, micro_batch
        _, bwd = self._compute_s(d, "block", b, tp)  # type: ignore[attr-defined]
        layer_w = bwd * self.weight_grad_share(d, "block", b, tp)  # type: ignore[attr-defined]
        wgrad = [sum(k.flops for k in ops.layer_kernels("block", self.model, self.seq_len, b, tp,  # type: ignore[attr-defined]
                                                         self.dtype_bytes, self.attention(d), True,  # type: ignore[attr-defined]
                                                         half=half) if k.name.endswith(".wgrad"))
                 for half in PARTS]
        total = sum(wgrad)
        attn_w = layer_w * wgrad[0] / total if total > 0 else layer_w / 2
        num_attn, num_mlp = stage.halves
        return num_attn * attn_w + num_mlp * (layer_w - attn_w)
