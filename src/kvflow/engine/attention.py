"""Packed attention: one engine step's queries of many sequences, each attending only to its own keys.

The step's tokens are packed into one row (model_runner.py); the decoder layers are the model's own. A single
masked SDPA over the packed row would compute every query against every sequence's keys and throw most of it
away (a 512-token prefill chunk next to 7 decodes at 1.5K context would do 8x the attention it needs). So during
a step the model's attention implementation is switched to ``kvflow_packed``, registered with transformers'
AttentionInterface: it runs SDPA once per sequence on that sequence's slice of the queries and that sequence's
keys, gathered from the paged cache just before (and freed just after): a step never holds more than one
sequence's gathered K/V of one layer, however many sequences it batches — which is what bounds the activation
reserve (reserve.py) by the longest sequence, not by the batch. Without the step's ``kvflow_segments`` argument it
is transformers' own ``sdpa`` (same function, same arguments), so anything else that calls the model in the
meantime gets exactly what it would have.

A chunk that continues its sequence on the CPU (no window) runs as prefix + causal diagonal block, merged by
log-sum-exp (``prefix_plus_diagonal``): no mask is built.

    query  [1, Hq, T_step, D]    segment s: rows   [q0, q1)   positions [start, start + n)
    cache  PagedKVCache          segment s: slots  ``read``   positions [0, start + n)
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


MASK_ELEMENTS = 1 << 20      # queries x keys of one masked SDPA call at most: a long chunk runs in blocks of rows
MASK_CACHE_BYTES = 8 << 20   # masks kept for the step's other layers up to this many bytes (beyond: rebuilt)


@dataclass(slots=True)
class Segment:
    q0: int
    q1: int
    start: int           # position of the sequence's first query (its rows are positions start .. start + n - 1)
    read: torch.Tensor   # cache slots of the sequence's positions [0, start + n) (the step's own K/V written first)


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


# torch's CPU flash kernel, which also returns each row's log-sum-exp (not exposed by F.scaled_dot_product_attention)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def splits_at_the_chunk(query: torch.Tensor, start: int, n: int, window: int | None) -> bool:
    """A chunk continuing a sequence (start > 0, no window, on the CPU) runs as prefix + diagonal, without a mask."""
    return _FLASH_CPU is not None and query.device.type == "cpu" and window is None and start > 0 and n > 1


def prefix_plus_diagonal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                         scale: float | None) -> torch.Tensor:
    """Queries at positions [start, start + n) over keys [0, start + n): the prefix [0, start), which every query
    sees whole (no mask), and the chunk's own keys, causal from its first row, each one flash call; the two are
    merged by their rows' log-sum-exp — the softmax of one masked call over all the keys, without building the mask
    (a masked call also costs 10-25% more per call on this CPU at 0.5K-4K keys).

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
    return (o1 * w1 + o2 * w2) / (w1 + w2)


def row_blocks(start: int, n: int, window: int | None = None) -> list[tuple[int, int]]:
    """Rows [r0, r1) of a segment per SDPA call. A prefill from position 0 without a window is one causal call (no
    mask); a chunk that needs a mask goes in blocks of at most MASK_ELEMENTS queries x keys, so its mask stays
    bounded however long its context (each row's softmax is its own: the result is the same)."""
    if start == 0 and window is None:
        return [(0, n)]
    rows = max(1, MASK_ELEMENTS // (start + n))
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


class StepMasks:
    """One step's masks, built by its first layer and reused by the others (kept up to MASK_CACHE_BYTES)."""

    def __init__(self) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}
        self._bytes = 0

    def get(self, key: tuple, start: int, n: int, window: int | None) -> torch.Tensor | None:
        if key in self._masks:
            return self._masks[key]
        mask = segment_mask(start, n, window)
        if mask is not None and self._bytes + mask.numel() <= MASK_CACHE_BYTES:
            self._masks[key], self._bytes = mask, self._bytes + mask.numel()
        return mask


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     kvflow_segments: list[Segment] | None = None, kvflow_windows=None, kvflow_cache=None,
                     kvflow_masks: StepMasks | None = None, **kwargs):
    """With ``kvflow_segments``: ``key``/``value`` are only the step's new K/V (already written to ``kvflow_cache``);
    each segment's keys are gathered from the cache. ``kvflow_masks``: the step's masks, shared by its layers."""
    if kvflow_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = module.layer_idx
    window = kvflow_windows[layer]
    gqa = query.shape[1] != kvflow_cache.kv_heads
    masks = StepMasks() if kvflow_masks is None else kvflow_masks
    outs = []
    for i, s in enumerate(kvflow_segments):
        k, v = kvflow_cache.gather(layer, s.read)
        if splits_at_the_chunk(query, s.start, s.q1 - s.q0, window):
            outs.append(prefix_plus_diagonal(query[:, :, s.q0:s.q1], k, v, s.start, scaling))
        else:
            for r0, r1 in row_blocks(s.start, s.q1 - s.q0, window):
                end = s.start + r1                   # keys [0, end) are the ones these rows may see
                mask = masks.get((i, r0, window), s.start + r0, r1 - r0, window)
                causal = mask is None and r1 - r0 > 1
                outs.append(F.scaled_dot_product_attention(query[:, :, s.q0 + r0:s.q0 + r1], k[:, :, :end],
                                                           v[:, :, :end], attn_mask=mask, is_causal=causal,
                                                           scale=scaling, enable_gqa=gqa))
        del k, v                          # freed before the next segment's gather
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
