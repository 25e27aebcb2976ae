"""Scheduler: continuous batching under a token budget.

Each step (vLLM v1's order): running sequences first — a decode takes 1 token, a prompt being prefilled takes its
next chunk — then waiting sequences are admitted FCFS while the budget, ``max_num_seqs`` and free blocks allow.
Admission allocates blocks for the whole sequence (its cached prefix shared), so only decodes grow; when a decode
finds no free block the most recently admitted running sequence (not one being restored) is preempted: its blocks
are freed (their full blocks stay cached, its full chunks go to the pool) and it goes back to the front of the
queue, to be recomputed or restored — never a crash, never a wrong token. add_request guarantees any one sequence
fits the whole budget, so the head of the queue always gets in once the running ones finish. A sequence whose pool
hit is being restored on the engine's worker takes no tokens until the restoration returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvflow.engine.block_manager import BlockManager
from kvflow.engine.config import EngineConfig
from kvflow.engine.sequence import Sequence, Status


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    num_tokens: int            # tokens computed by the model this step, from ``start``
    start: int                 # first position computed (after a pool restore: the restored length)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager,
                 pool_lookup: Callable[[list[int]], int] | None = None,
                 on_preempt: Callable[[Sequence], None] | None = None):
        self.config, self.blocks = config, blocks
        self.pool_lookup, self.on_preempt = pool_lookup, on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out, budget, bm = SchedulerOutput(), self.config.max_num_batched_tokens, self.blocks
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.restoring:              # its KV is being restored on the worker: nothing to compute yet
                i += 1
                continue
            while not bm.can_append(seq):
                victim = self._victim()
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            bm.append(seq)
            n = min(seq.remaining, budget)
            out.scheduled.append(Scheduled(seq, n, seq.num_computed))
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            if not self.config.chunked_prefill:
                hit = len(bm.match_prefix(seq.token_ids)[0]) * bm.block_size
                if seq.num_tokens - max(hit, self._stored(seq)) > budget:
                    break
            self.waiting.popleft()
            hit = bm.allocate(seq)
            seq.num_computed = hit
            stored = self._stored(seq)
            seq.pool_restore = stored if stored >= hit + self.config.pool_min_tokens else 0
            if not seq.admitted_once:
                seq.resident_hit_tokens, seq.pool_hit_tokens = hit, max(seq.pool_restore - hit, 0)
                seq.admitted_once = True
            seq.status = Status.RUNNING
            self.running.append(seq)
            start = seq.pool_restore or seq.num_computed
            n = min(seq.num_tokens - start, budget)
            out.scheduled.append(Scheduled(seq, n, start))
            out.admitted.append(seq)
            budget -= n
        return out

    def _victim(self) -> Sequence:
        """The most recently admitted running sequence not being restored (the one asking is always a candidate)."""
        return next(s for s in reversed(self.running) if not s.restoring)

    def _stored(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s longest prefix in the pool, leaving at least one token to compute."""
        if self.pool_lookup is None:
            return 0
        return self.pool_lookup(seq.token_ids[:seq.num_tokens - 1])

    def _preempt(self, seq: Sequence) -> None:
        if self.on_preempt is not None:
            self.on_preempt(seq)
        self.blocks.free_seq(seq)
        seq.status, seq.num_computed, seq.pool_restore = Status.WAITING, 0, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.FINISHED
