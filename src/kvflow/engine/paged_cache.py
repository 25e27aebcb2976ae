"""PagedKVCache: the engine's whole KV budget, preallocated once, addressed by block tables.

    kv : [num_layers, 2, num_blocks * block_size, kv_heads, head_dim]     (2: 0 = K, 1 = V)
                         ^-- slot = block_id * block_size + position % block_size

A sequence's position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``. Gathering a
sequence's K/V of one layer is one ``index_select`` over slots; writing a step's new K/V is one ``index_copy_``.
Out of this module K/V leave in the transformers layout [1, kv_heads, T, head_dim] (canonical, model/runner.py).
"""

from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, storage: torch.Tensor | None = None):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        assert storage is None or (tuple(storage.shape) == shape and storage.dtype == dtype)
        self.kv = storage if storage is not None else torch.zeros(shape, dtype=dtype)   # storage: an elastic mmap

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return num_layers * 2 * block_size * kv_heads * head_dim * itemsize

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of every position in [start, end)."""
        pos = torch.arange(start, end)
        table = torch.as_tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """K/V of blocks ``src`` into blocks ``dst`` (every layer; the elastic take-back's move)."""
        bs, offset = self.block_size, torch.arange(self.block_size)
        s = (torch.as_tensor(src, dtype=torch.long).view(-1, 1) * bs + offset).view(-1)
        d = (torch.as_tensor(dst, dtype=torch.long).view(-1, 1) * bs + offset).view(-1)
        self.kv[:, :, d] = self.kv[:, :, s]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, H, T, D] into ``slots`` (T of them)."""
        self.kv[layer, 0].index_copy_(0, slots, k[0].transpose(0, 1))
        self.kv[layer, 1].index_copy_(0, slots, v[0].transpose(0, 1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots`` as [1, H, len(slots), D]."""
        # one index_select over the slot dim of [2, slots, H, D]: K and V in one copy. As fast as two over dim 0 of
        # [slots, H, D] on an idle machine, but with a neighbour on the cores those took ~0.5 ms each at 600 slots
        # (their 2-thread kernel waits for the slower thread) against ~20 us for this one.
        kv = self.kv[layer].index_select(1, slots)
        return kv[0].transpose(0, 1).unsqueeze(0), kv[1].transpose(0, 1).unsqueeze(0)

    def write_sequence(self, block_table: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                       end: int) -> None:
        """Copy positions [start, end) of per-layer (k, v) [1, H, >=end, D] (e.g. a restoration's) into blocks."""
        slots = self.slots(block_table, start, end)
        for layer, (k, v) in enumerate(kv):
            self.write(layer, slots, k[:, :, start:end], v[:, :, start:end])

    def read_sequence(self, block_table: list[int], end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) [1, H, end, D] of positions [0, end) (copies)."""
        slots = self.slots(block_table, 0, end)
        return [self.gather(layer, slots) for layer in range(self.num_layers)]

    def read_block(self, block_table: list[int], tokens: tuple[int, int], layers: tuple[int, int]) -> torch.Tensor:
        """Canonical KV block [n_layers, 2, H, T, D] of positions ``tokens`` and ``layers`` (a pool record)."""
        slots = self.slots(block_table, *tokens)
        return torch.stack([self.kv[l, :, slots].transpose(1, 2) for l in range(*layers)]).contiguous()
