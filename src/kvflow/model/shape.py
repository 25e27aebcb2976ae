"""ModelShape: the numbers of a decoder-only LM that size its memory, built once from its config. Every count of
KV bytes, activation bytes and parameters is a method here; dtypes are named by model/dtypes.py's table.

    KV / token / layer   = 2 (K, V) x max(1, kv_heads / TP) x head_dim x bytes
    KV / token           = layers x KV / token / layer
    activations / token  = bytes x max(2h + 3 I / TP,  2h + 2 (heads + kv_heads) / TP x head_dim)

The activation line is one layer's peak of a prefill step (layers run one after another, so it does not grow with
the layer count): the residual and the normed input (2h) plus the MLP's act(gate), up and their product (3 I / TP)
— or attention's q, rotated q, k, v where that is larger (FlashAttention-style kernels: no C x C scores).
docs/ADVISOR.md prices a GPU with it; the engine measures its own (engine/reserve.py) and uses it only where it
cannot measure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.errors import ModelError
from kvflow.model.dtypes import itemsize


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

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> ModelShape:
        """From a transformers config (``config.to_dict()`` or a config.json's mapping); ModelError when a field a
        decoder-only LM needs is missing."""
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(name, int(cfg["num_hidden_layers"]), hidden, int(cfg["intermediate_size"]), heads,
                       int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or hidden // heads),
                       int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)),
                       bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")))
        except (KeyError, TypeError, ValueError) as err:
            raise ModelError(f"{name}: config has no usable {err} for a decoder-only LM") from None

    def kv_bytes_per_token_layer(self, dtype: str | torch.dtype = "float32", tp: int = 1) -> int:
        """K and V of one token in one layer (on one of ``tp`` devices: KV heads split, replicated beyond their
        count)."""
        return 2 * max(1, self.kv_heads // tp) * self.head_dim * itemsize(dtype)

    def kv_bytes_per_token(self, dtype: str | torch.dtype = "float32", tp: int = 1, layers: int | None = None) -> int:
        """K and V of one token in every layer (or ``layers`` of them: a pipeline stage)."""
        return (self.layers if layers is None else layers) * self.kv_bytes_per_token_layer(dtype, tp)

    def activation_bytes_per_token(self, dtype: str | torch.dtype, tp: int = 1) -> int:
        """One layer's peak prefill activations per token of the step (the module docstring's formula)."""
        h = self.hidden
        mlp = 2 * h + 3 * self.intermediate // tp
        attn = 2 * h + 2 * (self.heads // tp + max(1, self.kv_heads // tp)) * self.head_dim
        return itemsize(dtype) * max(mlp, attn)

    def activation_bytes(self, tokens: int, dtype: str | torch.dtype, tp: int = 1) -> int:
        """The formula's activation reserve of a step of ``tokens`` tokens."""
        return tokens * self.activation_bytes_per_token(dtype, tp)

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h                    # + MLP (gate, up, down) + 2 RMSNorms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
