"""Per-device memory of one model under tensor (TP) and pipeline (PP) parallelism: weights, the prefill activation
reserve (a formula in the model shape and the token budget), KV bytes per token. Pure arithmetic, no torch.

    weights / device   = ceil(L / PP) * layer params / TP  +  V * h / TP  (+ another V * h / TP: untied head, PP 1)
    KV / token / device = 2 * ceil(L / PP) * max(1, kv_heads / TP) * head_dim * kv bytes
    reserve(C) / device = k * C * b * max(2h + 3 I / TP,  2h + 2 (heads + kv_heads) / TP * head_dim)

The reserve is the peak of one layer (layers run one after another, so it does not grow with L): the residual and
the normed input (2h) plus the MLP's act(gate), up and their product (3 I / TP) — or attention's q, rotated q, k, v
where that is larger (FlashAttention-style kernels: no C x C scores). b = bytes per activation (the weight dtype),
k = calibration factor (1 = the formula; ``--calibrate`` measures it, see calibrate.py).
"""

from __future__ import annotations

import math

from kvflow.advisor.shapes import ModelShape
from kvflow.errors import ConfigError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
FORMULA = "k x C x b x max(2h + 3I/TP, 2h + 2(heads + kv_heads)/TP x head_dim)"


def dtype_bytes(name: str, what: str) -> int:
    if name not in DTYPE_BYTES:
        raise ConfigError(f"{what} {name!r}: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


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


def kv_bytes_per_token(shape: ModelShape, tp: int, pp: int, kv_b: int) -> int:
    return 2 * stage_layers(shape, pp) * max(1, shape.kv_heads // tp) * shape.head_dim * kv_b


def reserve_per_token(shape: ModelShape, tp: int, b: int) -> int:
    h = shape.hidden
    mlp = 2 * h + 3 * shape.intermediate // tp
    attn = 2 * h + 2 * (shape.heads // tp + max(1, shape.kv_heads // tp)) * shape.head_dim
    return b * max(mlp, attn)


def activation_reserve(shape: ModelShape, tokens: int, tp: int, b: int, k: float = 1.0) -> int:
    return int(k * tokens * reserve_per_token(shape, tp, b))
