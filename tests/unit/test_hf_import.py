"""Importing Hugging Face models: ethpipe's decoder must compute the same logits as transformers.

Tolerance: both sides run fp32 with the same operations in nearly the same order, so the logits
(|logit| <= ~3 here) differ only by rounding: a few ulps of fp32 (1.2e-7 relative) per op over
two layers, measured <= 4e-7. 1e-5 is ~25x that floor and far below what a wrong model does
(checked below: exact instead of tanh GELU moves the logits by 1.5e-4, the subtlest case; a
missed llama3 RoPE scaling or another rope_theta by >= 1e-2; a misplaced tensor by O(1)).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from _hf_models import ARCHS, hf_logits, make_model, save_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ethpipe.errors import UserError  # noqa: E402
from ethpipe.hf.load import load_full, open_hf  # noqa: E402
from ethpipe.model_load import load_model_spec  # noqa: E402
from ethpipe.runtime.model.decoder import build_full_model  # noqa: E402

TOL = 1e-5
SEQ = 48  # > llama3's original_max_position_embeddings 16, so its scaling matters


def _ethpipe_logits(spec, state, tokens):  # type: ignore[no-untyped-def]
    model = build_full_model(spec)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_imported_model_matches_transformers_logits(arch: str, sharded: bool, tmp_path) -> None:
    model = make_model(arch)
    path = save_model(model, tmp_path / arch, sharded=sharded)
    assert (path / "model.safetensors.index.json").is_file() == sharded
    spec, state = load_full(path)
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    diff = (_ethpipe_logits(spec, state, tokens) - hf_logits(model, tokens)).abs().max().item()
    print(f"{arch} ({'sharded' if sharded else 'one file'}): max |logit difference| = {diff:.3g}")
    assert diff <= TOL
    assert load_model_spec(str(path)) == spec  # `ethpipe plan --model DIR` plans this very model


@pytest.mark.parametrize("arch, field, value", [
    ("llama3", "rope_scaling", "none"),  # the llama3 frequency scaling is really applied
    ("gpt2", "activation", "gelu"),  # GPT-2's tanh GELU is really used
    ("llama", "rope_theta", 20000.0),
])
def test_a_wrong_model_feature_is_visible_in_the_logits(arch: str, field: str, value: object, tmp_path) -> None:
    model = make_model(arch)
    spec, state = load_full(save_model(model, tmp_path / arch))
    tokens = torch.randint(0, spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    wrong = dataclasses.replace(spec, **{field: value})
    diff = (_ethpipe_logits(wrong, state, tokens) - hf_logits(model, tokens)).abs().max().item()
    print(f"{arch} with {field}={value!r}: max |logit difference| = {diff:.3g}")
    assert diff > 10 * TOL


def test_spec_of_each_architecture(tmp_path) -> None:
    specs = {a: open_hf(save_model(make_model(a), tmp_path / a)).spec for a in ARCHS}
    assert specs["llama"].num_kv_heads == 2 and specs["llama"].norm_eps == 1e-6
    assert specs["llama3"].rope_scaling == "llama3" and specs["llama3"].rope_original_max_seq_len == 16
    assert specs["llama3"].rope_theta == 500000.0
    assert specs["qwen2"].qkv_bias and not specs["qwen2"].attention_bias and specs["qwen2"].tie_embeddings
    assert specs["gpt2"].activation == "gelu_tanh" and specs["gpt2"].tie_embeddings
    assert specs["gpt2-untied"].activation == "gelu" and not specs["gpt2-untied"].tie_embeddings
    assert specs["gpt2-untied"].ffn_hidden_size == 48


def test_transformers_4_style_rope_fields_are_read(tmp_path) -> None:
    path = save_model(make_model("llama3"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    (path / "config.json").write_text(json.dumps(config))
    v4 = open_hf(path).spec
    v5 = open_hf(save_model(make_model("llama3"), tmp_path / "v5")).spec
    assert dataclasses.replace(v4, name="") == dataclasses.replace(v5, name="")
    assert v4.rope_scaling == "llama3" and v4.rope_theta == 500000.0


def test_mistral_sliding_window_bounds_the_sequence(tmp_path) -> None:
    path = save_model(make_model("mistral"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 32
    (path / "config.json").write_text(json.dumps(config))
    assert open_hf(path).spec.max_seq_len == 32  # within the window, sliding attention is causal attention


@pytest.mark.parametrize("edit, match", [
    ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}, "gpt_neox.*GPTNeoXForCausalLM.*llama"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling type 'yarn'"),
    ({"intermediate_size": 80}, r"shape \[64, 32\] but config.json needs \[80, 32\]"),
    ({"num_hidden_layers": 3}, "no tensor 'model.layers.2"),
    ({"num_hidden_layers": 1}, "has tensor 'model.layers.1"),
])
def test_bad_configs_are_one_line_user_errors(edit: dict, match: str, tmp_path) -> None:
    path = save_model(make_model("llama"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=match) as info:
        open_hf(path)
    assert "\n" not in str(info.value)


def test_truncated_or_missing_files_are_user_errors(tmp_path) -> None:
    path = save_model(make_model("llama"), tmp_path / "m", sharded=True)
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(UserError, match="truncated or corrupt"):
        open_hf(path)
    shard.unlink()
    with pytest.raises(UserError, match="is missing"):
        open_hf(path)
    with pytest.raises(UserError, match="no config.json"):
        open_hf(tmp_path)
