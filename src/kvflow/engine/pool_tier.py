"""PoolTier: the kvflow pool as the engine's next tier below the resident blocks.

Lookup (at admission): the longest stored prefix of the prompt, in whole pool chunks. Restore (in the step): the
restorer rebuilds that prefix with the configured strategy (``cacheflow`` by default; several requests restoring
in one step go through the batch-aware scheduler) and prefills this step's slice of the prompt after it; the engine
copies the KV into the sequence's blocks. Store (a sequence finishes or is preempted): the full pool chunks of its
computed KV are copied out of the blocks on the engine thread and written by a writer thread through a bounded
queue — when the queue is full the write is dropped and counted, the engine never waits for the pool.

Chunks and blocks need not align: a chunk is a token range [i*C, (i+1)*C) of the sequence, read from whichever
blocks hold those positions; only full chunks are stored (a partial chunk never is), and a restored prefix is a
whole number of chunks whose KV is written into blocks position by position.
"""

from __future__ import annotations

from collections import Counter

import torch

from kvflow.engine.paged_cache import PagedKVCache
from kvflow.planner import Request
from kvflow.pool.write_queue import WriteQueue

PLANS_KEPT = 4096


class PoolTier:
    def __init__(self, restorer, strategy: str = "cacheflow", queue_size: int = 64):
        self.restorer, self.pool, self.strategy = restorer, restorer.pool, strategy
        self.chunk_tokens = restorer.chunk_tokens
        self.num_layers = restorer.runner.num_layers
        self.counters = Counter(lookups=0, restores=0, restore_errors=0, restored_tokens=0)
        dtype = restorer.record_dtype()
        self.writes = WriteQueue(lambda items: self.pool.put_many(items, dtype=dtype), queue_size, self.counters)
        self.loaded_tokens: Counter = Counter()       # per strategy: context tokens loaded (token x layer / L)
        self.recomputed_tokens: Counter = Counter()   # ... and recomputed
        self.restore_s = 0.0
        self.blocked_io_s = 0.0
        self._plans: dict[tuple, float] = {}     # predicted_s of restorations, by shape (at most PLANS_KEPT)

    # ------------------------------------------------------------------------------------ reading
    def lookup(self, token_ids: list[int]) -> int:
        """Tokens of the longest stored prefix of ``token_ids`` (a multiple of the chunk size)."""
        if len(token_ids) < self.chunk_tokens:
            return 0
        self.counters["lookups"] += 1
        req, _ = self.restorer.lookup(torch.as_tensor(token_ids, dtype=torch.long), 1)
        return req.stored_chunks * self.chunk_tokens

    def predicted_s(self, num_tokens: int, resident: int, stored: int) -> float:
        """Predicted seconds to a prompt's first-token logits from what is cached (the scheduler's remaining-work
        rank): the planner's restoration of a pool hit [0, stored) with the rest as its query, else a prefill of
        [resident, num_tokens) — both priced by the restorer's calibrated cost model, the one plans are made with.
        A restoration's plan takes ~30 ms to make (smollm2-135m, 5 chunks x 30 layers), so it is kept per
        (lengths, calibration state, pool bandwidth): requests of one shape share it until a restoration or a
        device changes what the planner would say."""
        if stored > resident:
            cal = self.restorer.calibration
            key = (num_tokens, stored, self.pool.read_bandwidth,
                   None if cal is None else (cal.compute_seen, cal.io_seen))
            if key not in self._plans:
                if len(self._plans) >= PLANS_KEPT:
                    self._plans.clear()
                req = Request(stored, num_tokens - stored, stored // self.chunk_tokens)
                self._plans[key] = self.restorer.planner().plan(self.strategy, req).predicted.ttft_s
            return self._plans[key]
        return self.restorer.planned_cost().compute_time(num_tokens - resident, resident, self.num_layers)

    def restore(self, requests: list[tuple[list[int], list[int]]]):
        """RestoreResults (``.kv`` per layer [1, H, ctx+query, D], ``.logits``) of (context, query) pairs."""
        pairs = [(torch.as_tensor(c, dtype=torch.long), torch.as_tensor(q, dtype=torch.long)) for c, q in requests]
        if len(pairs) > 1 and self.strategy == "cacheflow":
            results = self.restorer.restore_batch(pairs, "cacheflow")
        else:
            results = [self.restorer.restore(c, q, self.strategy) for c, q in pairs]
        for res in results:
            plan = res.plan
            loaded = sum(self.num_layers - s for s in plan.split) * plan.chunk_tokens / self.num_layers
            self.loaded_tokens[plan.strategy] += loaded
            self.recomputed_tokens[plan.strategy] += plan.context_len - loaded
            self.counters["restores"] += 1
            self.counters["restored_tokens"] += plan.context_len
            self.restore_s += res.timings.ttft_s
            self.blocked_io_s += res.timings.blocked_io_s
        return results

    # ------------------------------------------------------------------------------------ writing
    def store(self, token_ids: list[int], num_computed: int, cache: PagedKVCache, block_table: list[int]) -> None:
        """Queue the full chunks of positions [0, num_computed) that the pool does not hold yet."""
        n = num_computed // self.chunk_tokens * self.chunk_tokens
        if n == 0 or self.writes.closed:
            return
        keys = [k for row in self.restorer.keys(torch.as_tensor(token_ids[:n], dtype=torch.long)) for k in row]
        missing = [k for k, ok in zip(keys, self.pool.contains(keys)) if not ok]
        if not missing:
            return
        if self.writes.full():              # do not copy records out of the blocks for a write that is dropped
            self.writes.drop(len(missing))
            return
        self.writes.offer({k: cache.read_block(block_table, k.tokens, k.layers) for k in missing})

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self.writes.flush()

    def close(self) -> None:
        self.writes.close()
