"""What a publishable HF export carries besides the weights: dtype, token ids, generation config, tokenizer.

A checkpoint records the run's precision but not the HF directory it started from (``--init-from``
is not in the manifest), so the token ids and ``generation_config.json`` come from ``--source DIR``,
checked to be the same model, and the tokenizer from ``--tokenizer DIR``. Everything here is
checked before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ethpipe.errors import UserError
from ethpipe.hf.config import read_config, spec_from_hf
from ethpipe.hf.load import first_difference
from ethpipe.model_spec import ModelSpec

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> config.json's dtype name
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")


@dataclass(frozen=True)
class SourceModel:
    """The token ids and generation config of the HF model a run started from."""

    path: Path
    token_ids: dict[str, Any]  # bos/eos/pad_token_id: an int, a list (Llama 3's eos) or None
    generation_config: str  # the text of generation_config.json: the source's own, or built from token_ids
    copied_generation_config: bool  # False: built from token_ids (the source has none)


def export_dtype(text: str | None, trained: str | None) -> str:
    """``--dtype`` as bf16/fp16/fp32; None: the run's precision if 16-bit (fp32 and fp64 runs: fp32)."""
    if text is None:
        return trained if trained in ("bf16", "fp16") else "fp32"
    if text not in DTYPES:
        raise UserError(f"--dtype must be bf16, fp16 or fp32, got {text!r}")
    return text


def trained_dtype(extra: dict[str, Any]) -> str | None:
    """The precision a checkpoint's run trained in (its manifest's ``extra``), None if not recorded."""
    dtype = extra.get("dtype") or (extra.get("settings") or {}).get("dtype")
    return str(dtype) if dtype else None


def _generation_text(ids: dict[str, Any]) -> str:
    """What ``GenerationConfig.from_model_config(config).save_pretrained`` writes for these ids."""
    body = {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}
    return json.dumps(body, indent=2) + "\n"


def read_source(path: str | Path, spec: ModelSpec) -> SourceModel:
    """``--source DIR``: a HF directory of the very model exported, so its token ids fit the vocabulary."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--source '{path}' is not a directory: give the Hugging Face model directory the run "
                        "started from (its --init-from)")
    config = read_config(path)
    where = str(path / "config.json")
    theirs = spec_from_hf(config, where=where)
    field = first_difference(theirs, spec)
    if field is not None:
        raise UserError(f"--source '{path}' is a model with {field}={getattr(theirs, field)!r} but "
                        f"the checkpoint's model has {field}={getattr(spec, field)!r}: give the directory the run "
                        "started from")
    file = path / GENERATION_CONFIG
    generation: dict[str, Any] = {}
    if file.is_file():
        try:
            generation = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UserError(f"'{file}' is not valid JSON: {str(err).splitlines()[0]}") from None
        if not isinstance(generation, dict):
            raise UserError(f"'{file}' must hold a JSON object")
    ids = {k: config[k] if config.get(k) is not None else generation.get(k) for k in TOKEN_KEYS}
    text = file.read_text() if generation else _generation_text(ids)
    return SourceModel(path, ids, text, bool(generation))


def tokenizer_files(path: str | Path) -> list[Path]:
    """``--tokenizer DIR``'s tokenizer files; a one-line error if it has none."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--tokenizer '{path}' is not a directory: give the directory holding tokenizer.json / "
                        "tokenizer_config.json (the original model's)")
    files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not files:
        raise UserError(f"--tokenizer '{path}' has no tokenizer file ({', '.join(TOKENIZER_FILES[:5])}, ...): "
                        "give the original model's directory")
    return files
