"""BatchRunner: one engine step — every scheduled sequence's new tokens (prefill chunks and decodes) in ONE forward
pass of the model's own decoder layers over the paged KV.

The step's tokens are packed into one row [1, T_step, hidden] (no padding). Each layer's cache ``update`` writes the
new K/V into their slots; attention (attention.py) then runs per sequence, on its rows of the queries and on its
own keys gathered from the cache one sequence at a time, so token q of sequence s attends exactly to positions
<= q of s, as in its own full prefill:

    packed queries   | A: a .. a+n_a-1 | B: b | C: 0 .. n_c-1 |
    keys (per seq.)  | A: 0 .. a+n_a-1 | B: 0 .. b | C: 0 .. n_c-1 |
                       A's rows see A's keys only (causal), B's row B's keys, ...

Linear layers (most of the FLOPs and all weight reads) run once for the whole step; that is where batched decode
gains. Decodes go first in the row, longest first, and are attended together: in place by the native op on the
host (attention.PagedDecodes), else the short ones in groups over copies (attention.DecodeGroup); the logits come
back in the items' order all the same (every row's result is its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.engine import paged_decode
from kvflow.engine.attention import (Segment, StepMasks, groups_of_decodes, groups_of_segments, in_a_group,
                                     packed_attention, paged_chunks, paged_decodes)
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.model import chunk_attention
from kvflow.model.runner import ModelRunner


@dataclass(slots=True)
class StepItem:
    """Compute positions [start, start + len(token_ids)) of one sequence; logits of the last one if ``sample``."""
    block_table: list[int]
    start: int
    token_ids: list[int]
    sample: bool


class _StepSlot:
    """Duck-typed transformers ``Cache`` for one step: ``update`` writes the step's new K/V into their slots (packed
    attention gathers each sequence's keys from the cache itself)."""

    def __init__(self, cache: PagedKVCache, write: torch.Tensor):
        self.cache, self.write_slots = cache, write

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.cache.write(layer_idx, self.write_slots, key_states, value_states)
        return key_states, value_states


class BatchRunner:
    """``max_group_keys``: the most keys one group of decodes may gather (padded), i.e. the longest sequence whose
    one-layer K/V the engine's activation reserve counts; default the whole cache."""

    def __init__(self, runner: ModelRunner, cache: PagedKVCache, max_group_keys: int | None = None):
        self.runner, self.cache = runner, cache
        self.max_group_keys = max_group_keys or cache.num_blocks * cache.block_size
        model = runner.hf_model
        self._base = model.model
        self._cache_kw = runner._cache_kw
        self._windows = [runner._sliding_window(i) for i in range(runner.num_layers)]
        # every decode read in place by the native op on the host (paged_decode.py), else short ones copied in groups
        self.native = cache.device.type == "cpu" and cache.kv.dtype == torch.float32 and paged_decode.available()
        # every chunk read in place by the native chunk op, else a segment of its own
        self.native_chunks = cache.device.type == "cpu" and cache.kv.dtype == torch.float32 and \
            cache.head_dim % 16 == 0 and chunk_attention.available()

    def execute(self, items: list[StepItem]) -> torch.Tensor:
        """Run the step; returns fp32 logits [n_sample, vocab] of the items with ``sample``, in order (on the host)."""
        assert items
        cache = self.cache
        short = sorted((i for i, it in enumerate(items)
                        if in_a_group(len(it.token_ids), it.start + len(it.token_ids), self.native)),
                       key=lambda i: -items[i].start)           # attended in groups: the first rows, longest first
        grouped = set(short)
        inplace = [i for i in range(len(items)) if i not in grouped and self.native_chunks]   # after the decodes
        ids, qpos, write, segments, seg_tables, row = [], [], [], [], [], {}
        q0 = 0
        for i in short + inplace + [i for i in range(len(items)) if i not in grouped and i not in inplace]:
            it = items[i]
            n, end = len(it.token_ids), it.start + len(it.token_ids)
            ids.extend(it.token_ids)
            qpos.append(torch.arange(it.start, end, device=cache.device))
            write.append(cache.slots(it.block_table, it.start, end))
            if i not in grouped and i not in inplace:
                segments.append(Segment(q0, q0 + n, it.start, cache.blocks(it.block_table, end),
                                        cache.run_start(it.block_table, end)))
                seg_tables.append(it.block_table)
            q0 += n
            row[i] = q0 - 1
        last = [row[i] for i, it in enumerate(items) if it.sample]         # the items' order
        ends, tables = [items[i].start + 1 for i in short], [items[i].block_table for i in short]
        per_key = 2 * cache.kv_heads * cache.head_dim * cache.kv.element_size()
        decodes = paged_decodes(ends, tables, cache.block_size, cache.device) if self.native else \
            groups_of_decodes(ends, tables, cache.block_size, cache.num_blocks, self.max_group_keys, per_key,
                              cache.device)
        inplace_chunks = paged_chunks(len(short), [items[i].start for i in inplace],
                                      [len(items[i].token_ids) for i in inplace],
                                      [items[i].block_table for i in inplace], cache.block_size, cache.device)
        chunks, segments = groups_of_segments(segments, seg_tables, cache.block_size, cache.num_blocks,
                                              self.max_group_keys, per_key, cache.device)
        slot, masks = _StepSlot(cache, torch.cat(write)), StepMasks()
        with torch.inference_mode():
            hidden = self._base.embed_tokens(torch.tensor(ids, dtype=torch.long, device=cache.device).view(1, -1))
            position_ids = torch.cat(qpos).view(1, -1)
            position_embeddings = self._base.rotary_emb(hidden, position_ids)
            for module in self.runner.layers:
                hidden = module(hidden, attention_mask=None, position_ids=position_ids,
                                position_embeddings=position_embeddings, use_cache=True,
                                kvflow_attend=packed_attention, kvflow_segments=segments,
                                kvflow_windows=self._windows, kvflow_cache=cache, kvflow_masks=masks,
                                kvflow_decodes=decodes, kvflow_groups=chunks, kvflow_chunks=inplace_chunks,
                                **{self._cache_kw: slot})
                if isinstance(hidden, tuple):
                    hidden = hidden[0]
            if not last:
                return torch.empty(0, self.runner.config.vocab_size)
            rows = hidden[0, last].unsqueeze(1)                                     # [k, 1, hidden]
            return self.runner.hf_model.lm_head(self._base.norm(rows)).view(len(last), -1).float().cpu()
