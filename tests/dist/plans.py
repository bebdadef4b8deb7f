"""Hand-made plans and small models for the multi-rank tests (no planner involved)."""

from __future__ import annotations

from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks

LLAMA_LIKE = ModelSpec(name="test-llama", num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=64, vocab_size=256, max_seq_len=64)
GPT_LIKE = ModelSpec(name="test-gpt", num_layers=6, hidden_size=32, num_heads=4, num_kv_heads=4, ffn_hidden_size=64,
                     vocab_size=256, max_seq_len=64, activation="gelu", norm="layernorm", position="learned",
                     attention_bias=True, mlp_bias=True)

StageDef = tuple[int, tuple[int, int]] | tuple[int, tuple[int, int], str] | tuple[int, tuple[int, int], str, bool]


def make_plan(spec: ModelSpec, pipelines: list[tuple[list[StageDef], tuple[int, ...]]], seq_len: int = 16,
              extra: dict | None = None) -> Plan:
    """pipelines: [([(rank, (lo, hi)[, device[, recompute]]), ...], micro_batch_sizes), ...]"""
    pipes = []
    for stages, sizes in pipelines:
        built = []
        for s in stages:
            device = s[2] if len(s) > 2 else "cpu"  # type: ignore[misc]
            recompute = bool(s[3]) if len(s) > 3 else False  # type: ignore[misc]
            built.append(Stage((s[0],), device, s[1], 1, recompute))
        pipes.append(Pipeline(tuple(built), tuple(sizes)))
    batch = sum(sum(sizes) for _, sizes in pipelines)
    return Plan("custom", spec.name, batch, seq_len, tuple(pipes), compute_blocks(pipes), model_spec=spec,
                extra=extra or {})


def half_layer_plan(spec: ModelSpec, pipelines: list[tuple[list[tuple[int, tuple[int, int], bool]], tuple[int, ...],
                                                         str]], seq_len: int = 16) -> Plan:
    """A plan cut in half layers (``ethpipe.sublayers``): pipelines [([(rank, (lo, hi), recompute), ...],
    micro_batch_sizes, schedule), ...], ranges in half layers."""
    pipes = tuple(Pipeline(tuple(Stage((r,), "cpu", rng, 1, rc, sublayers=2) for r, rng, rc in stages), tuple(sizes),
                           schedule) for stages, sizes, schedule in pipelines)
    batch = sum(p.num_samples for p in pipes)
    plan = Plan("custom", spec.name, batch, seq_len, pipes, compute_blocks(pipes), model_spec=spec)
    return Plan.from_dict(plan.to_dict())  # validated as a plan file is
