"""vLLM's paged KV blocks <-> kvflow's canonical records. Plain torch: nothing here imports vLLM.

One layer's KV cache on vLLM's CPU backend is one tensor, split the way the backend splits it::

    kv_layer   [num_blocks, H, bs, 2*D]   -> view [num_blocks, H, 2*bs, D] -> chunk(2, dim=2) -> K, V
    K, V       [num_blocks, H, bs, D]     (views; each head's K region holds bs*D elements, V's too)
    slot       position p of a request lives in slot block_ids[p // bs] * bs + p % bs

Inside a block each head's region is laid out as the attention kernel reads it, which depends on the ISA: on the
AVX2 ``vec`` path K is stored transposed ``[D, bs]`` while V is ``[bs, D]``. Rather than hard-code each ISA, the
layout is *probed* once per ISA: the backend's own write op (``cpu_attn_reshape_and_cache``) writes a scratch block
whose values spell out, digit by digit, the (head, position, dim) they came from; what lands where is the
permutation that reads a block back as ``[H, bs, D]``. Writes always go through the op itself.

kvflow's canonical record of one chunk and one layer (what ``kvflow serve`` stores)::

    record     [1, 2, H, C, D]            (layers, K/V, kv heads, chunk tokens, head dim)

A pool chunk of C tokens is C / bs whole blocks: C must be a multiple of vLLM's block size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvflow.errors import ConfigError

# write_op(key [T, H, D], value [T, H, D], key_cache, value_cache, slot_mapping [T] int64): the backend's write
WriteOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_BASE = 16    # probe digits: every value below 16 is exact in any float dtype a KV cache uses


def check_alignment(chunk_tokens: int, block_size: int) -> None:
    """A pool chunk must be whole vLLM blocks, so a chunk's positions are exactly its blocks' slots."""
    if chunk_tokens % block_size:
        raise ConfigError(f"pool.chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block size "
                          f"({block_size}): set --block-size to a divisor of it, or chunk_tokens to a multiple")


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot of every position in [start, end) of a request whose blocks are ``block_ids``."""
    pos = torch.arange(start, end)
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def split(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's own split of one layer's cache into K and V views [num_blocks, H, bs, D]."""
    nb, heads, bs, two_d = kv_layer.shape
    return kv_layer.view(nb, heads, 2 * bs, two_d // 2).chunk(2, dim=2)


def _digits(n: int) -> int:
    return max(1, math.ceil(math.log(max(n, 2), _BASE)))


def probe(write_op: WriteOp, heads: int, block_size: int, head_dim: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``write_op`` puts each (head, position, dim) of one block, for K and for V: index tensors
    ``gather_k`` such that ``K_block.reshape(-1)[gather_k]`` is the block as [H, bs, D] (flattened)."""
    n = heads * block_size * head_dim
    source = torch.arange(n).view(heads, block_size, head_dim).transpose(0, 1)     # [bs, H, D]: token-major input
    found = [torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]
    slots = torch.arange(block_size, dtype=torch.long)
    for digit in range(_digits(n)):
        value = (source // _BASE ** digit % _BASE).to(dtype).contiguous()
        scratch = torch.full((1, heads, block_size, 2 * head_dim), -1.0, dtype=dtype)
        k_cache, v_cache = split(scratch)
        write_op(value, value.clone(), k_cache, v_cache, slots)
        for side, cache in enumerate((k_cache, v_cache)):
            got = cache[0].reshape(-1).float()
            if (got < 0).any() or (got != got.round()).any():
                raise ConfigError("the KV write op left part of a block unwritten: unknown cache layout")
            found[side] += got.long() * _BASE ** digit
    out = []
    for where in found:          # where[f] = the source index stored at flat position f
        if not torch.equal(torch.sort(where).values, torch.arange(n)):
            raise ConfigError("the KV write op does not store a block as a permutation of its input: "
                              "unknown cache layout")
        gather = torch.empty(n, dtype=torch.long)
        gather[where] = torch.arange(n)
        out.append(gather)
    return out[0], out[1]


@dataclass
class PagedLayout:
    """Reads and writes one layer's paged cache as canonical [H, T, D] K/V (see the module docstring)."""
    block_size: int
    heads: int
    head_dim: int
    gather_k: torch.Tensor
    gather_v: torch.Tensor
    write_op: WriteOp

    @classmethod
    def probed(cls, write_op: WriteOp, heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PagedLayout:
        gk, gv = probe(write_op, heads, block_size, head_dim, dtype)
        return cls(block_size, heads, head_dim, gk, gv, write_op)

    @classmethod
    def fixed(cls, write_op: WriteOp, heads: int, block_size: int, head_dim: int, *, k_transposed: bool) -> PagedLayout:
        """A layout stated instead of probed: V [bs, D], K [bs, D] or transposed [D, bs] in each head's region."""
        plain = torch.arange(heads * block_size * head_dim)
        if not k_transposed:
            return cls(block_size, heads, head_dim, plain, plain, write_op)
        h, pos, d = torch.meshgrid(torch.arange(heads), torch.arange(block_size), torch.arange(head_dim), indexing="ij")
        return cls(block_size, heads, head_dim, (h * block_size * head_dim + d * block_size + pos).reshape(-1),
                   plain, write_op)

    @property
    def k_transposed(self) -> bool:
        """K stored [D, bs] inside each head's region (the CPU ``vec`` path)."""
        bs, d = self.block_size, self.head_dim
        return d > 1 and bs > 1 and int(self.gather_k[1]) == bs     # source (pos 0, dim 1) sits one row of bs later

    def read(self, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [H, len(block_ids) * bs, D] of whole blocks, in order (copies)."""
        n, h, bs, d = len(block_ids), self.heads, self.block_size, self.head_dim
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        out = []
        for cache, gather in zip(split(kv_layer), (self.gather_k, self.gather_v)):
            flat = cache[ids].reshape(n, h * bs * d)[:, gather]
            out.append(flat.view(n, h, bs, d).transpose(0, 1).reshape(h, n * bs, d))
        return out[0], out[1]

    def write(self, kv_layer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, H, D] into ``slots`` through the backend's own op."""
        k_cache, v_cache = split(kv_layer)
        self.write_op(k.to(kv_layer.dtype).contiguous(), v.to(kv_layer.dtype).contiguous(), k_cache, v_cache,
                      slots.to(torch.long))


def to_record(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Canonical record [1, 2, H, C, D] of one chunk of one layer from K, V [H, C, D]."""
    return torch.stack([k, v]).unsqueeze(0)


def from_record(record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [C, H, D] (token-major, as the write op takes them) of a canonical record."""
    assert record.dim() == 5 and record.shape[:2] == (1, 2), tuple(record.shape)
    return record[0, 0].transpose(0, 1), record[0, 1].transpose(0, 1)
