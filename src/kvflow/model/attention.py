"""Attention of a chunk that continues its sequence, without a mask — shared by the model runner's chunked
prefills (every restoration's recomputed chunks and its query) and the engine's packed steps.

Queries at positions [start, start + n) over keys [0, start + n): every query sees the whole prefix [0, start),
and the chunk's own keys causally. Each part is one flash call with no mask; the two are merged by their rows'
log-sum-exp, which is the softmax of one masked call over all the keys (``prefix_plus_diagonal``). A masked SDPA
call costs 10-25% more on this CPU at 0.5K-4K keys, and the mask itself is built per chunk.

Every ModelRunner's model attends through :func:`attention` (registered with transformers' AttentionInterface as
``kvflow``, set once when the runner is made — never switched per call, so threads that run the model at the same
time cannot see each other's setting):

    kvflow_attend=fn   the caller's own attention for this call (the engine's packed step: engine/attention.py)
    kvflow_start=s     a chunk at positions [s, s + n) of a windowless layer: on the host the native chunk op
                       (model/chunk_attention.py), else the split below, when it applies (CPU, s > 0, n > 1)
    neither            what anything else calling the model gets (``generate``, a reference prefill): on the host,
                       a causal call with no mask (transformers builds none for a whole prompt or one query
                       with no padding) goes to the same native chunk op; anything else to transformers' own
                       ``sdpa`` with the same arguments

The native op gives a query the same bits whatever chunk it comes in (csrc/chunk_attention.cpp), so routing the full
prefill and ``generate`` through it makes every chunked, restored and served prefill equal to them bit for bit on
the host (docs/DESIGN.md, "Exactness"); on a GPU, and with padding or a window's mask, they agree to rounding.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from kvflow.model import chunk_attention

NAME = "kvflow"

# torch's CPU flash kernel, which also returns each row's log-sum-exp (not exposed by F.scaled_dot_product_attention)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def splits_at_the_chunk(query: torch.Tensor, start: int, n: int, window: int | None) -> bool:
    """A chunk continuing a sequence (start > 0, no window, on the CPU) runs as prefix + diagonal, without a mask."""
    return _FLASH_CPU is not None and query.device.type == "cpu" and window is None and start > 0 and n > 1


def prefix_plus_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                         scale: float | None) -> torch.Tensor:
    """Queries at positions [start, start + n) over keys [0, start + n), the prefix seen whole and the diagonal
    block causal, merged by log-sum-exp (module docstring).

        q [1, Hq, n, D]   k, v [1, Hkv, start + n, D]   ->   [1, Hq, n, D]
    """
    _, hq, n, d = q.shape
    kvh = k.shape[1]
    groups = hq // kvh
    # the prefix: a KV head's query heads stacked as rows (every row sees every prefix key), so K/V are not copied
    o1, l1 = _FLASH_CPU(q.reshape(1, kvh, groups * n, d), k[:, :, :start], v[:, :, :start], scale=scale)[:2]
    kd, vd = k[:, :, start:], v[:, :, start:]
    if groups > 1:
        kd, vd = kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)
    o2, l2 = _FLASH_CPU(q, kd, vd, is_causal=True, scale=scale)[:2]
    o1, l1 = o1.reshape(1, hq, n, d), l1.reshape(1, hq, n)
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp_().unsqueeze(-1), (l2 - top).exp_().unsqueeze(-1)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)     # merged in fp32 (the log-sum-exps'), returned in q's


def whole_call_start(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float, kwargs: dict) -> int | None:
    """Where a call without kvflow's keywords can go to the native op: the position of its first query, else None.
    transformers leaves the mask out only for a causal call with no padding whose queries are the whole sequence or
    one query over all the keys, and for a window's layer only while every key is inside the window (the sdpa
    integration reads a missing mask so too); soft-capping, a position bias, sinks, dropout or a batch keep sdpa."""
    if attention_mask is not None or dropout or query.shape[0] != 1 or not chunk_attention.fits(
            query.shape[-1], query, key, value) or not chunk_attention.available():
        return None
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)) or any(
            kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux")):
        return None
    n, keys = query.shape[2], key.shape[2]
    return keys - 1 if n == 1 else 0 if n <= keys else None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
              kvflow_start: int | None = None, kvflow_attend=None, **kwargs):
    """transformers' attention signature (module docstring for the two keywords)."""
    if kvflow_attend is not None:
        return kvflow_attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if kvflow_start is not None and chunk_attention.fits(query.shape[-1], query, key, value) and \
            chunk_attention.available():
        return chunk_attention.dense(query, key, value, kvflow_start, scale, None), None
    if kvflow_start is not None and splits_at_the_chunk(query, kvflow_start, query.shape[2], None):
        return prefix_plus_diagonal(query, key, value, kvflow_start, scaling).transpose(1, 2).contiguous(), None
    start = None if kvflow_start is not None else whole_call_start(module, query, key, value, attention_mask, dropout,
                                                                   kwargs)
    if start is not None:
        end = start + query.shape[2]            # a whole prompt over a longer (static) cache sees its own keys only
        return chunk_attention.dense(query, key[:, :, :end], value[:, :, :end], start, scale, None), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)        # masks as sdpa builds them
