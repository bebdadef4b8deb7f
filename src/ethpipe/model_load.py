"""Resolving the model a user names: a preset, a YAML/JSON spec file, or a Hugging Face config.json or model
directory. Above both ``model_spec`` (the spec and its presets) and ``hf.config`` (the HF mapping)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ethpipe.errors import UserError, parse_error_summary
from ethpipe.hf.config import read_config, spec_from_hf
from ethpipe.model_spec import ModelSpec, model_presets, spec_from_dict


def spec_from_hf_config(config: dict[str, Any], name: str = "hf") -> ModelSpec:
    """Map a Hugging Face ``config.json`` (Llama/Mistral/Qwen2, GPT-2 or OPT) to a spec (see ``ethpipe.hf.config``)."""
    return spec_from_hf(config, name=name)


def load_model_spec(model: str) -> ModelSpec:
    """A preset name, a YAML/JSON spec file, or a Hugging Face config.json."""
    presets = model_presets()
    if model.lower() in presets:
        return presets[model.lower()]
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model directory
        return spec_from_hf_config(read_config(path), name=path.resolve().name)
    if not path.is_file():
        raise UserError(
            f"unknown model '{model}': use a preset ({', '.join(sorted(presets))}), a spec YAML, or a config.json path"
        )
    try:
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise UserError(f"model file '{path}' is not valid YAML/JSON: {parse_error_summary(err)}") from None
    if isinstance(data, dict) and ("num_hidden_layers" in data or "n_layer" in data):
        return spec_from_hf_config(data, name=path.resolve().parent.name if path.stem == "config" else path.stem)
    return spec_from_dict({"name": path.stem, **data} if isinstance(data, dict) else data)
