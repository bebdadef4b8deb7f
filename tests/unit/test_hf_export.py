"""Exporting to Hugging Face: transformers must load the directory cleanly and compute ethpipe's logits.

Tolerance 1e-5 on fp32 logits, for the reason given in test_hf_import.py (measured floor <= 4e-7).
"""

from __future__ import annotations

import json

import pytest

from _hf_models import hf_logits, load_clean, make_model, save_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ethpipe.errors import UserError  # noqa: E402
from ethpipe.hf.config import hf_architecture_of  # noqa: E402
from ethpipe.hf.export import export_hf, parse_size  # noqa: E402
from ethpipe.hf.load import load_full  # noqa: E402
from ethpipe.model_spec import ModelSpec  # noqa: E402
from ethpipe.model_load import load_model_spec
from ethpipe.runtime.model.decoder import build_full_model  # noqa: E402

TOL = 1e-5




def _logits(model, tokens):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("preset, arch", [("tiny", "llama"), ("tiny-gpt", "gpt2")])
def test_presets_export_to_a_directory_transformers_loads(preset: str, arch: str, tmp_path, capsys, caplog) -> None:
    spec = load_model_spec(preset)
    ours = build_full_model(spec, seed=3).eval()
    out = tmp_path / "hf"
    report = export_hf(ours.state_dict(), spec, out, max_shard_size="200KB")
    assert report.arch == arch and report.shards > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in out.glob("*.safetensors"))
    theirs = load_clean(out, capsys, caplog)
    assert type(theirs).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[arch]
    tokens = torch.randint(0, spec.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    diff = (_logits(ours, tokens) - hf_logits(theirs, tokens)).abs().max().item()
    print(f"{preset} exported as {arch}: max |logit difference| = {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "gpt2", "mistral"])
def test_import_then_export_round_trips(arch: str, tmp_path, capsys, caplog) -> None:
    original = make_model(arch)
    spec, state = load_full(save_model(original, tmp_path / "in"))
    export_hf(state, spec, tmp_path / "out")
    back = load_clean(tmp_path / "out", capsys, caplog)
    tokens = torch.randint(0, spec.vocab_size, (2, 48), generator=torch.Generator().manual_seed(4))
    assert (hf_logits(back, tokens) - hf_logits(original, tokens)).abs().max().item() <= TOL
    assert load_full(tmp_path / "out")[0].tie_embeddings == spec.tie_embeddings
    if spec.tie_embeddings:
        assert "lm_head.weight" not in json.loads((tmp_path / "out/model.safetensors.index.json").read_text())[
            "weight_map"]


@pytest.mark.parametrize("fields, match", [
    ({"norm": "layernorm"}, "norm=layernorm, position=rope"),
    ({"position": "learned"}, "matches neither"),
    ({"activation": "gelu", "norm": "layernorm", "position": "learned"}, "GPT-2 needs attention_bias"),
    ({"qkv_bias": True, "mlp_bias": True}, "Qwen2"),
])
def test_unrepresentable_specs_are_refused_in_one_line(fields: dict, match: str, tmp_path) -> None:
    spec = ModelSpec(name="odd", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4, ffn_hidden_size=64,
                     vocab_size=64, max_seq_len=32, **fields)
    with pytest.raises(UserError, match=match) as info:
        hf_architecture_of(spec)
    assert "\n" not in str(info.value) and "--format ethpipe" in str(info.value)
    with pytest.raises(UserError):
        export_hf(build_full_model(spec).state_dict(), spec, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_out_must_be_new_or_empty(tmp_path) -> None:
    spec = load_model_spec("tiny")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not an empty directory"):
        export_hf(build_full_model(spec).state_dict(), spec, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    export_hf(build_full_model(spec).state_dict(), spec, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # no temporary directory left


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("300") == 300
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(UserError, match="--max-shard-size"):
            parse_size(bad)
