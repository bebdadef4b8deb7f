"""The decoder: parameter counts match the spec, names are global, stages union to the full model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ethpipe.model_spec import ModelSpec, model_presets
from ethpipe.runtime.model.decoder import build_full_model, build_stage, state_dict_shapes
from ethpipe.runtime.model.kernel_modes import cpu_kernel_cache_dir

SPEC = ModelSpec(name="u", num_layers=4, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                 vocab_size=97, max_seq_len=32)
GPT = dataclasses.replace(SPEC, activation="gelu", norm="layernorm", position="learned", attention_bias=True,
                          mlp_bias=True, num_kv_heads=4)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt", "small"])
def test_parameter_count_matches_spec(name: str) -> None:
    spec = model_presets()[name]
    assert sum(math.prod(shape) for shape in state_dict_shapes(spec).values()) == spec.num_params()
    model = build_full_model(name)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()


@pytest.mark.parametrize("spec", [SPEC, GPT, dataclasses.replace(SPEC, qkv_bias=True)])
def test_stages_are_slices_of_the_full_model(spec: ModelSpec) -> None:
    full = build_full_model(spec, seed=5).state_dict()
    union: dict[str, torch.Tensor] = {}
    for lo, hi in [(0, 1), (1, 3), (3, 4)]:
        stage = build_stage(spec, (lo, hi), first=lo == 0, last=hi == 4, seed=5)
        union.update(stage.state_dict())
    assert union.keys() == full.keys()
    for key in full:
        assert torch.equal(union[key], full[key]), key
    other = build_full_model(spec, seed=6).state_dict()
    assert not torch.equal(other["layers.2.attn.wq.weight"], full["layers.2.attn.wq.weight"])


def test_global_names_and_init() -> None:
    stage = build_stage(SPEC, (2, 4), first=False, last=True)
    names = set(stage.state_dict())
    assert {"layers.2.attn.wq.weight", "layers.3.mlp.w3.weight", "norm.weight", "head.weight"} <= names
    assert not any(n.startswith(("tok_emb", "layers.0.", "layers.1.")) for n in names)
    assert torch.equal(stage.norm.weight, torch.ones(32))
    assert abs(float(stage.head.weight.detach().std()) - 0.02) < 0.002


def test_stage_allocates_only_its_own_layers() -> None:
    huge = dataclasses.replace(SPEC, num_layers=100_000)
    stage = build_stage(huge, (50_000, 50_002), first=False, last=False)
    assert sum(p.numel() for p in stage.parameters()) == 2 * huge.params_per_layer()


def test_stage_chain_equals_full_forward() -> None:
    tokens = torch.randint(0, SPEC.vocab_size, (3, 16))
    full = build_full_model(SPEC, seed=1)
    a = build_stage(SPEC, (0, 2), True, False, seed=1)
    b = build_stage(SPEC, (2, 4), False, True, seed=1, recompute=True)
    torch.testing.assert_close(b(a(tokens)), full(tokens), atol=1e-6, rtol=0)


def test_causal() -> None:
    model = build_full_model(GPT)
    x = torch.randint(0, GPT.vocab_size, (1, 10))
    y = x.clone()
    y[0, 7] = (y[0, 7] + 1) % GPT.vocab_size
    torch.testing.assert_close(model(x)[:, :7], model(y)[:, :7])
    assert not torch.allclose(model(x)[:, 7], model(y)[:, 7])


def test_tied_embeddings() -> None:
    spec = dataclasses.replace(GPT, tie_embeddings=True)
    model = build_full_model(spec, seed=3)
    assert model.head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    full = model.state_dict()
    assert "tok_emb.weight" in full and not any(k.startswith("head.") for k in full)
    assert sum(math.prod(shape) for shape in state_dict_shapes(spec).values()) == spec.num_params()
    first = build_stage(spec, (0, 2), True, False, seed=3)
    last = build_stage(spec, (2, 4), False, True, seed=3)
    # the last stage's head is its own copy of the embedding, named and initialised like it
    assert next(n for n, _ in last.named_parameters()) == "tok_emb.weight" and not hasattr(last, "pos_emb")
    assert last.head.weight is last.tok_emb.weight and last.tok_emb.weight is not first.tok_emb.weight
    assert torch.equal(last.tok_emb.weight, full["tok_emb.weight"])
    assert torch.equal(first.tok_emb.weight, full["tok_emb.weight"])
    tokens = torch.randint(0, spec.vocab_size, (2, 8))
    torch.testing.assert_close(last(first(tokens)), model(tokens), atol=1e-6, rtol=0)
    # gradients of the two uses, summed over the copies, are the full model's gradient
    last(first(tokens)).square().sum().backward()
    model(tokens).square().sum().backward()
    torch.testing.assert_close(first.tok_emb.weight.grad + last.tok_emb.weight.grad, model.tok_emb.weight.grad,
                               atol=1e-6, rtol=0)
    assert last.tok_emb.weight.grad.abs().sum() > 0 and first.tok_emb.weight.grad.abs().sum() > 0


def test_too_long_sequence() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        build_full_model(SPEC)(torch.zeros(1, 33, dtype=torch.long))


def test_compiled_cpu_kernels_are_cached_per_cpu_capability(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Inductor reuses cached C++ across ATEN_CPU_CAPABILITY values, and AVX2 code does not build under
    `default`: `--compile` on CPU keeps a subfolder per capability of whatever cache folder is in force."""
    leaf = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    chosen = cpu_kernel_cache_dir(str(tmp_path))
    assert chosen == str(tmp_path / leaf)
    assert cpu_kernel_cache_dir(chosen) == chosen  # idempotent: a second compile in the process keeps it
    assert cpu_kernel_cache_dir(None).endswith(leaf)


def test_a_stage_that_will_be_overwritten_draws_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`build_stage(init=False)` (a resume or a state file loads every parameter): no parameter is drawn."""
    import ethpipe.runtime.model.decoder as decoder

    drawn: list[str] = []
    real = decoder.init_parameter
    monkeypatch.setattr(decoder, "init_parameter", lambda spec, name, *a: (drawn.append(name), real(spec, name, *a)))
    spec = model_presets()["tiny"]
    build_stage(spec, (0, 2), True, False, init=False)
    assert drawn == []
    names = set(dict(build_stage(spec, (0, 2), True, False).named_parameters()))
    assert set(drawn) == names  # drawn: every parameter of the stage, only when asked to
