"""CostModel's pricing of a split backward (a mixin: ``cost/model.py`` holds the state).

Zero-bubble schedules run a micro-batch's backward as B (input gradient) then W (weight gradients;
``runtime/pipeline/split_backward.py``). W runs each layer's weight-gradient GEMMs (``X^T dY``), a bias or norm
scale's reduction and the embedding's scatter-add; B everything else, TP all-reduces included (they
sit on the input-gradient path). A layer's W is priced as its backward compute times the weight GEMMs'
share of the backward's FLOPs (``ops.layer_kernels``: ``.wgrad`` kernels; the embedding's backward is
all weight gradient), so B + W is exactly the whole backward; the memory-bound kernels a FLOP share
assigns to W in proportion are small next to the GEMMs at training sizes. A recomputing stage never
splits (``schedule.zb_h1``): its W is 0.
"""

from __future__ import annotations

from ethpipe.cost import ops
from ethpipe.plan import Stage


class SplitPricing:
    def weight_grad_share(self, device_type: str, kind: str, micro_batch: int, tp: int) -> float:
        """The weight-gradient share of one layer's backward FLOPs (1 for the embedding)."""
        if kind == "embedding":
            return 1.0
        key = ("wgrad share", device_type, kind, micro_batch, tp)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key not in memo:
            kernels = ops.layer_kernels(kind, self.model, self.seq_len, micro_batch, tp,  # type: ignore[attr-defined]
                                        self.dtype_bytes, self.attention(device_type), True)  # type: ignore[attr-defined]
            total = sum(k.flops for k in kernels)
            memo[key] = sum(k.flops for k in kernels if k.name.endswith(".wgrad")) / total if total > 0 else 0.0
        return memo[key]

    def weight_grad_s(self, stage: Stage, micro_batch: int, *, first: bool, last: bool) -> float:
        """Seconds of one micro-batch's W on ``stage``: the part of its whole backward (``stage_compute_s``)
        W takes over from B (0 on a recomputing stage, which never splits)."""
        if stage.recompute:
            return 0.0
        d, tp, b = stage.device, stage.tp, micro_batch
        half = stage.sublayers != 1  # half layers: each half's own W share (``sublayer_pricing.py``)
        moved = self.half_weight_grad_s(stage, b) if half else 0.0  # type: ignore[attr-defined]
        for kind, count in (("block", 0 if half else stage.num_layers), ("embedding", int(first)), ("head", int(last))):
            if count:
                _, bwd = self._compute_s(d, kind, b, tp)  # type: ignore[attr-defined]
                moved += count * bwd * self.weight_grad_share(d, kind, b, tp)
        return moved

    def held_grad_bytes(self, stage: Stage, micro_batch: int, last: bool = False) -> int:
        """Bytes one micro-batch holds between its B and its W on one rank of ``stage``: the output gradient of
        every weight-consuming op (``runtime/pipeline/split_backward.py`` records them), in the compute dtype: per token
        the two norms' and the two row-parallel outputs' ``h``, the column-parallel q, k, v and MLP-input outputs
        (sharded over TP), and on a last stage the final norm's ``h`` and the head's logits (vocabulary sharded
        over TP). An upper bound: some of these are one tensor (a residual's gradient feeds the norm and the
        output projection alike)."""
        if stage.recompute:
            return 0
        m, tp = self.model, stage.tp  # type: ignore[attr-defined]
        q, kv = m.num_heads * m.head_dim_resolved, m.num_kv_heads * m.head_dim_resolved
        mlp_in = (2 if m.activation == "swiglu" else 1) * m.ffn_hidden_size
        if stage.sublayers == 1:
            per_token = stage.num_layers * (4 * m.hidden_size + (q + 2 * kv + mlp_in) / tp)
        else:  # an attention half records its norm's, q, k, v's and projection's; an MLP half the rest
            num_attn, num_mlp = stage.halves
            per_token = num_attn * (2 * m.hidden_size + (q + 2 * kv) / tp) + num_mlp * (2 * m.hidden_size + mlp_in / tp)
        if last:
            per_token += m.hidden_size + m.vocab_size / tp
        tokens = micro_batch * self.seq_len  # type: ignore[attr-defined]
        return int(tokens * per_token * self.dtype_bytes)  # type: ignore[attr-defined]
