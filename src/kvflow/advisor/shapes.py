"""Shapes by name: a preset, a real model id the presets mirror, a larger real shape kept for the TP story, or a
local checkpoint's config.json (model/shape.py's ModelShape; nothing is loaded)."""

from __future__ import annotations

import json
from pathlib import Path

from kvflow.errors import ModelError
from kvflow.model.presets import PRESETS, parse_name
from kvflow.model.shape import ModelShape

# Real model ids -> the preset that mirrors their shape.
ALIASES = {"Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
           "meta-llama/Llama-3.2-1B": "llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
           "meta-llama/Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
           "mistralai/Mistral-7B-v0.3": "mistral-7b", "mistralai/Mistral-7B-Instruct-v0.3": "mistral-7b"}

# Shapes too large to run here, kept so the table shows where TP takes the reserve's share away.
EXTRA = {"llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128, 128256, False, False)}
EXTRA["meta-llama/Llama-3.1-70B"] = EXTRA["meta-llama/Llama-3.1-70B-Instruct"] = EXTRA["llama-3.1-70b"]


def table_models() -> list[str]:
    """Every preset and every extra shape, once."""
    return [*PRESETS, "llama-3.1-70b"]


def load_shape(name_or_path: str) -> ModelShape:
    """A preset (``NAME@layers=N`` too), a real model id above, or a local checkpoint directory with config.json."""
    name = ALIASES.get(name_or_path, name_or_path)
    if name in EXTRA:
        return EXTRA[name]
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise ModelError(f"{name_or_path}: not a transformers checkpoint ({err.__class__.__name__}: "
                             "no readable config.json)") from None
        return ModelShape.from_config(str(path), cfg.get("text_config", cfg))
    if name.partition("@")[0] not in PRESETS and ("/" in name or path.suffix):
        raise ModelError(f"{name_or_path}: no such checkpoint directory or known model id "
                         f"({', '.join([*PRESETS, *EXTRA])})")
    preset, layers = parse_name(name)
    cfg = dict(preset.config, model_type=preset.family)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return ModelShape.from_config(name, cfg)
