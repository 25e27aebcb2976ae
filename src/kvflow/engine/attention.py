"""Packed attention: one engine step's queries of many sequences, each attending only to its own keys.

The step's tokens are packed into one row (model_runner.py); the decoder layers are the model's own. A single
masked SDPA over the packed row would compute every query against every sequence's keys and throw most of it
away (a 512-token prefill chunk next to 7 decodes at 1.5K context would do 8x the attention it needs). So a step
hands the model's attention (model/attention.py) ``kvflow_attend=packed_attention`` with its segments: it runs
attention once per sequence on that sequence's slice of the queries and that sequence's keys, gathered from the
paged cache just before (and freed just after; views of the cache, no copy, where the sequence's blocks are
consecutive ids): a step never holds more than one sequence's gathered K/V of one layer, however many sequences it
batches — which is what bounds the activation reserve (reserve.py) by the
longest sequence, not by the batch. A prompt's first chunk (from position 0) attends the step's own new K/V and
gathers nothing, where the cache stores them at their width. Each result is written at its rows of one output
buffer. Without ``kvflow_segments`` it is transformers' own ``sdpa`` (same function, same arguments).

A chunk that continues its sequence on the CPU (no window) runs as prefix + causal diagonal block, merged by
log-sum-exp (``model/attention.py``, shared with the model runner's chunked prefills): no mask is built.

On the host, every decode of a step (one query each) is attended in place by a native op over the block tables
(``PagedDecodes``, paged_decode.py): nothing is gathered. Where that op is not built (or off the host), a decode
over a long context is two small matmuls (``one_query``), not SDPA, and decodes over short
contexts (under ONE_QUERY_KEYS keys) are attended together instead (``DecodeGroup``): the step puts them first in
its packed row, longest first, and each group of them is one ``index_select`` of their blocks, padded to the
group's longest, and one masked SDPA call. Per sequence, a decode over 300 keys is a few tens of microseconds of
arithmetic behind two calls' fixed costs; 32 of them per layer took 2.3 ms one by one and 0.9 ms in groups of 9
(smollm2-135m's shape, the 2-vCPU box). A group's gathered K/V is at most DECODE_GROUP_BYTES (it stays in the
caches between the copy and the pass over it; larger groups measured no faster) and never more keys than the
longest sequence the engine holds, whose one-layer K/V the activation reserve already counts (reserve.py).

    query  [1, Hq, T_step, D]    segment s: rows    [q0, q1)    positions [start, start + n)
    cache  PagedKVCache          segment s: blocks  ``blocks``  positions [0, start + n)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvflow.engine import paged_decode
from kvflow.model.attention import prefix_plus_diagonal, splits_at_the_chunk

MASK_ELEMENTS = 1 << 20      # queries x keys of one masked SDPA call at most: a long chunk runs in blocks of rows
MASK_CACHE_BYTES = 8 << 20   # masks kept for the step's other layers up to this many bytes (beyond: rebuilt)
ONE_QUERY_KEYS = 768         # a decode over at least this many keys runs as two matmuls (one_query), else SDPA
DECODE_GROUP_BYTES = 4 << 20  # gathered K/V of one group of short decodes at most (1-8 MiB measured alike)


@dataclass(slots=True)
class Segment:
    q0: int
    q1: int
    start: int           # position of the sequence's first query (its rows are positions start .. start + n - 1)
    blocks: torch.Tensor  # block ids of the sequence's positions [0, start + n) (the step's own K/V written first)
    first: int | None = None   # blocks[0] when they are consecutive ids: the gather is a view (PagedKVCache.run_start)


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of one step at packed rows [q0, q0 + count), attended in one call: sequence i's keys are positions
    [0, lengths[i]), its blocks padded (with its own first block) to ``keys`` positions and the padding masked."""
    q0: int
    lengths: torch.Tensor      # [count] keys of each decode
    index: torch.Tensor        # rows of a layer's [K blocks; V blocks] (PagedKVCache.gather_padded)
    keys: int                  # padded keys per sequence (whole blocks)
    masks: dict = field(default_factory=dict)   # window -> additive mask [count, 1, 1, keys], built on first use

    @property
    def count(self) -> int:
        return self.lengths.numel()

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            pos, length = torch.arange(self.keys, device=self.lengths.device).view(1, -1), self.lengths.view(-1, 1)
            seen = pos < length
            if window is not None:
                seen &= pos >= length - window
            self.masks[window] = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill_(
                ~seen, float("-inf")).view(self.count, 1, 1, self.keys)
        return self.masks[window]


@dataclass(slots=True)
class PagedDecodes:
    """Decodes of one step at packed rows [q0, q0 + count), attended in place by the native op (paged_decode.py):
    sequence i's keys are positions [0, lengths[i]) in the blocks of row i of ``tables`` (padded with its first)."""
    q0: int
    lengths: torch.Tensor      # [count] int64
    tables: torch.Tensor       # [count, max blocks] int64

    @property
    def count(self) -> int:
        return self.lengths.numel()


def in_a_group(n: int, end: int, native: bool = False) -> bool:
    """Whether a step's item of ``n`` new tokens ending at ``end`` is a decode attended with others: every decode by
    the native op in place (``native``), else one under ONE_QUERY_KEYS keys in a DecodeGroup; the rest one_query, or
    their own segment."""
    return n == 1 and (native or end < ONE_QUERY_KEYS)


def paged_decodes(ends: list[int], tables: list[list[int]], block_size: int, device) -> list[PagedDecodes]:
    """The decodes whose contexts end at ``ends`` (at packed rows 0, 1, ...; block tables ``tables``) as one call of
    the native op per layer (none when there are none)."""
    if not ends:
        return []
    rows = [t[:(e + block_size - 1) // block_size] for t, e in zip(tables, ends)]
    width = max(len(r) for r in rows)
    padded = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    return [PagedDecodes(0, torch.tensor(ends, dtype=torch.long, device=device), padded)]


def groups_of_decodes(ends: list[int], tables: list[list[int]], block_size: int, num_blocks: int, max_keys: int,
                      bytes_per_key: int, device) -> list[DecodeGroup]:
    """Groups of the decodes whose contexts end at ``ends`` (longest first, at packed rows 0, 1, ...; their block
    tables ``tables``): consecutive decodes while the group's padded keys stay within DECODE_GROUP_BYTES of
    gathered K/V and ``max_keys``; a decode longer than that on its own is a group of one."""
    limit = max(1, min(max_keys, DECODE_GROUP_BYTES // max(1, bytes_per_key)))
    groups, i = [], 0
    while i < len(ends):
        nblocks = (ends[i] + block_size - 1) // block_size
        j = i + 1
        while j < len(ends) and (j + 1 - i) * nblocks * block_size <= limit:
            j += 1
        padded = [t[:(e + block_size - 1) // block_size] for t, e in zip(tables[i:j], ends[i:j])]
        rows = torch.tensor([b + [b[0]] * (nblocks - len(b)) for b in padded], dtype=torch.long).view(-1)
        index = torch.cat([rows, rows + num_blocks]).to(device)
        groups.append(DecodeGroup(i, torch.tensor(ends[i:j], device=device), index, nblocks * block_size))
        i = j
    return groups


def segment_mask(start: int, n: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Which of positions [0, start + n) each query start..start+n-1 may see; None where SDPA needs no mask."""
    if window is None and (start == 0 or n == 1):
        return None
    q = torch.arange(start, start + n, device=device).view(-1, 1)
    k = torch.arange(0, start + n, device=device).view(1, -1)
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


def one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A decode's one query over all of its keys as two small matmuls: a KV head's query heads are the rows of one
    [groups, D] x [D, T] product, so K/V are read once and never repeated per query head. SDPA's CPU kernels
    parallelise over query heads x query blocks — for one query that is 8 work items of a few microseconds each,
    and they took ~300 us a call at 4K keys against ~150 us for this (``tiny``, memory-bound either way); below
    ~768 keys SDPA's one call beats these four (18 vs 40 us at 64 keys), so shorter decodes stay on SDPA.

        q [1, Hq, 1, D]   k, v [1, Hkv, T, D]   ->   [1, Hq, 1, D]
    """
    _, hq, _, d = q.shape
    kvh = k.shape[1]
    scores = torch.matmul(q.reshape(kvh, hq // kvh, d), k[0].transpose(1, 2))        # [Hkv, groups, T]
    scores.mul_(d ** -0.5 if scale is None else scale)
    return torch.matmul(torch.softmax(scores, dim=-1), v[0]).reshape(1, hq, 1, d)


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

    def get(self, key: tuple, start: int, n: int, window: int | None,
            device: torch.device | str = "cpu") -> torch.Tensor | None:
        if key in self._masks:
            return self._masks[key]
        mask = segment_mask(start, n, window, device)
        if mask is not None and self._bytes + mask.numel() <= MASK_CACHE_BYTES:
            self._masks[key], self._bytes = mask, self._bytes + mask.numel()
        return mask


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     kvflow_segments: list[Segment] | None = None, kvflow_windows=None, kvflow_cache=None,
                     kvflow_masks: StepMasks | None = None, kvflow_decodes: list = (), **kwargs):
    """With ``kvflow_segments``: ``key``/``value`` are only the step's new K/V (already written to ``kvflow_cache``);
    each segment's keys are gathered from the cache. ``kvflow_masks``: the step's masks, shared by its layers.
    ``kvflow_decodes``: the decodes at the first rows of the step, as DecodeGroups or one PagedDecodes (the segments
    follow them)."""
    if kvflow_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layer = module.layer_idx
    window = kvflow_windows[layer]
    gqa = query.shape[1] != kvflow_cache.kv_heads
    masks = StepMasks() if kvflow_masks is None else kvflow_masks
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])         # [1, T, Hq, D], row by row
    own = key is not None and key.dtype == kvflow_cache.kv.dtype     # the new K/V are what the cache holds

    def put(q0: int, part: torch.Tensor) -> None:                                    # part [1, Hq, rows, D]
        out[:, q0:q0 + part.shape[2]].copy_(part.transpose(1, 2))

    for g in kvflow_decodes:
        if isinstance(g, PagedDecodes):
            q = query[0, :, g.q0:g.q0 + g.count].transpose(0, 1)                          # [count, Hq, D]
            o = paged_decode.attend(q, kvflow_cache.kv[layer], g.tables, g.lengths, kvflow_cache.block_size,
                                    query.shape[-1] ** -0.5 if scaling is None else scaling, window)
            out[0, g.q0:g.q0 + g.count] = o
            continue
        k, v = kvflow_cache.gather_padded(layer, g.index, g.count, g.keys)
        q = query[0, :, g.q0:g.q0 + g.count].transpose(0, 1).unsqueeze(2)                # [count, Hq, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask(window), scale=scaling, enable_gqa=gqa)
        out[0, g.q0:g.q0 + g.count] = o.squeeze(2)
        del k, v
    for i, s in enumerate(kvflow_segments):
        n = s.q1 - s.q0
        if s.start == 0 and own:          # a prompt's first chunk: its keys are the step's own, nothing to gather
            k, v = key[:, :, s.q0:s.q1], value[:, :, s.q0:s.q1]
        else:
            k, v = kvflow_cache.gather(layer, s.blocks, s.start + n, s.first)
        if n == 1 and s.start + 1 >= ONE_QUERY_KEYS:
            seen = 0 if window is None else max(0, s.start + 1 - window)      # a window hides keys older than it
            put(s.q0, one_query(query[:, :, s.q0:s.q1], k[:, :, seen:], v[:, :, seen:], scaling))
        elif splits_at_the_chunk(query, s.start, n, window):
            put(s.q0, prefix_plus_diagonal(query[:, :, s.q0:s.q1], k, v, s.start, scaling))
        else:
            for r0, r1 in row_blocks(s.start, n, window):
                end = s.start + r1                   # keys [0, end) are the ones these rows may see
                mask = masks.get((i, r0, window), s.start + r0, r1 - r0, window, query.device)
                causal = mask is None and r1 - r0 > 1
                put(s.q0 + r0, F.scaled_dot_product_attention(query[:, :, s.q0 + r0:s.q0 + r1], k[:, :, :end],
                                                              v[:, :, :end], attn_mask=mask, is_causal=causal,
                                                              scale=scaling, enable_gqa=gqa))
        del k, v                          # freed before the next segment's gather
    return out, None
