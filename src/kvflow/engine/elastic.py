"""ElasticReserve: the prefill activation reserve lent to the block manager as extra KV blocks while only decodes
run, and taken back — transactionally, loudly when it cannot be — before a step that computes a prefill.

    block ids        | 0 ............. base-1 | base ......... base+lent-1 |
                     |  base blocks (always)  | lent blocks (the reserve)  |   online only while lent

    PagedKVCache.kv  one anonymous mmap  [L, 2, (base + lent) * block_size, H, D]
      plane (l, K|V) | base slots ........... | lent slots ............... |   madvise(MADV_DONTNEED) on take-back

Policy, before every ``schedule()``: a prefill is pending when a sequence waits for admission, a running one has
more than one token left to compute, or a pool restoration is in flight. Pending and lent: take back. Nothing
pending and not lent: lend (the empty lent blocks go to the front of the free queue). So a step runs with the
reserve lent only when it computes one token per sequence — a decode-only step — and a prefill always waits for
the take-back, which itself waits for nothing (it runs on the engine thread between two steps).

Take-back, in phases (a failure in one leaves the block manager as the phases before left it):
  1. preempt: while the lent blocks held by sequences outnumber the free base blocks, the newest running sequence
     holding one is preempted the engine's usual way (its full chunks to the pool, recomputed or restored later);
  2. copy:    free base blocks are taken and the held lent blocks' K/V copied into them; if the copy raises, the
     taken blocks go back to the free queue (only the cached prefixes they held are lost) and nothing moved;
  3. commit:  block tables, refcounts and hashes move to the copies, the lent ids go offline (bookkeeping only);
  4. release: the lent pages are dropped, so resident memory falls; if madvise fails the prefill is not admitted.
A take-back that cannot complete fails the admission of the sequences waiting for it (finish_reason "abort", the
reason logged and kept in ``stats.last_error``) — never an out-of-memory, never a silent retry loop.

The lent size is the reserve a step of ``max_num_batched_tokens`` needs beyond a decode-only step of
``max_num_seqs`` tokens. CPU only: the CUDA path (virtual-memory map/unmap of the lent range) is not written; it
must be tested on a GPU when it is.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.engine.reserve import measure_activation_reserve
from kvflow.errors import KVFlowError

log = logging.getLogger("kvflow.engine")
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


class TakeBackError(KVFlowError):
    """The reserve could not be taken back: the prefills waiting for it are not admitted."""


def lendable_blocks(runner, config, bytes_per_block: int, longest: int | None = None) -> int:
    """KV blocks the reserve lends: a full step's reserve minus a decode-only step's, both with sequences up to
    ``longest`` positions (``engine.elastic_blocks`` overrides)."""
    if config.elastic_blocks:
        return config.elastic_blocks
    full, seqs = config.max_num_batched_tokens, config.max_num_seqs
    step, decode = (measure_activation_reserve(runner, tokens, max_model_len=longest, max_num_seqs=seqs)
                    for tokens in (full, min(seqs, full)))
    return max(step - decode, 0) // bytes_per_block


def resident_bytes(addr: int, length: int) -> int:
    """Bytes of [addr, addr + length) (page-aligned) in RAM now (mincore)."""
    if length <= 0:
        return 0
    vec = (ctypes.c_ubyte * (-(-length // PAGE)))()
    if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE


class KVRegion:
    """The engine's whole KV tensor in one anonymous mmap. ``ranges``: the page-aligned interior of the lent slots of
    every (layer, K|V) plane — what ``release`` drops (pages holding base slots are never touched)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, base_blocks: int, block_size: int):
        planes, slots, row = shape[0] * shape[1], shape[2], shape[3] * shape[4] * dtype.itemsize
        plane = slots * row
        # private: MADV_DONTNEED on a shared (shmem) mapping would only unmap, the pages would stay in RAM
        self.mm = mmap.mmap(-1, planes * plane, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.kv = torch.frombuffer(self.mm, dtype=dtype).view(shape)
        self.addr = self.kv.data_ptr()
        self.base_bytes = planes * base_blocks * block_size * row
        self.ranges = []
        for p in range(planes):
            start = -(-(p * plane + base_blocks * block_size * row) // PAGE) * PAGE
            end = (p + 1) * plane // PAGE * PAGE
            if end > start:
                self.ranges.append((start, end - start))

    def release(self) -> None:
        for offset, length in self.ranges:
            self.mm.madvise(mmap.MADV_DONTNEED, offset, length)

    def resident_lent(self) -> int:
        return sum(resident_bytes(self.addr + o, n) for o, n in self.ranges)

    def resident_total(self) -> int:
        return resident_bytes(self.addr, len(self.mm))


@dataclass(slots=True)
class ElasticStats:
    lent_blocks: int                 # size of the reserve in KV blocks
    lends: int = 0
    takebacks: int = 0
    blocks_moved: int = 0            # lent blocks copied to base blocks by take-backs
    preempted: int = 0               # sequences preempted by take-backs
    failures: int = 0                # take-backs that could not complete (their prefills were not admitted)
    failed_admissions: int = 0
    last_error: str = ""
    takeback_s: deque = field(default_factory=lambda: deque(maxlen=4096))   # latency of each take-back

    def takeback_percentile(self, q: float) -> float:
        return float(np.percentile(list(self.takeback_s), q)) if self.takeback_s else 0.0


class ElasticReserve:
    def __init__(self, base_blocks: int, lent_blocks: int, region: KVRegion):
        self.base, self.region = base_blocks, region
        self.lent_ids = list(range(base_blocks, base_blocks + lent_blocks))
        self.lent = False            # the lent ids are online in the block manager
        self.released = True         # the lent pages were dropped since they were last lent
        self.stats = ElasticStats(lent_blocks)
        self.engine = None

    @classmethod
    def create(cls, runner, config, base_blocks: int, bytes_per_block: int, longest: int | None = None) -> ElasticReserve:
        lent = lendable_blocks(runner, config, bytes_per_block, longest)
        if lent == 0:
            log.warning("engine.elastic_reserve: a step of %d tokens needs less than one KV block more than a "
                        "decode-only step of %d sequences (sequences up to %s tokens); nothing to lend — a larger "
                        "engine.max_num_batched_tokens would have some", config.max_num_batched_tokens,
                        min(config.max_num_seqs, config.max_num_batched_tokens), longest)
        shape = (runner.num_layers, 2, (base_blocks + lent) * config.block_size, runner.kv_heads, runner.head_dim)
        return cls(base_blocks, lent, KVRegion(shape, runner.dtype, base_blocks, config.block_size))

    def attach(self, engine) -> None:
        self.engine = engine

    # ---------------------------------------------------------------------------------------- policy
    def prefill_pending(self) -> bool:
        e = self.engine
        sched = e.scheduler
        return bool(sched.waiting or e._jobs or any(s.remaining > 1 or s.restoring for s in sched.running))

    def before_schedule(self) -> list:
        """Lend or take back for the step about to be scheduled; the sequences whose admission failed (aborted)."""
        if not self.lent_ids:
            return []
        if self.prefill_pending():
            if self.lent or not self.released:
                try:
                    self.take_back()
                except TakeBackError as err:
                    return self._fail(err)
        elif not self.lent:
            self.lend()
        return []

    def check(self, plan) -> None:
        """The invariant: a step scheduled while the reserve is lent computes one token per sequence."""
        assert not self.lent or all(s.num_tokens <= 1 and not s.seq.pool_restore for s in plan.scheduled), \
            "a prefill was scheduled while the activation reserve was lent"

    # ------------------------------------------------------------------------------------- mechanism
    def lend(self) -> None:
        self.engine.blocks.bring_online(self.lent_ids)
        self.lent, self.released = True, False
        self.stats.lends += 1

    def take_back(self) -> None:
        t0 = time.perf_counter()
        was_lent = self.lent
        if self.lent:
            self._withdraw()
        try:
            self.region.release()
        except OSError as err:
            raise TakeBackError(f"elastic reserve: dropping the lent pages failed ({err}); a prefill now would "
                                f"exceed the memory budget") from err
        self.released = True
        if was_lent:
            self.stats.takebacks += 1
            self.stats.takeback_s.append(time.perf_counter() - t0)

    def _withdraw(self) -> None:
        e = self.engine
        bm, sched, base = e.blocks, e.scheduler, self.base

        def held() -> list[int]:
            return sorted({b for s in sched.running for b in s.block_table if b >= base})

        def free_base() -> list[int]:
            return [b for b in bm.free if b < base]            # LRU order: least recently freed first

        while len(held()) > len(free_base()):                  # 1. preempt
            victim = next((s for s in reversed(sched.running) if not s.restoring
                           and any(b >= base for b in s.block_table)), None)
            if victim is None:
                raise TakeBackError(f"elastic reserve: {len(held())} lent blocks are held by sequences being "
                                    f"restored and only {len(free_base())} base blocks are free")
            sched.running.remove(victim)
            sched._preempt(victim)
            e.stats.preemptions += 1
            self.stats.preempted += 1
        src = held()
        dst = free_base()[:len(src)]
        bm.take(dst)                                           # 2. copy
        try:
            e.cache.copy_blocks(src, dst)
        except Exception as err:
            bm.untake(dst)
            raise TakeBackError(f"elastic reserve: copying {len(src)} blocks out of the reserve failed ({err}); "
                                f"nothing was moved") from err
        bm.relocate(dict(zip(src, dst)), sched.running)        # 3. commit
        bm.take_offline(self.lent_ids)
        self.lent = False
        self.stats.blocks_moved += len(src)

    def _fail(self, err: TakeBackError) -> list:
        self.stats.failures += 1
        self.stats.last_error = str(err)
        failed = list(self.engine.scheduler.waiting)
        log.error("%s: %d waiting request(s) not admitted", err, len(failed))
        for seq in failed:
            self.engine.abort(seq.seq_id)
        self.stats.failed_admissions += len(failed)
        return failed
