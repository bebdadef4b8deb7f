"""CostModel's pricing of stages cut between a layer's attention and its MLP (a mixin: ``cost/model.py`` holds the
state; ``ethpipe.sublayers``).

A half layer is priced from the same kernel inventory as a whole one (``ops.block_kernels(half=...)``: the two
halves' kernels partition the block's): its compute is the block's times the half's share of the block's kernel
time on that device (of its FLOPs where a measured profile or the analytic rate prices the block), so an attention
half and an MLP half add up to the block exactly; each half runs one of the block's two TP all-reduces; a
recomputing half re-runs its own forward. Parameters, gradients and activations are counted per half
(``ModelSpec.attention_params_per_layer``, ``memory.runtime_block_activation_bytes(half=...)``).
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
        """((fwd, bwd) of an attention half, (fwd, bwd) of an MLP half) for one micro-batch: the block's compute
        split by ``attention_share``, one of its two TP all-reduces each, a recomputing half's re-run forward."""
        d, b = device_type, micro_batch
        fwd, bwd = self._compute_s(d, "block", b, tp)  # type: ignore[attr-defined]
        comm_f = self._tp_comm_s(d, tp, "block", b, False) / 2  # type: ignore[attr-defined]
        comm_b = self._tp_comm_s(d, tp, "block", b, True) / 2  # type: ignore[attr-defined]
        share_f, share_b = self.attention_share(d, b, tp, False), self.attention_share(d, b, tp, True)
        again = self.recompute_s(d, b, tp) if recompute else 0.0  # type: ignore[attr-defined]
        return ((fwd * share_f + comm_f, bwd * share_b + comm_b + again * share_f),
                (fwd * (1 - share_f) + comm_f, bwd * (1 - share_b) + comm_b + again * (1 - share_f)))

    def half_stage_compute_s(self, stage: Stage, micro_batch: int) -> tuple[float, float]:
        """(fwd, bwd) of a sub-layer stage's layers for one micro-batch (its ends not included)."""
        (af, ab), (mf, mb) = self.half_layer_times_s(stage.device, micro_batch, stage.tp, stage.recompute)
        num_attn, num_mlp = stage.halves
        return num_attn * af + num_mlp * mf, num_attn * ab + num_mlp * mb

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
