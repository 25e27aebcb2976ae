"""PagedKVCache: the engine's whole KV budget, preallocated once, addressed by block tables.

    kv : [num_layers, 2, num_blocks * block_size, kv_heads, head_dim]     (2: 0 = K, 1 = V)
                         ^-- slot = block_id * block_size + position % block_size

A sequence's position p lives in slot ``block_table[p // block_size] * block_size + p % block_size``. Gathering a
sequence's K/V of one layer is a view of the cache when its blocks are consecutive ids (the usual case: the free
queue hands them out in order), else one ``index_select`` over its blocks; writing a step's new K/V is one
``index_copy_`` over slots.
Out of this module K/V leave in the transformers layout [1, kv_heads, T, head_dim] (canonical, model/runner.py).
"""

from __future__ import annotations

import torch

# A gather reads in place from this many positions up. Below it the copy is cheap and SDPA runs faster on compact
# K/V: views at 512-1,024-token contexts made a 32-sequence decode step of smollm2-135m slower (466 vs 399 ms,
# docs/ENGINE.md); at 32K a copy was ~3/4 of a tiny decode step.
VIEW_MIN_TOKENS = 2048


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, storage: torch.Tensor | None = None,
                 device: torch.device | str = "cpu"):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        assert storage is None or (tuple(storage.shape) == shape and storage.dtype == dtype)
        # storage: an elastic mmap (host) or a probe's own tensor; else the budget on the model's device
        self.kv = storage if storage is not None else torch.zeros(shape, dtype=dtype, device=device)
        self.device = self.kv.device

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot index of every position in [start, end)."""
        pos = torch.arange(start, end, device=self.device)
        table = torch.as_tensor(block_table, dtype=torch.long, device=self.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """K/V of blocks ``src`` into blocks ``dst`` (every layer; the elastic take-back's move)."""
        bs, offset = self.block_size, torch.arange(self.block_size, device=self.device)
        s = (torch.as_tensor(src, dtype=torch.long, device=self.device).view(-1, 1) * bs + offset).view(-1)
        d = (torch.as_tensor(dst, dtype=torch.long, device=self.device).view(-1, 1) * bs + offset).view(-1)
        self.kv[:, :, d] = self.kv[:, :, s]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, H, T, D] into ``slots`` (T of them)."""
        self.kv[layer, 0].index_copy_(0, slots, k[0].transpose(0, 1))
        self.kv[layer, 1].index_copy_(0, slots, v[0].transpose(0, 1))

    def blocks(self, block_table: list[int], end: int) -> torch.Tensor:
        """Block ids holding positions [0, end)."""
        return torch.as_tensor(block_table[:(end + self.block_size - 1) // self.block_size], dtype=torch.long,
                               device=self.device)

    def run_start(self, block_table: list[int], end: int) -> int | None:
        """The first block id when the blocks holding positions [0, end) are consecutive ids and ``end`` is at least
        VIEW_MIN_TOKENS (then ``gather`` returns views of the cache, no copy), else None. Once per step per
        sequence: a list compare in C, ~20 us at 2K blocks. The free queue hands out ids in order, so a sequence's
        blocks are one run unless the prefix cache or a preemption interleaved them."""
        n = (end + self.block_size - 1) // self.block_size
        if end < VIEW_MIN_TOKENS:
            return None
        first = block_table[0]
        return first if block_table[:n] == list(range(first, first + n)) else None

    def gather(self, layer: int, blocks: torch.Tensor, end: int,
               first: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [0, end) held in ``blocks`` (in order) as [1, H, end, D]; with ``first`` (``run_start``:
        the blocks are ids first, first + 1, ...) views of the cache itself — nothing copied, and read-only to the
        caller like the copies (attention only reads them).

        A decode over a 32K context of ``tiny`` spent ~3/4 of its step copying K/V out (16 MiB a layer) before one
        pass over them; the views leave that one pass (measured: 12-40 ms against 48-175 ms a step, 4 layers).

        Whole blocks are copied, K's and V's in one ``index_select`` over rows of block_size x H x D elements: a
        decode step's 8 x 3K-token gathers of ``tiny`` take 2.5 ms this way against 6.7 ms slot by slot (rows of
        H x D). One call, not one per K and V: with a neighbour on the cores every 2-thread kernel waits for the
        slower thread, so fewer calls is what keeps a gather cheap on a busy machine."""
        nb, h, d = self.num_blocks, self.kv_heads, self.head_dim
        rows = self.kv[layer].view(2 * nb, -1)                           # [K blocks; V blocks]
        if first is not None:
            n = len(blocks)
            k = rows[first:first + n].view(-1, h, d)[:end]
            v = rows[nb + first:nb + first + n].view(-1, h, d)[:end]
            return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        both = rows.index_select(0, torch.cat([blocks, blocks + nb])).view(2, -1, h, d)[:, :end]
        return both[0].transpose(0, 1).unsqueeze(0), both[1].transpose(0, 1).unsqueeze(0)

    def gather_padded(self, layer: int, index: torch.Tensor, count: int,
                      keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``count`` sequences as [count, H, keys, D] (copies): ``index`` lists, for K then again for V, each
        sequence's ``keys // block_size`` block rows of the layer's [K blocks; V blocks] (attention.DecodeGroup)."""
        h, d = self.kv_heads, self.head_dim
        both = self.kv[layer].view(2 * self.num_blocks, -1).index_select(0, index).view(2, count, keys, h, d)
        return both[0].transpose(1, 2), both[1].transpose(1, 2)

    def write_sequence(self, block_table: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                       end: int) -> None:
        """Copy positions [start, end) of per-layer (k, v) [1, H, >=end, D] (e.g. a restoration's) into blocks."""
        slots = self.slots(block_table, start, end)
        for layer, (k, v) in enumerate(kv):
            self.write(layer, slots, k[:, :, start:end], v[:, :, start:end])

    def read_sequence(self, block_table: list[int], end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (k, v) [1, H, end, D] of positions [0, end) (copies)."""
        blocks = self.blocks(block_table, end)
        return [self.gather(layer, blocks, end) for layer in range(self.num_layers)]

    def read_block(self, block_table: list[int], tokens: tuple[int, int], layers: tuple[int, int]) -> torch.Tensor:
        """Canonical KV block [n_layers, 2, H, T, D] of positions ``tokens`` and ``layers`` (a pool record)."""
        slots = self.slots(block_table, *tokens)
        return torch.stack([self.kv[l, :, slots].transpose(1, 2) for l in range(*layers)]).contiguous()
