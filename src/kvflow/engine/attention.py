"""Packed attention: one engine step's queries of many sequences, each attending only to its own keys.

The step's tokens are packed into one row (model_runner.py); the decoder layers are the model's own. A single
masked SDPA over the packed row would compute every query against every sequence's keys and throw most of it
away (a 512-token prefill chunk next to 7 decodes at 1.5K context would do 8x the attention it needs). So during
a step the model's attention implementation is switched to ``kvflow_packed``, registered with transformers'
AttentionInterface: it runs SDPA once per sequence on that sequence's slice of the queries and of the gathered
keys. Without the step's ``kvflow_segments`` argument it is transformers' own ``sdpa`` (same function, same
arguments), so anything else that calls the model in the meantime gets exactly what it would have.

    query  [1, Hq, T_step, D]    segment s: rows   [q0, q1)   positions [start, start + n)
    key    [1, Hkv, K_step, D]   segment s: keys   [k0, k1)   positions [0, start + n)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

NAME = "kvflow_packed"


@dataclass(slots=True)
class Segment:
    q0: int
    q1: int
    k0: int
    k1: int
    masks: dict          # window (None: full attention) -> bool mask [n, start + n], or None for plain causal / one row


def segment_mask(start: int, n: int, window: int | None) -> torch.Tensor | None:
    """Which of positions [0, start + n) each query start..start+n-1 may see; None where SDPA needs no mask."""
    if window is None and (start == 0 or n == 1):
        return None
    q = torch.arange(start, start + n).view(-1, 1)
    k = torch.arange(0, start + n).view(1, -1)
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     kvflow_segments: list[Segment] | None = None, kvflow_windows=None, **kwargs):
    if kvflow_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kvflow_windows[module.layer_idx]
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for s in kvflow_segments:
        mask = s.masks[window]
        causal = mask is None and s.q1 - s.q0 > 1
        outs.append(F.scaled_dot_product_attention(query[:, :, s.q0:s.q1], key[:, :, s.k0:s.k1],
                                                   value[:, :, s.k0:s.k1], attn_mask=mask, is_causal=causal,
                                                   scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)        # a whole-model call meanwhile builds sdpa's masks


@contextmanager
def packed(config):
    """Route ``config``'s attention through :func:`packed_attention` for the duration of one step."""
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
