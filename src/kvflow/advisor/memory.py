"""Per-device memory of one model under tensor (TP) and pipeline (PP) parallelism: weights, the prefill activation
reserve, KV bytes per token. Arithmetic on the model's shape (model/shape.py holds the KV and activation formulas).

    weights / device   = ceil(L / PP) * layer params / TP  +  V * h / TP  (+ another V * h / TP: untied head, PP 1)
    KV / token / device = ceil(L / PP) * shape.kv_bytes_per_token_layer(kv dtype, TP)
    reserve(C) / device = k * C * b * max(2h + 3 I / TP,  2h + 2 (heads + kv_heads) / TP * head_dim)

b = bytes per activation (the weight dtype), k = calibration factor (1 = the formula; ``--calibrate`` measures it,
see calibrate.py).
"""

from __future__ import annotations

import math

import torch

from kvflow.errors import ConfigError
from kvflow.model.shape import ModelShape

FORMULA = "k x C x b x max(2h + 3I/TP, 2h + 2(heads + kv_heads)/TP x head_dim)"


def check_parallel(shape: ModelShape, tp: int, pp: int) -> None:
    """The TP/PP layouts an engine can shard this model into (vLLM's rules); ConfigError otherwise."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp and --pp must be >= 1, got TP {tp}, PP {pp}")
    if shape.heads % tp:
        raise ConfigError(f"TP {tp} does not divide {shape.name}'s {shape.heads} attention heads")
    if (shape.kv_heads % tp) if tp <= shape.kv_heads else (tp % shape.kv_heads):
        raise ConfigError(f"TP {tp} does not divide {shape.name}'s {shape.kv_heads} KV heads (nor is a multiple)")
    if shape.intermediate % tp:
        raise ConfigError(f"TP {tp} does not divide {shape.name}'s MLP width {shape.intermediate}")
    if pp > shape.layers:
        raise ConfigError(f"PP {pp} exceeds {shape.name}'s {shape.layers} layers")


def stage_layers(shape: ModelShape, pp: int) -> int:
    return math.ceil(shape.layers / pp)


def weights_per_device(shape: ModelShape, tp: int, pp: int, b: int) -> int:
    """The fullest device: a stage of ceil(L/PP) layers plus the (vocab-parallel) embedding or LM head."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim // tp, max(1, shape.kv_heads // tp) * shape.head_dim
    layer = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if shape.qkv_bias else 0) + 3 * h * shape.intermediate // tp + 2 * h
    vocab = shape.vocab * h // tp * (2 if pp == 1 and not shape.tied else 1)
    return (stage_layers(shape, pp) * layer + vocab + h) * b


def kv_bytes_per_token(shape: ModelShape, tp: int, pp: int, kv_dtype: str) -> int:
    """The fullest stage's KV bytes per token on one device."""
    return shape.kv_bytes_per_token(kv_dtype, tp, layers=stage_layers(shape, pp))


def activation_reserve(shape: ModelShape, tokens: int, tp: int, dtype: str | torch.dtype, k: float = 1.0) -> int:
    """The formula's reserve of a ``tokens``-token step on one device, times the calibration factor ``k``."""
    return int(k * shape.activation_bytes(tokens, dtype, tp))
