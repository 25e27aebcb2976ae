"""ModelShape: the numbers of a decoder-only LM that size its memory — from a preset, a real model id the presets
mirror, a larger real shape kept for the TP story, or a local checkpoint's config.json. Nothing is loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvflow.errors import ModelError
from kvflow.model.presets import PRESETS, parse_name


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool            # lm_head shares the embedding
    qkv_bias: bool        # Qwen2: q/k/v projections carry a bias

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h                    # + MLP (gate, up, down) + 2 RMSNorms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


def shape_from_config(name: str, cfg: dict) -> ModelShape:
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelShape(name, int(cfg["num_hidden_layers"]), hidden, int(cfg["intermediate_size"]), heads,
                          int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or hidden // heads),
                          int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)),
                          bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")))
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(f"{name}: config has no usable {err} for a decoder-only LM") from None


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
        return shape_from_config(str(path), cfg.get("text_config", cfg))
    if name.partition("@")[0] not in PRESETS and ("/" in name or path.suffix):
        raise ModelError(f"{name_or_path}: no such checkpoint directory or known model id "
                         f"({', '.join([*PRESETS, *EXTRA])})")
    preset, layers = parse_name(name)
    cfg = dict(preset.config, model_type=preset.family)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return shape_from_config(name, cfg)
