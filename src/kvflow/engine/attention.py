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
(smollm2-135m's shape, the 2-vCPU box). A group's gathered K/V is at most GROUP_BYTES (it stays in the
caches between the copy and the pass over it; larger groups measured no faster) and never more keys than the
longest sequence the engine holds, whose one-layer K/V the activation reserve already counts (reserve.py).

On the host every prefill chunk is attended in place too, all of the step's in one call of the native chunk op per
layer (``PagedChunks``, model/chunk_attention.py: flash attention with a KV head's query heads as the rows of one
block): nothing is gathered, no mask is built, and each query gets the bits the full prefill gives it. The segments,
groups and prefix + diagonal below serve the torch path (``$KVFLOW_CHUNK_ATTENTION=torch``, no native library, a head
size the op does not take) and the GPU.

Short chunks that continue their sequences (follow-ups on cached histories: start > 0, under VIEW_MIN_TOKENS keys,
at most GROUP_CHUNK_ELEMENTS queries x keys) are attended together the same way (``SegmentGroup``): one
``index_select`` of their blocks, their queries padded to the widest, one masked SDPA call, one ``index_copy_``
back. One by one, each costs a gather, two flash calls and their merge — ~0.35 ms a layer on smollm2-135m's
shape, whatever its size: four 40-token follow-ups on 300-token histories beside four decodes took 405 ms a step,
350 ms grouped (0.89x, interleaved repeats 0.84-0.95); 4 x 16 tokens on 600: 0.85x; 3 x 100 tokens on 1,000, where
the masked call's cost outweighs the calls saved, stay one by one (1.02x grouped). A group's K/V obey the decode
groups' limits, its padded rows are at most twice its own.

    query  [1, Hq, T_step, D]    segment s: rows    [q0, q1)    positions [start, start + n)
    cache  PagedKVCache          segment s: blocks  ``blocks``  positions [0, start + n)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvflow.engine import paged_decode
from kvflow.engine.paged_cache import VIEW_MIN_TOKENS
from kvflow.model import chunk_attention
from kvflow.model.attention import prefix_plus_diagonal, splits_at_the_chunk

MASK_ELEMENTS = 1 << 20      # queries x keys of one masked SDPA call at most: a long chunk runs in blocks of rows
MASK_CACHE_BYTES = 8 << 20   # masks kept for the step's other layers up to this many bytes (beyond: rebuilt)
ONE_QUERY_KEYS = 768         # a decode over at least this many keys runs as two matmuls (one_query), else SDPA
GROUP_BYTES = 4 << 20        # gathered K/V of one group (of decodes, or of chunks) at most (1-8 MiB measured alike)
GROUP_CHUNK_ELEMENTS = 1 << 15   # a chunk of at most this many queries x keys is attended in a group (SegmentGroup)


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
class SegmentGroup:
    """Chunks that continue their sequences over short contexts (copied out of the blocks anyway), attended in one
    masked SDPA call: chunk i's queries are packed rows ``rows[i * width:(i + 1) * width]`` (its last row repeated
    to ``width``), its keys positions [0, starts[i] + counts[i]) of its blocks, padded (with its own first block) to
    ``keys`` positions and masked. ``real``: the padded rows that are a chunk's own, ``dest``: their packed rows."""
    rows: torch.Tensor         # [count * width]
    real: torch.Tensor         # [sum of counts]
    dest: torch.Tensor         # [sum of counts]
    starts: torch.Tensor       # [count] position of each chunk's first query
    counts: torch.Tensor       # [count] queries of each chunk
    index: torch.Tensor        # rows of a layer's [K blocks; V blocks] (PagedKVCache.gather_padded)
    width: int
    keys: int
    masks: dict = field(default_factory=dict)   # window -> additive mask [count, 1, width, keys], built on first use

    @property
    def count(self) -> int:
        return self.starts.numel()

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            row = torch.arange(self.width, device=self.starts.device).view(1, -1)
            qpos = (self.starts.view(-1, 1) + torch.minimum(row, self.counts.view(-1, 1) - 1)).unsqueeze(-1)
            kpos = torch.arange(self.keys, device=self.starts.device).view(1, 1, -1)
            seen = kpos <= qpos                                      # causal; a chunk's padding keys lie past it
            if window is not None:
                seen &= kpos > qpos - window
            self.masks[window] = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill_(
                ~seen, float("-inf")).unsqueeze(1)
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


@dataclass(slots=True)
class PagedChunks:
    """The step's prefill chunks at packed rows [q0, q1), attended in place by the native chunk op
    (model/chunk_attention.py): chunk i's queries are rows q0 + offsets[i] .. q0 + offsets[i + 1] - 1, at positions
    starts[i] ..., its keys positions [0, starts[i] + its queries) in the blocks of row i of ``tables``."""
    q0: int
    q1: int
    starts: torch.Tensor       # [count] int64
    offsets: torch.Tensor      # [count + 1] int64
    tables: torch.Tensor       # [count, max blocks] int64 (padded with each row's first block)


def paged_chunks(q0: int, starts: list[int], counts: list[int], tables: list[list[int]], block_size: int,
                 device) -> list[PagedChunks]:
    """The chunks at packed rows q0 ... (``counts`` queries each, from ``starts``; block tables ``tables``) as one
    call of the native op per layer (none when there are none)."""
    if not starts:
        return []
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    return [PagedChunks(q0, q0 + offsets[-1], torch.tensor(starts, dtype=torch.long, device=device),
                        torch.tensor(offsets, dtype=torch.long, device=device),
                        padded_tables(tables, [s + n for s, n in zip(starts, counts)], block_size, device))]


def padded_tables(tables: list[list[int]], ends: list[int], block_size: int, device) -> torch.Tensor:
    """[count, widest] int64: each sequence's blocks holding positions [0, end), padded with its own first block (the
    native ops' block tables)."""
    rows = [t[:(e + block_size - 1) // block_size] for t, e in zip(tables, ends)]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


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
    return [PagedDecodes(0, torch.tensor(ends, dtype=torch.long, device=device),
                         padded_tables(tables, ends, block_size, device))]


def padded_rows(tables: list[list[int]], ends: list[int], nblocks: int, block_size: int, num_blocks: int,
                device) -> torch.Tensor:
    """``PagedKVCache.gather_padded``'s index of a group: each sequence's blocks holding [0, end), padded with its
    own first block to ``nblocks``, as rows of a layer's K blocks, then the same rows of its V blocks."""
    cut = [t[:(e + block_size - 1) // block_size] for t, e in zip(tables, ends)]
    rows = torch.tensor([b + [b[0]] * (nblocks - len(b)) for b in cut], dtype=torch.long).view(-1)
    return torch.cat([rows, rows + num_blocks]).to(device)


def groups_of_decodes(ends: list[int], tables: list[list[int]], block_size: int, num_blocks: int, max_keys: int,
                      bytes_per_key: int, device) -> list[DecodeGroup]:
    """Groups of the decodes whose contexts end at ``ends`` (longest first, at packed rows 0, 1, ...; their block
    tables ``tables``): consecutive decodes while the group's padded keys stay within GROUP_BYTES of
    gathered K/V and ``max_keys``; a decode longer than that on its own is a group of one."""
    limit = max(1, min(max_keys, GROUP_BYTES // max(1, bytes_per_key)))
    groups, i = [], 0
    while i < len(ends):
        nblocks = (ends[i] + block_size - 1) // block_size
        j = i + 1
        while j < len(ends) and (j + 1 - i) * nblocks * block_size <= limit:
            j += 1
        index = padded_rows(tables[i:j], ends[i:j], nblocks, block_size, num_blocks, device)
        groups.append(DecodeGroup(i, torch.tensor(ends[i:j], device=device), index, nblocks * block_size))
        i = j
    return groups


def groups_of_segments(segments: list[Segment], tables: list[list[int]], block_size: int, num_blocks: int,
                       max_keys: int, bytes_per_key: int, device) -> tuple[list[SegmentGroup], list[Segment]]:
    """The step's chunks that continue their sequences over fewer than VIEW_MIN_TOKENS keys (their gather is a copy
    either way), in groups of two or more attended in one call each, and the segments left to run one by one. A
    group is consecutive chunks, longest context first, while its padded K/V stay within GROUP_BYTES and
    ``max_keys``, its mask within MASK_ELEMENTS, and its padded rows within twice its chunks' own."""
    def n(s: Segment) -> int:
        return s.q1 - s.q0

    cands = sorted((i for i, s in enumerate(segments)
                    if s.start > 0 and n(s) > 1 and s.start + n(s) < VIEW_MIN_TOKENS
                    and n(s) * (s.start + n(s)) <= GROUP_CHUNK_ELEMENTS),
                   key=lambda i: -(segments[i].start + n(segments[i])))
    if len(cands) < 2:
        return [], segments
    limit = max(1, min(max_keys, GROUP_BYTES // max(1, bytes_per_key)))
    groups, grouped, i = [], set(), 0
    while i < len(cands):
        first = segments[cands[i]]
        nblocks = (first.start + n(first) + block_size - 1) // block_size
        keys, width, real, j = nblocks * block_size, n(first), n(first), i + 1
        while j < len(cands):
            c, w, r = j + 1 - i, max(width, n(segments[cands[j]])), real + n(segments[cands[j]])
            if c * keys > limit or c * w * keys > MASK_ELEMENTS or c * w > 2 * r:
                break
            width, real, j = w, r, j + 1
        if j - i >= 2:
            members = [segments[k] for k in cands[i:j]]
            rows, real_rows = [], []
            for c, s in enumerate(members):
                rows += list(range(s.q0, s.q1)) + [s.q1 - 1] * (width - n(s))
                real_rows += range(c * width, c * width + n(s))
            index = padded_rows([tables[k] for k in cands[i:j]], [s.start + n(s) for s in members], nblocks,
                                block_size, num_blocks, device)
            rows_t, real_t = torch.tensor(rows, dtype=torch.long), torch.tensor(real_rows, dtype=torch.long)
            groups.append(SegmentGroup(rows_t.to(device), real_t.to(device), rows_t[real_t].to(device),
                                       torch.tensor([s.start for s in members], device=device),
                                       torch.tensor([n(s) for s in members], device=device),
                                       index, width, keys))
            grouped.update(cands[i:j])
        i = j
    return groups, [s for k, s in enumerate(segments) if k not in grouped]


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
                     kvflow_masks: StepMasks | None = None, kvflow_decodes: list = (),
                     kvflow_groups: list[SegmentGroup] = (), kvflow_chunks: list[PagedChunks] = (), **kwargs):
    """With ``kvflow_segments``: ``key``/``value`` are only the step's new K/V (already written to ``kvflow_cache``);
    each segment's keys are gathered from the cache. ``kvflow_masks``: the step's masks, shared by its layers.
    ``kvflow_decodes``: the decodes at the first rows of the step, as DecodeGroups or one PagedDecodes (the segments
    follow them). ``kvflow_groups``: chunks attended together (SegmentGroup), at rows no segment has.
    ``kvflow_chunks``: chunks attended in place by the native op (PagedChunks), at rows no segment has."""
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
    for c in kvflow_chunks:
        out[0, c.q0:c.q1] = chunk_attention.paged(query[0, :, c.q0:c.q1].transpose(0, 1), kvflow_cache.kv[layer],
                                                  c.tables, c.starts, c.offsets, kvflow_cache.block_size,
                                                  query.shape[-1] ** -0.5 if scaling is None else scaling, window)
    for g in kvflow_groups:
        k, v = kvflow_cache.gather_padded(layer, g.index, g.count, g.keys)
        hq, d = query.shape[1], query.shape[3]
        q = query[0].transpose(0, 1).index_select(0, g.rows).view(g.count, g.width, hq, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask(window), scale=scaling, enable_gqa=gqa)
        out[0].index_copy_(0, g.dest, o.transpose(1, 2).reshape(-1, hq, d).index_select(0, g.real))
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
