"""BlockManager: fixed-size KV blocks from one preallocated budget, refcounted, with prefix caching.

    sequence tokens  | t0 .. t15 | t16 .. t31 | t32 .. t40 ...      (block_size 16)
    block_table      |    7      |     3      |     12             one block id per 16 positions
    block_hashes     |   h0      |    h1      |   (partial: none)  h_i = xxh3_128(h_{i-1} | tokens of block i)

A full block whose KV is computed gets its chained hash and is registered in ``cached`` (hash -> block id), so a
later sequence whose prompt starts with the same tokens shares it (refcount + 1) instead of computing it. When
its last user frees it a block goes to the back of the free queue *with its hash kept*: it can still be hit until
it is taken for a new allocation from the front (least recently freed first, i.e. LRU).

Invariants (tests/engine/test_block_manager.py): a block with refcount > 0 is never in the free queue; refcount =
number of block tables that hold it; ``cached`` maps only to blocks whose hash is that key. Blocks in ``offline``
(an elastic reserve not lent now, engine/elastic.py) are in no table, not free and not cached.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from kvflow.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None      # set once the block is full and its KV computed


def chain_hash(parent: bytes | None, tokens) -> bytes:
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return xxhash.xxh3_128_digest((parent or b"kvflow-block") + data)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, offline=()):
        assert num_blocks > 0 and block_size > 0
        self.block_size, self.num_blocks, self.enable_caching = block_size, num_blocks, enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.offline: set[int] = set(offline)      # ids that exist but are not usable now (elastic reserve)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(
            i for i in range(num_blocks) if i not in self.offline)                    # front: evicted first
        self.cached: dict[bytes, int] = {}
        self.evictions = 0             # cached blocks taken for new data
        self.version = 0               # + 1 whenever ``cached`` gains or loses a prefix (a cached match may change)

    # ------------------------------------------------------------------------------------------ facts
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences (free blocks that still cache a prefix count as free)."""
        return 1.0 - len(self.free) / (self.num_blocks - len(self.offline))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
        """Block ids and hashes of the longest cached prefix — at most (len - 1) // block_size blocks, so at least
        one token is computed and gives the next-token logits."""
        if not self.enable_caching:
            return [], []
        bs = self.block_size

        def chained():
            parent = None
            for i in range((len(token_ids) - 1) // bs):
                parent = chain_hash(parent, token_ids[i * bs:(i + 1) * bs])
                yield parent
        return self._longest_cached(chained())

    def match(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """``match_prefix(seq.token_ids)`` from the sequence's kept block hashes (``prompt_hashes``): dictionary
        lookups only, so a waiting request's cached prefix can be re-read every step."""
        return self._longest_cached(self.prompt_hashes(seq)) if self.enable_caching else ([], [])

    def _longest_cached(self, hashes) -> tuple[list[int], list[bytes]]:
        """Block ids and hashes of the leading run of ``hashes`` (chained, lazily computed) that is cached."""
        ids, hits = [], []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            ids.append(block)
            hits.append(h)
        return ids, hits

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """Chained hashes of ``seq``'s first (len - 1) // block_size blocks, kept on the sequence and extended as
        its tokens grow (a sequence's tokens are only ever appended)."""
        kept, bs = seq.prefix_hashes, self.block_size
        limit = (seq.num_tokens - 1) // bs
        for i in range(len(kept), limit):
            kept.append(chain_hash(kept[-1] if kept else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return kept if len(kept) == limit else kept[:limit]

    def needed(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks ``allocate(seq)`` takes, given its cached prefix ``hits`` (``match_prefix``)."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)      # hits now in the free queue
        return self.blocks_for(seq.num_tokens) - len(hits) + revived

    def can_allocate(self, seq: Sequence) -> bool:
        return self.needed(seq, self.match(seq)[0]) <= len(self.free)

    def freed_by(self, seqs: list[Sequence], keep=()) -> list[int]:
        """Freeing ``seqs`` in turn: after each, the blocks ``free_seq`` would have put in the free queue so far —
        those held by no table outside the ones freed (a prefix two of them share counts once both are), ``keep``
        aside. One pass over their block tables."""
        keep, held, freed, out = set(keep), Counter(), 0, []
        for s in seqs:
            for b in s.block_table:
                held[b] += 1
                if held[b] == self.blocks[b].ref_count and b not in keep:
                    freed += 1
            out.append(freed)
        return out

    # ------------------------------------------------------------------------------------- mutations
    def allocate(self, seq: Sequence) -> int:
        """Blocks for all of ``seq``'s tokens: the cached prefix shared, the rest new. Returns the hit tokens (the
        caller sets ``seq.num_computed``)."""
        assert not seq.block_table
        hits, hashes = self.match(seq)
        assert self.needed(seq, hits) <= len(self.free), "allocate() without can_allocate()"
        for b in hits:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
        seq.block_table = hits + [self._take() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.block_hashes = hashes
        return len(hits) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return self.blocks_for(seq.num_tokens) <= len(seq.block_table) or len(self.free) > 0

    def append(self, seq: Sequence) -> None:
        """A block for the token just appended, when it starts a new block."""
        while self.blocks_for(seq.num_tokens) > len(seq.block_table):
            seq.block_table.append(self._take())

    def commit(self, seq: Sequence) -> None:
        """Hash and register the blocks that became full and computed."""
        bs, kept = self.block_size, seq.prefix_hashes
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed:
            i = len(seq.block_hashes)
            h = kept[i] if i < len(kept) else chain_hash(seq.block_hashes[-1] if seq.block_hashes else None,
                                                         seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if self.enable_caching and block.hash is None and h not in self.cached:
                block.hash = h
                self.cached[h] = block.block_id
                self.version += 1

    def free_seq(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first (so a shared prefix outlives the tails in the LRU order)."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None
        seq.block_table, seq.block_hashes = [], []

    # ------------------------------------------------- elastic reserve hooks (engine/elastic.py drives them)
    def bring_online(self, ids: list[int]) -> None:
        """Offline blocks become free, at the front of the queue (empty: taken before a cached block is evicted)."""
        for b in reversed(ids):
            self.offline.remove(b)
            self.free[b] = None
            self.free.move_to_end(b, last=False)

    def take_offline(self, ids: list[int]) -> None:
        """Free blocks leave the budget (their cached prefixes are dropped)."""
        for b in ids:
            assert self.blocks[b].ref_count == 0, f"block {b} is held"
        for b in ids:
            del self.free[b]
            self._forget(self.blocks[b])
            self.offline.add(b)

    def take(self, ids: list[int]) -> None:
        """Take these free blocks (refcount 1, hash dropped) for the caller to fill; ``untake`` gives them back."""
        for b in ids:
            assert self.blocks[b].ref_count == 0 and b in self.free
            self._take(b)

    def untake(self, ids: list[int]) -> None:
        for b in ids:
            assert self.blocks[b].ref_count == 1 and self.blocks[b].hash is None
            self.blocks[b].ref_count = 0
            self.free[b] = None
            self.free.move_to_end(b, last=False)

    def relocate(self, moves: dict[int, int], seqs) -> None:
        """Block src's holders and hash now point at dst (taken, its KV already copied); src becomes free."""
        for seq in seqs:
            seq.block_table = [moves.get(b, b) for b in seq.block_table]
        for src, dst in moves.items():
            s, d = self.blocks[src], self.blocks[dst]
            d.ref_count, s.ref_count = s.ref_count, 0
            if s.hash is not None and self.cached.get(s.hash) == src:
                self.cached[s.hash] = dst
            d.hash, s.hash = s.hash, None
            self.free[src] = None

    def _forget(self, block: Block) -> bool:
        """Drop the block's cached prefix; True if it had one."""
        if block.hash is None:
            return False
        if self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
            self.version += 1
        block.hash = None
        return True

    def _take(self, b: int | None = None) -> int:
        if b is None:
            b, _ = self.free.popitem(last=False)
        else:
            del self.free[b]
        block = self.blocks[b]
        self.evictions += self._forget(block)
        block.ref_count = 1
        return b
