"""Named model shapes built with random weights, deterministic from a seed (nothing is downloaded).

``NAME@layers=N`` keeps a preset's shape with only N decoder layers, so large shapes fit a small CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.errors import ModelError


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    family: str  # transformers model_type
    description: str
    config: dict = field(default_factory=dict)


_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("tiny", "llama", "test model: 4 layers, hidden 256, GQA 8q/2kv heads", dict(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=262144, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)),
    # Deep and narrow: hidden 256 vs 16 layers x 4 KV heads x 32 — at 2 pipeline stages the boundary activation
    # is 1/8 of a stage's KV per token, Llama-3.1-8B's ratio (4096 / (2 x 8 x 128 x 16)). The pipeline bench model.
    Preset("tiny-deep", "llama", "pipeline test model: tiny's shape with 16 layers, 8q/4kv heads", dict(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=16, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=262144, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)),
    Preset("qwen2.5-0.5b", "qwen2", "Qwen2.5-0.5B shape: 24 layers, hidden 896, 14q/2kv heads", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False)),
    Preset("llama-3.2-1b", "llama", "Llama-3.2-1B shape: 16 layers, hidden 2048, 32q/8kv heads", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE)),
    Preset("llama-3.1-8b", "llama", "Llama-3.1-8B shape: 32 layers, hidden 4096, 32q/8kv heads", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters={**_LLAMA3_ROPE, "factor": 8.0})),
    Preset("mistral-7b", "mistral", "Mistral-7B-v0.3 shape: 32 layers, hidden 4096, 32q/8kv heads", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
]}


def parse_name(name: str) -> tuple[Preset, int | None]:
    """``"qwen2.5-0.5b@layers=4"`` -> (preset, 4). Raises ModelError for unknown names or bad suffixes."""
    base, at, suffix = name.partition("@")
    preset = PRESETS.get(base)
    if preset is None:
        from kvflow.model.catalog import CATALOG
        raise ModelError(f"unknown model {base!r}: use a real model ({', '.join(CATALOG)}), a random-weight preset "
                         f"({', '.join(PRESETS)}) or a local checkpoint directory")
    if not at:
        return preset, None
    key, _, value = suffix.partition("=")
    # ASCII digits only: str.isdigit() also takes '²' and '١', which int() refuses or reads as another number
    if key != "layers" or not value.isascii() or not value.isdigit() or int(value) < 1:
        raise ModelError(f"bad model suffix {suffix!r} in {name!r}: expected @layers=N with N >= 1")
    layers = int(value)
    if layers > preset.config["num_hidden_layers"]:
        raise ModelError(f"{base} has {preset.config['num_hidden_layers']} layers; {name!r} asks for {layers}")
    return preset, layers


def build_config(preset: Preset, layers: int | None = None):
    from transformers import AutoConfig

    cfg = dict(preset.config)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return AutoConfig.for_model(preset.family, **cfg)
