"""Publishing a Hugging Face export: token ids, generation config, weight dtype, file modes, tokenizer.

Checkpoints are written here in one process the way a run lays them out (DCP files + manifest, fp32
master weights, the run's precision recorded), so `ethpipe export` runs on the real format without
starting ranks. bf16 logits are compared at a tolerance derived from bf16's epsilon (2^-7 relative
to the largest logit); the exported weights are the source's own bf16 values, so the measured
difference is 0.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from _hf_models import hf_logits, make_config, save_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

import ethpipe.cli.commands  # noqa: E402,F401  (registers the commands on the app)
from ethpipe.cli.app import app  # noqa: E402
from ethpipe.errors import UserError  # noqa: E402
from ethpipe.hf.export import export_hf  # noqa: E402
from ethpipe.hf.load import load_full  # noqa: E402
from ethpipe.hf.publish import TOKENIZER_FILES  # noqa: E402
from ethpipe.model_spec import ModelSpec  # noqa: E402
from ethpipe.runtime.checkpoint.layout import (  # noqa: E402
    OPTIM_KINDS, DataCursor, commit, crc32_file, new_manifest, optim_key, parameter_names, tmp_dir_name,
)

BOS, EOS, PAD = 5, 7, 3  # not transformers' defaults (1, 2, None), so carried ids are told from defaults
SAFE_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _source(path: Path, arch: str = "llama", dtype: Any = None) -> tuple[Any, Path]:
    """A random HF model with its own token ids and a non-default generation config, saved to ``path``."""
    config = make_config(arch)
    if arch == "llama":
        config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS, EOS, PAD
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.generation_config = transformers.GenerationConfig.from_model_config(config)
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    if dtype is not None:
        model = model.to(dtype)
    return model, save_model(model, path)


def _checkpoint(root: Path, spec: ModelSpec, state: dict[str, Any], trained: str | None, step: int = 2) -> Path:
    """A checkpoint as `ethpipe train --checkpoint-dir` writes it: fp32 weights, AdamW state, manifest."""
    flat = {name: t.float().contiguous() for name, t in state.items()}
    for name in parameter_names(spec):
        for kind in OPTIM_KINDS:
            flat[optim_key(kind, name)] = torch.zeros(()) if kind == "step" else torch.zeros_like(flat[name])
    tmp = root / tmp_dir_name(step)
    with warnings.catch_warnings():  # DCP warns that it saves in one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
    files = {p.name: (p.stat().st_size, crc32_file(p)) for p in tmp.iterdir() if p.is_file()}
    extra = {} if trained is None else {"dtype": trained, "settings": {"dtype": trained}}
    commit(root, tmp, new_manifest(step, DataCursor(0, False, 0, 100), {}, spec, files, extra), keep=3)
    return root


def _tokenizer(path: Path) -> Path:
    """A tiny fast tokenizer saved by transformers (tokenizer.json, tokenizer_config.json, ...)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("the cat sat on a mat".split())}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(path)
    (path / "README.md").write_text("not a tokenizer file")
    return path


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_exit_2(args: list[str]) -> str:
    result = _invoke(args)
    out = (result.stdout or "") + (result.stderr or "")
    assert result.exit_code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith("error:"), out
    return out


def _shard_dtypes(out: Path) -> set[str]:
    found = set()
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            found |= {f.get_slice(k).get_dtype() for k in f.keys()}
    return found


def test_bf16_run_exports_bf16_with_the_sources_token_ids_and_generation_config(tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src", dtype=torch.bfloat16)
    spec, state = load_full(src)
    ckpt = _checkpoint(tmp_path / "ckpt", spec, state, trained="bf16")
    result = _invoke(["export", ckpt, "--format", "hf", "--out", tmp_path / "out", "--source", src])
    assert result.exit_code == 0, result.output
    assert "in bfloat16" in result.output and f"bos {BOS}, eos {EOS}, pad {PAD}" in result.output
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS, EOS, PAD)
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert _shard_dtypes(out) == {"BF16"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in state.values())  # 2 bytes per weight

    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    source = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    theirs = source.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in exported.state_dict().items())  # bf16 -> fp32 -> bf16 exact
    tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ours, ref = hf_logits(exported, tokens), hf_logits(source, tokens)
    assert ours.dtype == torch.bfloat16
    tol = torch.finfo(torch.bfloat16).eps * ref.float().abs().max().item()
    diff = (ours.float() - ref.float()).abs().max().item()
    print(f"bf16 export vs bf16 source: max |logit difference| = {diff:.3g} (tolerance {tol:.3g})")
    assert diff <= tol
    generation = exported.generation_config
    assert (generation.bos_token_id, generation.eos_token_id, generation.temperature) == (BOS, EOS, 0.7)


@pytest.mark.parametrize("trained, flag, want", [
    ("bf16", None, "bfloat16"), ("fp16", None, "float16"), ("fp32", None, "float32"), ("fp64", None, "float32"),
    (None, None, "float32"),  # a checkpoint that does not record its precision
    ("bf16", "fp32", "float32"), ("fp32", "fp16", "float16"), ("fp32", "bf16", "bfloat16"),
])
def test_weights_dtype_defaults_to_the_runs_precision(trained: str | None, flag: str | None, want: str,
                                                      tmp_path: Path) -> None:
    model, src = _source(tmp_path / "src")
    spec, state = load_full(src)
    ckpt = _checkpoint(tmp_path / "ckpt", spec, state, trained)
    result = _invoke(["export", ckpt, "--format", "hf", "--out", tmp_path / "out",
                      *(["--dtype", flag] if flag else [])])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == want and f"in {want}" in result.output
    assert _shard_dtypes(tmp_path / "out") == {SAFE_DTYPES[want]}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=getattr(torch, want))
    theirs = model.state_dict()
    assert all(torch.equal(v, theirs[k].to(v.dtype)) for k, v in loaded.state_dict().items())  # rounded once
    # no --source: today's null ids and no generation config, said in one line
    assert config["bos_token_id"] is None and config["eos_token_id"] is None and "pad_token_id" not in config
    assert not (tmp_path / "out/generation_config.json").exists()
    assert sum("no source model given" in line for line in result.output.splitlines()) == 1


def test_generation_config_is_built_from_the_token_ids_when_the_source_has_none(tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src", arch="gpt2")  # GPT2Config(bos_token_id=0, eos_token_id=0)
    (src / "generation_config.json").unlink()
    spec, state = load_full(src)
    report = export_hf(state, spec, tmp_path / "out", source=src)
    assert report.source is not None and not report.source.copied_generation_config
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 0)
    built = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (built.bos_token_id, built.eos_token_id) == (0, 0)
    assert json.loads((tmp_path / "out/generation_config.json").read_text()) == {
        "_from_model_config": True, "bos_token_id": 0, "eos_token_id": 0}


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_files_follow_the_umask(umask: int, file_mode: int, dir_mode: int, tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src")
    tok = _tokenizer(tmp_path / "tok")
    for file in tok.iterdir():
        file.chmod(0o400)  # a read-only source must not make read-only copies
    spec, state = load_full(src)
    old = os.umask(umask)
    try:
        export_hf(state, spec, tmp_path / "out", max_shard_size="20KB", dtype="bf16", source=src, tokenizer=tok)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    files = sorted(out.iterdir())
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "tokenizer.json") in files
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in files}
    assert set(modes.values()) == {oct(file_mode)}, modes
    assert oct(out.stat().st_mode & 0o777) == oct(dir_mode)


def test_tokenizer_files_are_copied(tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src")
    tok = _tokenizer(tmp_path / "tok")
    spec, state = load_full(src)
    ckpt = _checkpoint(tmp_path / "ckpt", spec, state, trained="fp32")
    result = _invoke(["export", ckpt, "--format", "hf", "--out", tmp_path / "out", "--tokenizer", tok])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    expected = [name for name in TOKENIZER_FILES if (tok / name).is_file()]
    assert "tokenizer.json" in expected and "tokenizer_config.json" in expected
    for name in expected:
        assert (out / name).read_bytes() == (tok / name).read_bytes(), name
    assert not (out / "README.md").exists()
    assert f"copied {', '.join(expected)}" in result.output
    text = "the cat sat on a mat"
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(tok)(text)["input_ids"]


def test_bad_publish_options_are_one_line(tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src")
    _, other = _source(tmp_path / "gpt2", arch="gpt2")
    spec, state = load_full(src)
    ckpt = _checkpoint(tmp_path / "ckpt", spec, state, trained="bf16")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    base = ["export", ckpt, "--format", "hf", "--out", tmp_path / "o"]
    assert "--dtype must be bf16, fp16 or fp32, got 'fp8'" in _one_line_exit_2([*base, "--dtype", "fp8"])
    out = _one_line_exit_2([*base, "--tokenizer", empty])
    assert "--tokenizer" in out and "has no tokenizer file" in out
    assert "--tokenizer" in _one_line_exit_2([*base, "--tokenizer", tmp_path / "nowhere"])
    out = _one_line_exit_2([*base, "--source", other])
    assert "--source" in out and "the checkpoint's model has" in out
    assert "--source" in _one_line_exit_2([*base, "--source", tmp_path / "nowhere"])
    out = _one_line_exit_2(["export", ckpt, "--out", tmp_path / "w.safetensors", "--dtype", "bf16"])
    assert "--dtype apply to --format hf only" in out
    assert not (tmp_path / "o").exists() and not (tmp_path / "w.safetensors").exists()


def test_fp16_overflow_is_refused(tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src")
    spec, state = load_full(src)
    state["norm.weight"] = state["norm.weight"].clone()
    state["norm.weight"][0] = 1e5
    with pytest.raises(UserError, match="'model.norm.weight' does not fit fp16") as info:
        export_hf(state, spec, tmp_path / "out", dtype="fp16")
    assert "--dtype bf16" in str(info.value) and not (tmp_path / "out").exists()
    export_hf(state, spec, tmp_path / "out", dtype="bf16")  # bf16 has fp32's range
    assert _shard_dtypes(tmp_path / "out") == {"BF16"}


def test_the_runs_init_from_in_run_toml_is_the_default_source(tmp_path: Path) -> None:
    _, src = _source(tmp_path / "src", dtype=torch.bfloat16)
    spec, state = load_full(src)
    ckpt = _checkpoint(tmp_path / "ckpt", spec, state, trained="bf16")
    (Path(ckpt) / "run.toml").write_text(f'init-from = "{src}"\nsteps = 10\n')  # what `train` writes there
    result = _invoke(["export", ckpt, "--format", "hf", "--out", tmp_path / "out"])
    assert result.exit_code == 0, result.output
    assert f"source model: {src}" in result.output and "no source model given" not in result.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS, EOS)
