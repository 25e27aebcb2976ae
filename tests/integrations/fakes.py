"""Stand-ins for the vLLM pieces the connector touches: the CPU backend's write op (both block layouts), requests,
a pool that loses records. No vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.pool import KVPool


def write_op(k_transposed: bool):
    """cpu_attn_reshape_and_cache as the CPU backend behaves: token t goes to block slot // bs, offset slot % bs;
    on the ``vec`` path each head's K region of a block is stored [D, bs]."""
    def write(key, value, key_cache, value_cache, slots):
        bs = key_cache.shape[2]
        for t, slot in enumerate(slots.tolist()):
            b, o = divmod(slot, bs)
            for h in range(key_cache.shape[1]):
                if k_transposed:
                    key_cache[b, h].view(-1).view(key_cache.shape[3], bs)[:, o] = key[t, h]
                else:
                    key_cache[b, h, o] = key[t, h]
                value_cache[b, h, o] = value[t, h]
    return write


def kv_layer(num_blocks: int, heads: int, block_size: int, head_dim: int, fill: float = float("nan")) -> torch.Tensor:
    """One layer's CPU cache tensor [num_blocks, H, bs, 2*D]."""
    return torch.full((num_blocks, heads, block_size, 2 * head_dim), fill)


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]


def memory_pool(chunk_tokens: int) -> KVPool:
    return KVPool.open({"devices": [{"type": "memory", "capacity": "64M", "bandwidth": "1G"}],
                        "chunk_tokens": chunk_tokens, "durability": "relaxed"})


class LosingPool:
    """A pool whose chosen records read as misses — what a corrupt record is to every caller (the pool's own
    tests show a bad checksum becomes None)."""

    def __init__(self, pool: KVPool, lost: set):
        self.pool, self.lost = pool, lost
        self.chunk_tokens = pool.chunk_tokens

    def get_many(self, keys):
        got = self.pool.get_many(keys)
        return {k: None if k.digest in self.lost else v for k, v in got.items()}

    def __getattr__(self, name):
        return getattr(self.pool, name)
