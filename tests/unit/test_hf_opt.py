"""OPT (facebook/opt-*) imports like GPT-2: ethpipe's decoder computes transformers' logits.

OPT differs from GPT-2 in ways a wrong import would hide only partly, so each is checked by the
logits: learned positions read from row ``i + 2`` of a table of ``max_position_embeddings + 2``
rows (``position_offset``), separate q/k/v/out projections (plain ``nn.Linear``), a ReLU MLP
(fc1/fc2), ``enable_bias`` for every projection, and a tied ``lm_head``. Post-LN OPT and projected
embeddings (opt-350m) are refused in one line.

Tolerance: ethpipe runs the same operations as transformers, in the same order (transformers
scales q by head_dim**-0.5 before SDPA with scale 1; SDPA scales by the same power of two, which
is exact), so fp32 logits agree to rounding: at most a few ulps per op, bounded here by
64 fp32 eps times the logits' scale (1.5e-5 at |logit| ~ 2; measured: 0). In fp64 both sides
must agree to 1e-10. A wrong feature moves the logits by >= 1e-2, 1000x the fp32 bound.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from _hf_models import hf_logits, load_clean, save_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import ethpipe.cli.commands  # noqa: E402,F401  (registers the commands on the app)
from ethpipe.cli.app import app  # noqa: E402
from ethpipe.cost import compute, ops  # noqa: E402
from ethpipe.errors import UserError  # noqa: E402
from ethpipe.hf.config import hf_architecture_of, hf_config_from_spec  # noqa: E402
from ethpipe.hf.export import export_hf  # noqa: E402
from ethpipe.hf.load import load_full, load_stage, open_hf  # noqa: E402
from ethpipe.model_spec import ModelSpec, spec_from_dict  # noqa: E402
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan  # noqa: E402
from ethpipe.runtime.model.decoder import build_full_model, build_stage, state_dict_shapes  # noqa: E402
from ethpipe.runtime.model.tensor_parallel import TPGroup, shard_dim  # noqa: E402

F32_EPS = torch.finfo(torch.float32).eps
F64_TOL = 1e-10
SEQ = 128  # the whole position table: every offset row that is read is checked
_OPT = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "ffn_dim": 256, "vocab_size": 256,
        "max_position_embeddings": 128, "do_layer_norm_before": True, "word_embed_proj_dim": 64}
VARIANTS = {
    "opt": {},  # as opt-125m ... 66b: pre-LN, biases, tied lm_head, ReLU
    "opt-untied": {"tie_word_embeddings": False},
    "opt-nobias": {"enable_bias": False},
}


def make_opt(variant: str = "opt", seed: int = 0, **overrides: object):  # type: ignore[no-untyped-def]
    """A random OPTForCausalLM whose biases and norm gains are non-trivial too."""
    torch.manual_seed(seed)
    config = transformers.OPTConfig(**{**_OPT, **VARIANTS[variant], **overrides})
    model = transformers.OPTForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _tokens(spec: ModelSpec, seed: int = 1):  # type: ignore[no-untyped-def]
    return torch.randint(0, spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _ethpipe_logits(spec, state, tokens, dtype=torch.float32):  # type: ignore[no-untyped-def]
    model = build_full_model(spec, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    model.eval()
    with torch.no_grad():
        return model(tokens)


def _f32_tol(reference) -> float:  # type: ignore[no-untyped-def]
    return 64 * F32_EPS * reference.abs().max().item()


def _one_line_error(fn, match: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(UserError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)
    return str(info.value)


# -- import: the logits ------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_imported_opt_matches_transformers_logits_fp32(variant: str, sharded: bool, tmp_path) -> None:
    model = make_opt(variant)
    path = save_model(model, tmp_path / variant, sharded=sharded)
    spec, state = load_full(path)
    assert spec.position_offset == 2 and spec.activation == "relu" and spec.norm == "layernorm"
    assert spec.tie_embeddings == (variant != "opt-untied")
    assert spec.attention_bias == spec.mlp_bias == (variant != "opt-nobias")
    tokens = _tokens(spec)
    theirs = hf_logits(model, tokens)
    diff = (_ethpipe_logits(spec, state, tokens) - theirs).abs().max().item()
    print(f"{variant}: max |logit difference| = {diff:.3g} (bound {_f32_tol(theirs):.3g})")
    assert diff <= _f32_tol(theirs)


@pytest.mark.parametrize("variant", ["opt", "opt-untied"])
def test_imported_opt_matches_transformers_logits_fp64(variant: str, tmp_path) -> None:
    model = make_opt(variant)
    spec, state = load_full(save_model(model, tmp_path / variant))
    tokens = _tokens(spec)
    theirs = hf_logits(model.double(), tokens)
    diff = (_ethpipe_logits(spec, state, tokens, torch.float64) - theirs).abs().max().item()
    print(f"{variant} fp64: max |logit difference| = {diff:.3g}")
    assert diff <= F64_TOL


@pytest.mark.parametrize("field, value", [
    ("position_offset", 0),  # token i read from row i, not i + 2 (max_seq_len + 2 keeps the table's shape)
    ("activation", "gelu"),  # the ReLU really is used
])
def test_a_wrong_opt_feature_is_visible_in_the_logits(field: str, value: object, tmp_path) -> None:
    model = make_opt()
    spec, state = load_full(save_model(model, tmp_path / "opt"))
    wrong = dataclasses.replace(spec, **{field: value})
    if field == "position_offset":
        wrong = dataclasses.replace(wrong, max_seq_len=spec.max_seq_len + spec.position_offset)
    assert {k: tuple(v.shape) for k, v in state.items()} == state_dict_shapes(wrong)
    tokens = _tokens(spec)
    theirs = hf_logits(model, tokens)
    diff = (_ethpipe_logits(wrong, state, tokens) - theirs).abs().max().item()
    print(f"opt with {field}={value!r}: max |logit difference| = {diff:.3g}")
    assert diff > 1000 * _f32_tol(theirs)


def test_stage_split_opt_equals_the_full_model_and_transformers(tmp_path) -> None:
    """Embedding on the first stage, head (and the tied embedding's copy) on the last, blocks between;
    each stage reads only its own tensors from the sharded directory."""
    model = make_opt()
    path = save_model(model, tmp_path / "opt", sharded=True)
    spec, state = load_full(path)
    tokens = _tokens(spec)
    full = _ethpipe_logits(spec, state, tokens)
    for cuts in ([(0, 1), (1, 2), (2, 3)], [(0, 2), (2, 3)]):
        x, read = tokens, []
        for i, layers in enumerate(cuts):
            stage = build_stage(spec, layers, first=i == 0, last=i == len(cuts) - 1)
            read.append(load_stage(stage, path).tensors)
            with torch.no_grad():
                x = stage.eval()(x)
        assert torch.equal(x, full), cuts  # the same operations on the same tensors
        assert (x - hf_logits(model, tokens)).abs().max().item() <= _f32_tol(full)
        if len(cuts) == 3:  # embed_tokens + embed_positions + 16 per layer; the middle layer; layer + copy + norm
            assert read == [2 + 16, 16, 16 + 1 + 2]


def test_tensor_parallel_ranks_load_their_slices_of_opt(tmp_path) -> None:
    """At tp=2 each rank's stage holds its rows (q/k/v, fc1, vocab) or columns (out_proj, fc2) of transformers'
    tensors, biases of row-parallel layers and norms whole: the slices put together are the model. (The tp-2
    forward itself needs two processes; checked to transformers' logits to 8e-7 outside this suite.)"""
    model = make_opt()
    path = save_model(model, tmp_path / "opt")
    spec, full = load_full(path)
    parts = []
    for rank in range(2):
        stage = build_stage(spec, (0, 3), first=True, last=True, tp=TPGroup(None, rank, 2))
        load_stage(stage, path)
        parts.append(stage.state_dict())
    assert spec.tp_problem(2) is None and set(parts[0]) == set(full)
    for name, tensor in full.items():
        dim = shard_dim(name)
        joined = parts[0][name] if dim is None else torch.cat([parts[0][name], parts[1][name]], dim=dim)
        assert torch.equal(joined, tensor), name
        assert dim is None or parts[0][name].shape[dim] * 2 == tensor.shape[dim]
    assert shard_dim("layers.0.mlp.w1.weight") == 0 and shard_dim("layers.0.mlp.w2.weight") == 1
    assert shard_dim("layers.0.attn.wo.bias") is None and shard_dim("pos_emb.weight") is None


def test_hub_keys_without_the_model_prefix_are_read(tmp_path) -> None:
    """The facebook/opt-* files were saved from OPTModel: ``decoder.*``, no ``model.`` and no lm_head."""
    model = make_opt()
    path = save_model(model, tmp_path / "opt")
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    assert all(k.startswith("model.decoder.") for k in tensors)
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    spec, state = load_full(path)
    tokens = _tokens(spec)
    theirs = hf_logits(model, tokens)
    assert (_ethpipe_logits(spec, state, tokens) - theirs).abs().max().item() <= _f32_tol(theirs)


def test_spec_counts_every_opt_parameter(tmp_path) -> None:
    """The planner's parameter count (and so its memory) is transformers' own, position table's 2 extra rows too."""
    for variant in VARIANTS:
        model = make_opt(variant)
        spec = open_hf(save_model(model, tmp_path / variant)).spec
        assert spec.num_params() == sum(p.numel() for p in model.parameters()), variant
        assert sum(p.numel() for p in build_full_model(spec).parameters()) == spec.num_params(), variant
        assert spec.embedding_params() == (256 + 128 + 2) * 64


@pytest.mark.parametrize("size, hidden, layers, heads", [("125m", 768, 12, 12), ("1.3b", 2048, 24, 32)])
def test_published_opt_sizes_count_as_transformers_does(size: str, hidden: int, layers: int, heads: int,
                                                        tmp_path) -> None:
    """The facebook/opt-* config.json (as published: float16, pad 1, prefix) plans the model transformers builds."""
    config = {"_remove_final_layer_norm": False, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
              "do_layer_norm_before": True, "dropout": 0.1, "ffn_dim": 4 * hidden, "hidden_size": hidden,
              "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": heads,
              "num_hidden_layers": layers, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
              "prefix": "</s>", "torch_dtype": "float16", "vocab_size": 50272, "word_embed_proj_dim": hidden}
    (tmp_path / f"opt-{size}").mkdir()
    (tmp_path / f"opt-{size}" / "config.json").write_text(json.dumps(config))
    spec = load_model_spec(str(tmp_path / f"opt-{size}"))
    with torch.device("meta"):
        theirs = transformers.OPTForCausalLM(transformers.OPTConfig(**config))
    assert spec.num_params() == sum(p.numel() for p in theirs.parameters())
    assert spec.tp_problem(2) is None and spec.max_seq_len == 2048


def test_opt_is_priced_like_a_gpt2_mlp() -> None:
    """Two matrices of h x ffn (ReLU as GELU), 4 h^2 in attention; the FLOPs and kernels count them."""
    opt = ModelSpec(name="opt", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=256,
                    vocab_size=256, max_seq_len=128, activation="relu", norm="layernorm", position="learned",
                    position_offset=2, tie_embeddings=True, attention_bias=True, mlp_bias=True)
    gelu = dataclasses.replace(opt, activation="gelu", position_offset=0)
    assert compute.block_matmul_params(opt) == 4 * 64 * 64 + 2 * 64 * 256
    assert compute.block_fwd_flops(opt, 128) == compute.block_fwd_flops(gelu, 128) > 0
    for backward in (False, True):
        kernels = ops.block_kernels(opt, 128, 2, 1, 4, "efficient", backward)
        assert kernels == ops.block_kernels(gelu, 128, 2, 1, 4, "efficient", backward)
        assert sum(k.flops for k in kernels if k.name.startswith("fc1")) == 2 * 2 * 128 * 64 * 256 * (
            2 if backward else 1)


# -- planning and export ---------------------------------------------------------------------


def test_plan_model_opt_directory(tmp_path) -> None:
    path = save_model(make_opt(), tmp_path / "opt")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "--cluster", "examples/clusters/cpu_demo.yaml", "--model", str(path),
                                      "--global-batch", "8", "--seq-len", "64", "--max-tp", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.model_spec == load_model_spec(str(path)) == open_hf(path).spec
    assert plan.model_spec.position_offset == 2 and plan.model_spec.activation == "relu"
    assert sum(s.layers[1] - s.layers[0] for s in plan.pipelines[0].stages) == 3 * plan.sublayers




@pytest.mark.parametrize("variant", list(VARIANTS))
def test_opt_import_then_export_round_trips(variant: str, tmp_path, capsys, caplog) -> None:
    original = make_opt(variant)
    src = save_model(original, tmp_path / "in")
    spec, state = load_full(src)
    report = export_hf(state, spec, tmp_path / "out", source=src)
    assert report.arch == "opt"
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["model_type"] == "opt" and config["architectures"] == ["OPTForCausalLM"]
    assert config["pad_token_id"] == 1 and config["enable_bias"] == (variant != "opt-nobias")
    back = load_clean(tmp_path / "out", capsys, caplog)
    assert type(back).__name__ == "OPTForCausalLM"
    tokens = _tokens(spec, seed=4)
    theirs = hf_logits(original, tokens)
    assert (hf_logits(back, tokens) - theirs).abs().max().item() <= _f32_tol(theirs)
    again = load_full(tmp_path / "out")
    assert again[0] == dataclasses.replace(spec, name="out")
    assert all(torch.equal(again[1][k], state[k]) for k in state)
    keys = json.loads((tmp_path / "out/model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in keys) == (not spec.tie_embeddings)


@pytest.mark.parametrize("fields, match", [
    ({"position_offset": 3}, "position_offset 3"),
    ({"activation": "swiglu"}, "activation=swiglu"),
    ({"mlp_bias": False}, "biases that differ"),
    ({"norm_eps": 1e-6}, "norm_eps"),
    ({"position_offset": 0}, "ReLU.*position_offset 2"),  # a GPT-2 with ReLU: no HF class reads it back as such
])
def test_unexportable_opt_like_specs_are_refused_in_one_line(fields: dict, match: str) -> None:
    spec = ModelSpec(name="odd", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, ffn_hidden_size=256,
                     vocab_size=256, max_seq_len=128, activation="relu", norm="layernorm", position="learned",
                     position_offset=2, attention_bias=True, mlp_bias=True)
    assert hf_architecture_of(spec) == "opt" and hf_config_from_spec(spec)["activation_function"] == "relu"
    message = _one_line_error(lambda: hf_architecture_of(dataclasses.replace(spec, **fields)), match)
    assert "--format ethpipe" in message


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, match", [
    ({"do_layer_norm_before": False}, "do_layer_norm_before=false.*opt-350m"),
    ({"word_embed_proj_dim": 32}, "word_embed_proj_dim 32 != hidden_size 64"),
    ({"_remove_final_layer_norm": True}, "_remove_final_layer_norm"),
    ({"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine"),
    ({"activation_function": "silu"}, "activation_function 'silu'"),
    ({"ffn_dim": 128}, r"shape \[256, 64\] but config.json needs \[128, 64\]"),
])
def test_unsupported_opt_configs_are_one_line_user_errors(edit: dict, match: str, tmp_path) -> None:
    path = save_model(make_opt(), tmp_path / "opt")
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    _one_line_error(lambda: open_hf(path), match)
    if "shape" not in match:  # planning reads only config.json: refused there too
        _one_line_error(lambda: load_model_spec(str(path)), match)


def test_opt_350m_layout_is_refused_by_plan_in_one_line(tmp_path) -> None:
    """opt-350m itself: post-LN and 512-wide embeddings projected to 1024 (here 32 -> 64)."""
    path = save_model(make_opt(do_layer_norm_before=False, word_embed_proj_dim=32), tmp_path / "opt-350m-like")
    result = CliRunner().invoke(app, ["plan", "--cluster", "examples/clusters/cpu_demo.yaml", "--model", str(path),
                                      "--global-batch", "8", "--seq-len", "64", "--out", str(tmp_path / "p.json")])
    out = (result.stdout or "") + (result.stderr or "")
    assert result.exit_code == 2, out
    assert len(out.strip().splitlines()) == 1 and "do_layer_norm_before" in out, out
    assert not (tmp_path / "p.json").exists()


def test_position_offset_is_checked() -> None:
    base = {"num_layers": 2, "hidden_size": 8, "num_heads": 2, "ffn_hidden_size": 8, "vocab_size": 9}
    learned = spec_from_dict({**base, "norm": "layernorm", "position": "learned", "activation": "relu",
                              "position_offset": 2})
    assert spec_from_dict(learned.to_dict()) == learned
    assert spec_from_dict(base).position_offset == 0  # every existing spec keeps its table
    _one_line_error(lambda: spec_from_dict({**base, "position_offset": 2}), "'position_offset' needs position: learned")
    _one_line_error(lambda: spec_from_dict({**base, "position": "learned", "position_offset": -1}),
                    "'position_offset' must be a non-negative integer")
