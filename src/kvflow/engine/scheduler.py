"""Scheduler: continuous batching under a token budget.

Each step (vLLM v1's order): running sequences first — a decode takes 1 token, a prompt being prefilled takes its
next chunk — then waiting sequences are admitted FCFS while the budget, ``max_num_seqs`` and free blocks allow.
Admission allocates blocks for the whole sequence (its cached prefix shared), so only decodes grow; when a decode
finds no free block the most recently admitted running sequence (not one being restored) is preempted: its blocks
are freed (their full blocks stay cached, its full chunks go to the pool) and it goes back to the front of the
queue, to be recomputed or restored — never a crash, never a wrong token. add_request guarantees any one sequence
fits the whole budget, so the head of the queue always gets in once the running ones finish. A sequence whose pool
hit is being restored on the engine's worker takes no tokens until the restoration returns.

``scheduling_policy = "first-token"`` (the default; it acts only in an engine with a pool) puts a request's first
token before other requests' later ones: when the first waiting request that has no token yet cannot get its
blocks, running sequences that have produced theirs are swapped out — their full chunks go to the pool, their
blocks are freed — until it fits, and come back through restoration once blocks are free again. Through the pool
a swap costs a restoration (mostly loads); without one it would cost a recompute (vLLM's preemption), so an engine
without a pool swaps nobody and runs FCFS::

    waiting  | B (no token yet) | C (no token yet) | A' (swapped, resumes) |      admitted in this order:
    running  | A: decoding, 40 of 96 tokens out   | D: 90 of 96 out       |      first-token requests first, FCFS,
                                                                                then the swapped ones, FCFS
    B does not fit -> swap out the decoder with the most tokens still to generate (A), then the next, until it
    fits; a sequence is swapped at most ``max_swaps`` times (then it runs to the end), and only if the swaps
    together make room (nobody is swapped for nothing).

A request's time to first token is then one step plus its restoration and prefill, whatever the others hold; the
decoders swapped for it pause for at least one answer's length (their inter-token latency shows it), longer under a
stream of arrivals: a swapped decoder returns behind every request without a token (docs/ENGINE.md, "Not yet").

``scheduling_policy = "remaining-work"`` keeps the first-token swaps and orders prefill work by how close each request
is to its first token. Each step: every decode takes its one token first; then the prefill candidates — running
prompts still prefilling and waiting requests — are served in rank order, each taking what is left of the budget
(a short prompt's chunk goes before a long one's, which takes the rest; a waiting one is admitted when it is reached
and its blocks fit, and nobody is admitted past one that does not fit unless it is done before that one's blocks
are free: backfilling, below)::

    rank   due (passed over too long), by arrival  <  work to first token, aged, smallest first, but a later
           arrival passes only work over twice its own  <  has a token, by arrival
    work   waiting:  the soonest of three predicted ways from resident r and pool hit s (PoolTier.choose):
                     prefill of [r, n) | load of [r, s) + prefill of [s, n) | the strategy's restore of [0, s) with
                     [s, n) as its query; admitted, it goes that way          (no pool, no cost model: tokens left)
           running:  prefill of what is left, [num_computed, n)

A waiting request's resident hit is matched again whenever the cached blocks changed (BlockManager.version; a
match is dictionary lookups of hashes kept on the sequence), so a request that arrived while another computed its
prefix ranks by the ~50 tokens left once that prefix is resident, not by the whole prompt it saw at arrival; its
pool hit is looked up once per wait.

A decoder is swapped for the head only when the head's prefill takes fewer steps than the decoder has tokens left
to generate (at most ``max_tokens``): a follow-up on a cached history displaces a long answer, a cold 32K-token
prompt (64 steps at 512 tokens) does not displace a 32-token answer — that answer finishes in 32 steps, and the
prompt then gets the blocks; swapped for it, the decoder would stall for the whole prefill.

A waiting request whose prompt continues past what a running prompt has computed, on that prompt's own tokens
(a second question on a document still being prefilled, an agent's shared system prompt), is not admitted while
that prefill runs: it would compute the same KV a second time, and once the prefill's blocks are committed it
finds them resident (or in the pool). It is skipped, not a barrier: requests ranked after it are still admitted.
The prefill it waits on ranks by its work ÷ (1 + the requests waiting on it): each of their first tokens needs it.

Within a factor of two, arrival order: a later request passes an earlier one only when its work is under half of
that one's (``in_rank_order``). Shortest-first on exact figures hands every step to the newest prompt a few tokens
shorter than those waiting, and a waiting one is passed over until it is due; bucketing work by its power of two
stops that, but splits two prompts of one size that straddle a boundary (431 and 434 tokens at 0.5 s of predicted
work), so the later one went first. Aged: a request's work counts as w x (1 - p / A), where p is what later
arrivals have been given before it and A = (F - 1) x its uncached tokens, its allowance below; so fewer requests
are short enough to pass it as the allowance is used, and it reaches the front, due, when it is spent.

Starvation is bounded by ``starvation_factor`` F: a request is *due* once the prefill tokens given to requests that
arrived after it (while it had no token) reach (F - 1) x its uncached tokens; due requests go first, oldest first.
So at most (F - 1) x its own work goes to later arrivals before it; the rest of what precedes it arrived earlier, and
FCFS computes that before it too. When blocks are not what it waits for, its first token comes within F x its FCFS
steps plus two (tests/engine/test_scheduler_policy.py checks it on random queues). F = 1 is FCFS order.

When the best-ranked waiting request (the head) waits for blocks, a later one is admitted past it only if that
delays nothing (backfilling): it fits now beside the running sequences' growth to their ``max_tokens``, and it is
done — prefill and whole answer — within the steps after which the running sequences, finishing in order, have
freed the head's blocks. Swapped decoders waiting behind a long prompt's blocks come back in the meantime instead of
after it; the head gets its blocks when it would have without them.
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
    swapped: list[Sequence] = field(default_factory=list)      # swapped out for a first token (first-token policy)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def in_rank_order(seqs: list[Sequence], ranks: dict[int, tuple]) -> list[Sequence]:
    """``seqs`` in the order a step serves them, from each one's ``Scheduler._rank`` (class, aged work, arrival):
    due ones by arrival, then those ranked by work, then those that have a token by arrival. Among the ranked ones a
    request passes an earlier arrival only when its work is under half of that one's: taken in arrival order, each
    moves ahead past the requests at the end of the order so far while they are more than twice its work, and stops
    at the first that is not. So two prompts of about one size keep their arrival order wherever their sizes fall
    (a fixed power-of-two bucket split 431 from 434 tokens at 0.5 s of predicted work), and a short follow-up still
    passes long prefills. Cost: one comparison per request plus one per request passed."""
    order: list[Sequence] = []
    for seq in sorted(seqs, key=lambda s: (ranks[s.seq_id][0], s.seq_id)):
        cls, work, _ = ranks[seq.seq_id]
        i = len(order)
        while i > 0 and cls == 1 and ranks[order[i - 1].seq_id][0] == 1 and 2 * work < ranks[order[i - 1].seq_id][1]:
            i -= 1
        order.insert(i, seq)
    return order


def _tokens_left(num_tokens: int, resident: int, stored: int) -> tuple[str, float]:
    """Without a cost model: a pool hit is restored, work is the tokens left to compute."""
    if stored > resident:
        return "restore", float(num_tokens - stored)
    return "prefill", float(num_tokens - resident)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager,
                 pool_lookup: Callable[[list[int]], int] | None = None,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 choose: Callable[[int, int, int], tuple[str, float]] | None = None):
        self.config, self.blocks = config, blocks
        self.pool_lookup, self.on_preempt = pool_lookup, on_preempt
        # (num_tokens, resident hit, pool hit) -> (the way to the first token predicted soonest: "prefill", "load"
        # or "restore"; its predicted work, the remaining-work rank). PoolTier.choose; without a pool: tokens
        self.choose = choose or _tokens_left
        self.work = lambda n, resident, stored: self.choose(n, resident, stored)[1]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        if self.config.scheduling_policy != "remaining-work":
            return self._schedule_in_order()
        out = self._schedule_by_work()
        self._age(out)
        return out

    def _age(self, out: SchedulerOutput) -> None:
        """Every request still without a token is passed over by the prefill tokens this step gave to later arrivals
        without a token (seq ids grow with arrival)."""
        given = [(s.seq.seq_id, s.num_tokens) for s in out.scheduled if s.seq.first_token_s is None]
        if not given:
            return
        for seq in (*self.waiting, *self.running):
            if seq.first_token_s is None:
                seq.passed_over += sum(n for sid, n in given if sid > seq.seq_id)

    def _schedule_in_order(self) -> SchedulerOutput:
        """fcfs / first-token: running sequences in admission order, then admission."""
        out, budget, bm = SchedulerOutput(), self.config.max_num_batched_tokens, self.blocks
        if self.config.scheduling_policy == "first-token":
            self._make_room(out)
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
            seq = self._next_waiting()
            if not self._admit(seq, budget, out):
                break
            budget -= out.scheduled[-1].num_tokens
        return out

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> bool:
        """Admit waiting ``seq`` with its first slice of ``budget`` tokens, if its blocks (and, without chunked
        prefill, its whole prompt) fit."""
        bm = self.blocks
        if not bm.can_allocate(seq):
            return False
        if not self.config.chunked_prefill:
            hit = len(bm.match(seq)[0]) * bm.block_size
            if seq.num_tokens - max(hit, self._stored(seq)) > budget:
                return False
        self.waiting.remove(seq)
        hit = bm.allocate(seq)
        seq.num_computed = hit
        way, stored, _ = self._way(seq.num_tokens, hit, self._stored(seq))
        seq.pool_restore, seq.pool_load = (stored, 0) if way == "restore" else (0, stored)
        if not seq.admitted_once:
            seq.resident_hit_tokens, seq.pool_hit_tokens = hit, max(stored - hit, 0)
            seq.admitted_once = True
        seq.status = Status.RUNNING
        self.running.append(seq)
        start = stored or seq.num_computed
        out.scheduled.append(Scheduled(seq, min(seq.num_tokens - start, budget), start))
        out.admitted.append(seq)
        return True

    def _schedule_by_work(self) -> SchedulerOutput:
        """remaining-work: decodes first (one token each), then prefill slices and admissions in rank order."""
        out, budget, bm = SchedulerOutput(), self.config.max_num_batched_tokens, self.blocks
        self._make_room(out)
        prefilling = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.restoring:
                continue
            if seq.remaining > 1:
                prefilling.append(seq)
                continue
            if budget <= 0:
                break
            while not bm.can_append(seq):
                victim = self._victim()
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim in prefilling:
                    prefilling.remove(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            bm.append(seq)
            out.scheduled.append(Scheduled(seq, 1, seq.num_computed))
            budget -= 1
        admitting, head_wait = not out.preempted, 0
        blocked, waiters = set(), {}              # requests whose prefix a running prompt computes; its count
        for seq in self.waiting:
            if seq.first_token_s is None:
                self._refresh(seq)                # its cached prefix as ranking sees it (hit_tokens)
            if (other := self._prefill_computing(seq)) is not None:
                blocked.add(seq.seq_id)
                waiters[other.seq_id] = waiters.get(other.seq_id, 0) + 1
        ranks = {s.seq_id: self._rank(s, waiters.get(s.seq_id, 0)) for s in (*prefilling, *self.waiting)}
        ranked = in_rank_order([*prefilling, *self.waiting], ranks)
        for seq in self._older_first_at_the_cut(ranked, ranks, budget, blocked):
            if budget <= 0:
                break
            if seq.status is Status.RUNNING:
                if seq in self.running:           # not preempted by a decode above
                    n = min(seq.remaining, budget)
                    out.scheduled.append(Scheduled(seq, n, seq.num_computed))
                    budget -= n
            elif seq.seq_id in blocked or self._prefill_computing(seq, out.admitted) is not None:
                continue                          # its prefix is being computed by a running prompt (one that
                                                  # was running, or one admitted above, this step)
            elif len(self.running) >= self.config.max_num_seqs:
                continue                          # prompts already running still get their slices
            elif admitting or self._backfills(seq, head_wait):
                if self._admit(seq, budget, out):
                    budget -= out.scheduled[-1].num_tokens
                elif admitting:                   # the first that waits for blocks: the head
                    admitting, head_wait = False, self._steps_to_blocks(seq)
        return out

    def _need(self, seq: Sequence) -> int:
        """Tokens ``seq`` computes to its first token: what a running prompt has left, or a waiting one's uncached
        prompt as last ranked."""
        return seq.remaining if seq.status is Status.RUNNING else seq.num_tokens - seq.hit_tokens

    def _first_tokens(self, order: list[Sequence], budget: int, blocked: set[int]) -> tuple[int, Sequence | None]:
        """Handing ``budget`` out in ``order`` as the step does: how many requests without a token get it this step,
        and the first one cut short by the budget (None: nobody). A waiting request is admitted while its blocks
        fit (the first that does not fit stops admission, as the step's head); backfilling is left out."""
        done, bm, admitting = 0, self.blocks, True
        free = bm.num_free
        for seq in order:
            if budget <= 0:
                break
            if seq.seq_id in blocked:
                continue
            if seq.status is not Status.RUNNING:
                if not admitting:
                    continue
                blocks = bm.needed(seq, bm.match(seq)[0])
                if blocks > free:
                    admitting = False
                    continue
                free -= blocks
            need = self._need(seq)
            if seq.first_token_s is None:
                if need <= budget:
                    done += 1
                else:
                    return done, seq
            budget -= need
        return done, None

    def _older_first_at_the_cut(self, order: list[Sequence], ranks: dict[int, tuple], budget: int,
                                blocked: set[int]) -> list[Sequence]:
        """Where the step's budget (not its blocks) cuts a prompt short that would finish in this step but for
        requests that arrived after it and were ranked before it, it goes first when that gives as many first
        tokens this step: the cut falls on the later arrival. Shortest-first gains nothing there (one of them gets
        its token a step later either way), and the earlier arrival's wait is the one that sets the tail. A prompt
        that cannot finish in this step is not moved, so a short follow-up still passes a long prefill. ``ranks``:
        each one's ``_rank`` as ``order`` was sorted by (due requests, class 0, keep their place)."""
        count, cut = self._first_tokens(order, budget, blocked)
        if cut is None or self._need(cut) > budget or ranks[cut.seq_id][0] != 1:
            return order
        i = order.index(cut)
        later = [s for s in order[:i] if s.seq_id > cut.seq_id and ranks[s.seq_id][0] == 1]
        if not later:
            return order
        ahead = [s for s in order[:i] if s not in later]
        moved = [*ahead, cut, *later, *order[i + 1:]]
        again, still_cut = self._first_tokens(moved, budget, blocked)
        return moved if again >= count and still_cut is not cut else order

    def _steps_to_finish(self, seq: Sequence) -> int:
        """Steps until ``seq`` is done at the latest if it runs every step: its uncached prompt at the full budget
        (the last slice samples a token), then the rest of its answer (``max_tokens``; a stop ends it sooner)."""
        uncached = seq.num_tokens - (seq.num_computed if seq.status is Status.RUNNING else seq.hit_tokens)
        left = seq.params.max_tokens - seq.num_output
        return -(-max(uncached, 1) // self.config.max_num_batched_tokens) + max(left - 1, 0)

    def _growth(self, seq: Sequence) -> int:
        """Blocks ``seq`` still takes as its answer grows to ``max_tokens`` (beyond its block table)."""
        final = self.blocks.blocks_for(seq.num_prompt_tokens + seq.params.max_tokens)
        return max(final - max(len(seq.block_table), self.blocks.blocks_for(seq.num_tokens)), 0)

    def _steps_to_blocks(self, head: Sequence) -> int:
        """Steps until waiting ``head``'s blocks are free at the latest: running sequences finish in the order of
        their steps to finish, each freeing its own blocks (and those it grows into). 0: never, by finishing alone
        (then nobody is admitted past it)."""
        bm = self.blocks
        hits = bm.match(head)[0]
        needed = bm.needed(head, hits)
        free = bm.num_free - sum(self._growth(s) for s in self.running)
        if free >= needed:
            return 0
        order = sorted(self.running, key=self._steps_to_finish)
        for s, freed in zip(order, bm.freed_by(order, keep=hits)):
            free += self._growth(s)
            if free + freed >= needed:
                return self._steps_to_finish(s)
        return 0

    def _backfills(self, seq: Sequence, head_wait: int) -> bool:
        """Waiting ``seq`` may pass the head that waits for blocks when it does not delay it: it is done, and its
        blocks are back, before the head's are free (``head_wait`` steps), and it fits beside the running
        sequences' growth with its own. The head's wait is what FCFS order would make it wait."""
        if head_wait <= 0:
            return False
        bm = self.blocks
        spare = bm.num_free - sum(self._growth(s) for s in self.running)
        return (self._steps_to_finish(seq) <= head_wait
                and bm.needed(seq, bm.match(seq)[0]) + self._growth(seq) <= spare)

    def _rank(self, seq: Sequence, waiters: int = 0) -> tuple:
        """remaining-work order (smaller first): due requests by arrival, then by predicted work to the first token,
        then sequences that already have a token (swapped or preempted decoders) by arrival. A running prompt that
        ``waiters`` waiting requests wait on (their prefix: ``_prefill_computing``) counts its work ÷ (1 + waiters):
        every one of those first tokens needs that prefill first (Smith's rule: work per request it lets through)."""
        if seq.first_token_s is not None:
            return (2, 0.0, seq.seq_id)
        self._refresh(seq)
        allowance = (self.config.starvation_factor - 1) * seq.work_tokens
        if seq.passed_over >= allowance:
            return (0, 0.0, seq.seq_id)
        work = (self.work(seq.num_tokens, seq.num_computed, 0) / (1 + waiters) if seq.status is Status.RUNNING
                else seq.work)
        return (1, work * (1 - seq.passed_over / allowance), seq.seq_id)

    def _ordered(self, seqs: list[Sequence]) -> list[Sequence]:
        """``seqs`` in rank order (``in_rank_order``), each ranked on its own (no waiters counted)."""
        return in_rank_order(seqs, {s.seq_id: self._rank(s) for s in seqs})

    def _refresh(self, seq: Sequence) -> None:
        """A waiting request's prediction, made again when the cached blocks changed since (``_estimate``)."""
        if seq.status is not Status.RUNNING and (seq.work is None or seq.ranked_at != self.blocks.version):
            self._estimate(seq)

    def _estimate(self, seq: Sequence) -> None:
        """A waiting request's predicted work to its first token, from its cached prefix now: resident blocks are
        matched again whenever the cached set changed (a prefix a running prompt computed while it waited makes it a
        short request), its pool hit is looked up once per wait. The aging threshold keeps its first estimate."""
        resident = len(self.blocks.match(seq)[0]) * self.blocks.block_size
        seq.ranked_at = self.blocks.version
        if seq.work is None:
            seq.stored_tokens = self._stored(seq)
        elif resident == seq.resident_tokens:
            return                                 # the same hit: the same prediction
        _, stored, seq.work = self._way(seq.num_tokens, resident, seq.stored_tokens)
        seq.resident_tokens, seq.hit_tokens = resident, max(resident, stored)
        if seq.work_tokens < 0:                    # the aging threshold: its uncached tokens when first seen
            seq.work_tokens = seq.num_tokens - seq.hit_tokens

    def _prefill_computing(self, seq: Sequence, among: list[Sequence] | None = None) -> Sequence | None:
        """remaining-work: the running prompt (of ``among``, default all running) whose tokens waiting ``seq``
        shares at least one block past what that prompt has computed (and past ``seq``'s own cached prefix): that
        prefill is computing ``seq``'s KV now. Cost: a first-block compare per running prefill, one slice compare
        where it matches."""
        bs = self.blocks.block_size
        for other in self.running if among is None else among:
            k = other.num_computed + bs
            if (other.first_token_s is not None or k > min(other.num_prompt_tokens, seq.num_tokens - 1)
                    or k <= seq.hit_tokens or seq.token_ids[:bs] != other.token_ids[:bs]):
                continue
            if seq.token_ids[:k] == other.token_ids[:k]:
                return other
        return None

    def _next_waiting(self) -> Sequence:
        """The next sequence to admit: FCFS, or under the first-token policy the first one without a token yet."""
        if self.config.scheduling_policy == "first-token":
            return self._first_without_token() or self.waiting[0]
        return self.waiting[0]

    def _first_without_token(self) -> Sequence | None:
        """The waiting request a swap makes room for: the first without a token (remaining-work: the best-ranked)."""
        if self.config.scheduling_policy == "remaining-work":       # (not one that waits for a running prefill)
            waiting = [s for s in self.waiting if s.first_token_s is None and self._prefill_computing(s) is None]
            return self._ordered(waiting)[0] if waiting else None
        return next((s for s in self.waiting if s.first_token_s is None), None)

    def _make_room(self, out: SchedulerOutput) -> None:
        """First-token policy: swap out decoding sequences until the first waiting request without a token fits
        (remaining-work: the best-ranked one, and prompts still prefilling that rank below it may be swapped too)."""
        bm = self.blocks
        head = self._first_without_token() if self.pool_lookup is not None else None
        if head is None:
            return
        hits = bm.match(head)[0]
        needed = bm.needed(head, hits)
        if needed <= bm.num_free:
            return
        victims = sorted((s for s in self.running if s.first_token_s is not None and not s.restoring
                          and s.num_swaps < self.config.max_swaps),
                         key=lambda s: (s.params.max_tokens - s.num_output, len(s.block_table)), reverse=True)
        if self.config.scheduling_policy == "remaining-work":
            # a decoder is swapped only when the head's prefill takes fewer steps than the decoder has tokens left:
            # the swap costs the decoder that many steps and saves the head its remaining answer
            uncached = head.num_tokens - max(len(hits) * bm.block_size, head.hit_tokens)
            steps = -(-max(uncached, 1) // self.config.max_num_batched_tokens)
            victims = [s for s in victims if s.params.max_tokens - s.num_output > steps]
            # then prompts still prefilling that rank below it, the last-ranked first
            order = self._ordered([head, *(s for s in self.running if s.first_token_s is None and not s.restoring
                                           and s.num_swaps < self.config.max_swaps)])
            victims += reversed(order[order.index(head) + 1:])
        growing = sum(1 for s in self.running if bm.blocks_for(s.num_tokens) > len(s.block_table))
        free = bm.num_free - growing
        if free >= needed:
            return
        # the fewest victims, in order, whose blocks (those no other table holds) make room
        enough = next((i + 1 for i, freed in enumerate(bm.freed_by(victims, keep=hits)) if free + freed >= needed), 0)
        if not enough:
            return                                         # swapping all of them would not make room
        for v in victims[:enough]:
            self.running.remove(v)
            self._preempt(v)
            v.num_swaps += 1
            out.swapped.append(v)

    def _victim(self) -> Sequence:
        """The most recently admitted running sequence not being restored (the one asking is always a candidate)."""
        return next(s for s in reversed(self.running) if not s.restoring)

    def _way(self, num_tokens: int, resident: int, stored: int) -> tuple[str, int, float]:
        """How a request admitted now gets to its first token, the pool hit that way uses (0: none) and its
        predicted work. The pool hit counts when it adds at least ``pool_min_tokens`` to the resident hit; then
        ``choose`` (PoolTier's three predictions) says whether it is loaded into the blocks past the resident hit,
        restored by the strategy (all of [0, stored)), or left for a prefill of [resident, n)."""
        if stored < resident + self.config.pool_min_tokens:
            stored = 0
        way, work = self.choose(num_tokens, resident, stored)
        return way, 0 if way == "prefill" else stored, work

    def _stored(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s longest prefix in the pool, leaving at least one token to compute."""
        if self.pool_lookup is None:
            return 0
        return self.pool_lookup(seq.token_ids[:seq.num_tokens - 1])

    def _preempt(self, seq: Sequence) -> None:
        if self.on_preempt is not None:
            self.on_preempt(seq)
        self.blocks.free_seq(seq)
        seq.status, seq.num_computed, seq.pool_restore, seq.pool_load = Status.WAITING, 0, 0, 0
        seq.work = None                    # re-estimated at its next ranking (its hits changed)
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.FINISHED
