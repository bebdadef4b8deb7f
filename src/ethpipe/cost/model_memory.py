"""CostModel's parameters, optimizer and memory pricing (a mixin: ``cost/model.py`` holds the state).

Memory per stage is linear in its number of layers (``memory_terms``: fixed and per-layer bytes),
which is what lets the planner's partition search check a whole stage in one multiply.
"""

from __future__ import annotations

from collections.abc import Mapping

from ethpipe.cost import memory, ops
from ethpipe.cost.profile import MeasuredProfile
from ethpipe.model_spec import ModelSpec, spec_from_dict
from ethpipe.plan import Block, Stage
from ethpipe.sublayers import attention_units, layer_parts

# The runtime's AdamW step over fp32 weights (the master copy), gradients and moments: one fused kernel on a GPU
# reads w, g, m, v and writes w, m, v (counted: tests/unit/test_counted_work.py).
OPTIMIZER_BYTES_PER_PARAM = 28
DEFAULT_MEMORY_BANDWIDTH_GBPS = 300.0


class MemoryPricing:
    """Parameter counts, gradient bytes, optimizer time and memory of a ``CostModel`` (its fields and memos)."""

    model: ModelSpec
    seq_len: int
    dtype_bytes: int
    profiles: Mapping[str, MeasuredProfile] | None

    def layers_params(self, num_layers: int, halves: tuple[int, int] | None = None) -> int:
        """Parameters of ``num_layers`` whole layers, or of ``halves`` (attention halves, MLP halves)."""
        m = self.model
        if halves is None:
            return num_layers * m.params_per_layer()
        return halves[0] * m.attention_params_per_layer() + halves[1] * m.mlp_params_per_layer()

    def stage_params(self, num_layers: int, *, first: bool, last: bool, halves: tuple[int, int] | None = None) -> int:
        """A stage's parameters: its layers' (``halves``: a sub-layer stage's, ``Stage.halves``) and its ends'."""
        key = ("params", num_layers, first, last, halves)
        memo = self._memo  # type: ignore[attr-defined]
        if key not in memo:
            m = self.model
            memo[key] = self.layers_params(num_layers, halves) + (m.embedding_params() if first else 0) + (
                m.head_params() if last else 0)
        return memo[key]

    @property
    def grad_bytes(self) -> int:
        """Bytes of one gradient element as the block sync all-reduces it: fp32 under every precision, bf16 with
        ``grad_reduce`` bf16 (``memory.GRAD_REDUCE_BYTES``)."""
        return memory.GRAD_REDUCE_BYTES[self.grad_reduce]  # type: ignore[attr-defined]

    def grad_sync_bytes(self, num_layers: int, *, first: bool, last: bool, halves: tuple[int, int] | None = None
                        ) -> int:
        """Gradient bytes the block sync moves for ``num_layers`` layers, plus the embedding / norm+head at the
        ends; a tied matrix is synced apart (``tied_grad_bytes``), so it is left out of both ends."""
        params = self.stage_params(num_layers, first=first, last=last, halves=halves)
        if self.model.tie_embeddings:
            params -= (first + last) * self.model.vocab_size * self.model.hidden_size
        return params * self.grad_bytes

    def block_grad_bytes(self, block: Block, *, first: bool, last: bool, sublayers: int = 1) -> int:
        """Gradient bytes of a block (``grad_sync_bytes`` of its layers, or half layers with ``sublayers`` 2)."""
        lo, hi = block.layers
        attention = attention_units(lo, hi, sublayers)
        halves = None if sublayers == 1 else (attention, hi - lo - attention)
        return self.grad_sync_bytes(hi - lo, first=first, last=last, halves=halves)

    def tied_grad_bytes(self) -> int:
        """The tied embedding matrix's gradient bytes (0 for an untied model)."""
        m = self.model
        return m.vocab_size * m.hidden_size * self.grad_bytes if m.tie_embeddings else 0

    def cast_params(self, num_layers: int, *, last: bool, halves: tuple[int, int] | None = None) -> int:
        """The parameters a 16-bit step copies to 16-bit (``runtime/model/weight_cast.py``): every block's and the
        head's (a tied head's copy of the embedding matrix); a first stage's embedding is looked up in fp32."""
        m = self.model
        return self.layers_params(num_layers, halves) + (m.head_params() if last else 0)

    def optimizer_s(self, stage: Stage, *, first: bool, last: bool) -> float:
        """A stage's once-per-step work: the AdamW update of its parameters (sharded over ``optimizer_holders``:
        each holder updates its shard only) and, in 16-bit, the one copy of each weight to 16-bit the step
        makes (``ops.WEIGHT_CAST_BYTES``, ``cast_params``). Memoised: the planner asks per stage of every group."""
        halves = None if stage.sublayers == 1 else stage.halves
        key = ("optimizer_s", stage.device, stage.num_layers, stage.tp, halves, first, last)
        hit = self._memo.get(key)  # type: ignore[attr-defined]
        if hit is None:
            hit = self._memo[key] = self._optimizer_s(stage, halves, first=first, last=last)  # type: ignore[attr-defined]
        return hit  # type: ignore[no-any-return]

    def _optimizer_s(self, stage: Stage, halves: tuple[int, int] | None, *, first: bool, last: bool) -> float:
        stage_params = self.stage_params(stage.num_layers, first=first, last=last, halves=halves) / stage.tp  # type: ignore[attr-defined]
        params = stage_params / self.optimizer_holders
        bw = self.gpu(stage.device).memory_bandwidth_gbps or DEFAULT_MEMORY_BANDWIDTH_GBPS
        cast = self.cast_params(stage.num_layers, last=last, halves=halves) / stage.tp
        cast_s = cast * ops.WEIGHT_CAST_BYTES / (bw * 1e9) if self.dtype_bytes < 4 else 0.0
        prof = self.profiles.get(stage.device) if self.profiles else None
        if prof is not None:
            return params * prof.optimizer_s_per_param + cast_s
        return params * OPTIMIZER_BYTES_PER_PARAM / (bw * 1e9) + cast_s

    def memory_terms(self, tp: int, micro_batch: int, in_flight: int, recompute: bool, *,
                     first: bool, last: bool, device: str | None = None) -> tuple[float, float]:
        """(fixed, per-layer) bytes of a stage: memory is linear in its number of layers.

        Activations come from the device type's measured profile where it has them (scaled by
        the analytic ratio when the profile was taken on another model, sequence length, dtype
        or TP degree), else from the analytic per-tensor count. Memoised (the planner's bounds ask
        for every pipeline position of every shape).
        """
        key = ("terms", tp, micro_batch, in_flight, recompute, first, last, device)
        memo = self._memo  # type: ignore[attr-defined]
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = self._memory_terms(tp, micro_batch, in_flight, recompute, first, last, device)
        return hit  # type: ignore[no-any-return]

    def _memory_terms(self, tp: int, micro_batch: int, in_flight: int, recompute: bool, first: bool, last: bool,
                      device: str | None) -> tuple[float, float]:
        bpp = self._state_bpp  # type: ignore[attr-defined]
        layer_params, per_layer_rest, end_params, fixed_rest = self._memory_parts(
            tp, micro_batch, in_flight, recompute, first, last, device)
        per_layer = bpp * layer_params / tp + per_layer_rest[0] + per_layer_rest[1]
        fixed = bpp * end_params / tp
        for part in fixed_rest:
            fixed += part
        return fixed, per_layer

    def _memory_parts(self, tp: int, micro_batch: int, in_flight: int, recompute: bool, first: bool, last: bool,
                      device: str | None) -> tuple[int, tuple[float, float], int, tuple[float, ...]]:
        """What ``_memory_terms`` adds to the parameter state, which alone depends on the optimizer holders: kept
        in the compute memo, which ``with_optimizer_holders`` shares (the sharding rounds ask for the same
        positions). Each term is the same float, added in the same order, as when it was summed in one go."""
        key = ("memory_parts", tp, micro_batch, in_flight, recompute, first, last, device)
        memo = self._kernel_memo  # type: ignore[attr-defined]
        if key in memo:
            return memo[key]  # type: ignore[no-any-return]
        m, s, d = self.model, self.seq_len, self.dtype_bytes
        full = self._activation_bytes(device, "block", micro_batch, tp)
        # Recompute keeps each block's input: the residual stream, in the compute dtype (``Decoder._stream``).
        kept = memory.block_input_bytes(m, s, d) * micro_batch if recompute else full
        layer_params = m.params_per_layer()
        per_layer_rest = (in_flight * kept, memory.autocast_weight_bytes(layer_params, d, tp))
        end_params = (m.embedding_params() if first else 0) + (m.head_params() if last else 0)
        fixed_rest = []
        if last:  # the head's autocast copy
            fixed_rest.append(memory.autocast_weight_bytes(m.vocab_size * m.hidden_size, d, tp))
        if recompute:
            fixed_rest.append(full)
        if last:
            fixed_rest.append(self._activation_bytes(device, "head", micro_batch, tp)
                              + memory.loss_transient_bytes(m, s, tp) * micro_batch)
        if not (first and last):  # the payload in flight and the receive buffer (memory.P2P_BUFFERS)
            fixed_rest.append(memory.P2P_BUFFERS * memory.boundary_bytes(m, s, d) * micro_batch)
        if not first:
            fixed_rest.append(in_flight * memory.stashed_input_bytes(m, s, d) * micro_batch)
        memo[key] = (layer_params, per_layer_rest, end_params, tuple(fixed_rest))
        return memo[key]  # type: ignore[no-any-return]

    def _activation_bytes(self, device: str | None, kind: str, micro_batch: int, tp: int,
                          half: str | None = None) -> float:
        """ethpipe's own runtime's saved tensors (``memory.runtime_*``), plus the s x s scores where the
        plan forces materialised attention (SDPA's fused kernels keep none); a measured profile rescales them."""
        m, s, d = self.model, self.seq_len, self.dtype_bytes
        attention = self.attention(device) if device is not None else None
        materialised = attention == "materialised"
        expanded = attention is not None and ops.gqa_expanded(attention, m.q_dim, m.kv_dim)

        def analytic(spec: ModelSpec, seq_len: int, dtype_bytes: int, tp: int, scores_kept: bool,
                     gqa_expanded: bool = False, part: str | None = None) -> float:
            if kind != "block":
                return memory.runtime_head_activation_bytes(spec, seq_len, dtype_bytes, tp)
            scores = memory.score_bytes(spec, seq_len, dtype_bytes, tp) if scores_kept and part != "mlp" else 0.0
            return memory.runtime_block_activation_bytes(spec, seq_len, dtype_bytes, tp, gqa_expanded, part) + scores

        ours = analytic(m, s, d, tp, materialised, expanded, half) * micro_batch
        prof = self.profiles.get(device) if self.profiles and device else None
        measured = prof.activation_bytes(kind, micro_batch) if prof is not None else None  # type: ignore[arg-type]
        if prof is None or measured is None:
            return ours
        theirs = analytic(spec_from_dict(prof.model), prof.seq_len, prof.dtype_bytes, 1,  # measured: a whole block
                          prof.attention == "materialised", self._profile_expanded(device, prof)) * micro_batch
        return measured * ours / theirs

    def _profile_expanded(self, device: str, prof: MeasuredProfile) -> bool:
        """Whether the runtime that measured ``prof`` on ``device`` expanded its model's grouped-query K/V."""
        spec = spec_from_dict(prof.model)
        hw = self._hw.get(device)  # type: ignore[attr-defined]
        if hw is None:
            return False
        dtype = "fp32" if prof.dtype_bytes >= 4 else "fp16"
        return ops.gqa_expanded(ops.attention_impl(hw.gpu.arch, dtype, prof.attention), spec.q_dim, spec.kv_dim)

    def stage_memory_bytes(self, stage: Stage, micro_batch: int, in_flight: float, *, first: bool, last: bool,
                           pending_weights: int = 0, stashed_inputs: int | None = None,
                           live_heads: int | None = None) -> int:
        """Peak bytes on each rank of ``stage`` with ``in_flight`` micro-batches of activations held (an
        interleaved stage: in whole-stage units, ``schedule.max_in_flight_layers``), of which
        ``pending_weights`` wait for their W with their recorded gradients (``held_grad_bytes``), and
        ``stashed_inputs`` received inputs kept for the backward (default: ``in_flight``, none on a first stage),
        and on a last stage ``live_heads`` micro-batches' head and loss graphs alive at once (default 1: 1F1B's
        F then B; zb-h1 keeps each until its W, an interleaved stage running every forward first all of them)."""
        fixed, per_layer = self.memory_terms(stage.tp, micro_batch, in_flight, stage.recompute, first=first, last=last,  # type: ignore[arg-type]
                                             device=stage.device)
        if stashed_inputs is not None:  # memory_terms counted in_flight of them (none on a first stage)
            counted = 0.0 if first else in_flight
            fixed += (stashed_inputs - counted) * memory.stashed_input_bytes(self.model, self.seq_len,
                                                                             self.dtype_bytes) * micro_batch
        if last and live_heads is not None and live_heads > 1:
            fixed += (live_heads - 1) * self._activation_bytes(stage.device, "head", micro_batch, stage.tp)
        held = pending_weights * self.held_grad_bytes(stage, micro_batch, last) if pending_weights else 0  # type: ignore[attr-defined]
        layers = (stage.num_layers * per_layer if stage.sublayers == 1 else
                  self._half_layers_bytes(stage, micro_batch, in_flight))
        return int(fixed + layers) + held

    def _half_layers_bytes(self, stage: Stage, micro_batch: int, in_flight: float) -> float:
        """A sub-layer stage's layers' share of ``stage_memory_bytes`` (``_memory_parts``'s per-layer terms, per
        half): their parameters' state and autocast copies, and each in-flight micro-batch's saved activations, or
        under recompute the input of each layer module it runs (a lone half is a module of its own)."""
        m, tp, b = self.model, stage.tp, micro_batch
        params = self.layers_params(stage.num_layers, stage.halves)
        total = self._state_bpp * params / tp + memory.autocast_weight_bytes(params, self.dtype_bytes, tp)  # type: ignore[attr-defined]
        if stage.recompute:
            modules = sum(len(layer_parts(lo, hi, stage.sublayers)) for lo, hi in stage.layer_ranges)
            return total + in_flight * modules * memory.block_input_bytes(m, self.seq_len, self.dtype_bytes) * b
        kept = sum(n * self._activation_bytes(stage.device, "block", b, tp, half)
                   for n, half in zip(stage.halves, ("attn", "mlp")))
        return total + in_flight * kept
