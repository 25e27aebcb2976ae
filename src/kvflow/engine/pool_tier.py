"""PoolTier: the kvflow pool as the engine's next tier below the resident blocks.

Lookup (at admission): the longest stored prefix of the prompt, in whole pool chunks; ``choose`` says which way to
the first token is predicted soonest: a prefill from the resident blocks, a load, or a restoration. Load (in the
step): the records past the resident blocks are read straight into the sequence's blocks and the step computes the
rest beside the other sequences. Restore (in the step): the restorer rebuilds that prefix with the configured
strategy (``cacheflow`` by default; several requests restoring in one step go through the batch-aware scheduler)
and prefills this step's slice of the prompt after it; the engine copies the KV into the sequence's blocks. Store
(a sequence finishes or is preempted): the full pool chunks of its computed KV are copied out of the blocks on the
engine thread and written by a writer thread through a bounded queue — when the queue is full the write is dropped
and counted, the engine never waits for the pool.

Chunks and blocks need not align: a chunk is a token range [i*C, (i+1)*C) of the sequence, read from whichever
blocks hold those positions; only full chunks are stored — except a preempted decoder's partial last chunk, under a
key of its exact tokens (chunks/keys.py ``tail_keys``), which only that sequence's return asks for — and a restored
prefix is a whole number of chunks whose KV is written into blocks position by position.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from kvflow.engine.paged_cache import PagedKVCache
from kvflow.planner import Request
from kvflow.pool.write_queue import WriteQueue

PLANS_KEPT = 4096


class PoolTier:
    def __init__(self, restorer, strategy: str = "cacheflow", queue_size: int = 64, load: bool = True):
        self.restorer, self.pool, self.strategy = restorer, restorer.pool, strategy
        self.loads = load and strategy != "recompute"     # loads are a way to a first token (``choose``)
        self.chunk_tokens = restorer.chunk_tokens
        self.num_layers = restorer.runner.num_layers
        self.counters = Counter(lookups=0, restores=0, restore_errors=0, restored_tokens=0, loads=0,
                                load_tokens=0)
        dtype = restorer.record_dtype()
        self.writes = WriteQueue(lambda items: self.pool.put_many(items, dtype=dtype), queue_size, self.counters)
        self.loaded_tokens: Counter = Counter()       # per strategy: context tokens loaded (token x layer / L)
        self.recomputed_tokens: Counter = Counter()   # ... and recomputed
        self.restore_s = 0.0
        self.blocked_io_s = 0.0
        self._plans: dict[tuple, float] = {}     # predicted_s of restorations, by shape (at most PLANS_KEPT)

    # ------------------------------------------------------------------------------------ reading
    def lookup(self, token_ids: list[int]) -> int:
        """Tokens of the longest stored prefix of ``token_ids``: whole chunks, or all of ``token_ids`` when every
        chunk and the partial one after them are stored (a preempted sequence's tail, ``store(tail=True)``)."""
        self.counters["lookups"] += 1
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        stored = self.restorer.stored_tokens(ids) if len(token_ids) >= self.chunk_tokens else 0
        if len(token_ids) - stored < self.chunk_tokens:                  # every full chunk: is the tail there too?
            tail = self.restorer.tail_keys(ids)
            if tail and all(self.pool.contains(tail)):
                return len(token_ids)
        return stored

    def choose(self, num_tokens: int, resident: int, stored: int) -> tuple[str, float]:
        """The way a prompt of ``num_tokens`` gets to its first-token logits from what is cached — resident blocks
        [0, resident), a pool hit [0, stored) — that is predicted soonest, and its predicted seconds (the
        scheduler's remaining-work rank). Three ways, priced by the restorer's calibrated models (the ones plans
        are made with):

        * ``prefill``: [resident, num_tokens) computed in the step (offered when something is resident, or nothing
          is stored past it);
        * ``load``: the records of [resident, stored) read into the sequence's blocks, every layer, and
          [stored, num_tokens) computed in the step (not offered by the ``recompute`` strategy, nor with
          ``pool_load`` off);
        * ``restore``: the strategy's restoration of [0, stored) with the rest as its query (the planner knows
          nothing of resident blocks, so it rebuilds all of it; cacheflow may recompute early chunks while it
          loads late ones, which beats a load where the link is slow).

        What runs in the step is priced as the tokens it adds to a step that runs anyway (``added_time``: the
        decodes beside it pay the step's per-call overheads); a restoration runs its own passes and pays them.
        With nothing resident a pool hit is always used (a load or the strategy's plan, which may recompute all
        of it); ties go to the way listed first. A restoration is planned only where the planner's lower bound T*
        beats the other ways (``_restoration_s``): the choice is the same, without a plan per request."""
        cost, L = self.restorer.planned_cost(), self.num_layers
        prefill = cost.added_time(num_tokens - resident, resident, L)
        if stored <= resident:
            return "prefill", prefill
        ways = {"prefill": prefill} if resident else {}
        if self.loads:
            cells = (-(-stored // self.chunk_tokens) - resident // self.chunk_tokens) * L   # a stored tail: a chunk
            ways["load"] = (self.restorer.io_model().read_time(cells)
                            + cost.added_time(num_tokens - stored, stored, L))
        ways["restore"] = self._restoration_s(num_tokens, stored, beat=min(ways.values(), default=math.inf))
        way = min(ways, key=ways.get)
        return way, ways[way]

    def predicted_s(self, num_tokens: int, resident: int, stored: int) -> float:
        """Predicted seconds to the first-token logits the soonest way (``choose``)."""
        return self.choose(num_tokens, resident, stored)[1]

    def _restoration_bound(self, num_tokens: int, stored: int) -> float:
        """The planner's T* for the restoration of [0, stored) with the rest as its query: no plan is predicted
        sooner. Well under a millisecond for a few chunks (2 ms at 8K tokens, ~40 ms at 128K), where a plan takes
        30-60 ms at a few chunks to 8K."""
        return self.restorer.planner().bound(self._request(num_tokens, stored))

    def _request(self, num_tokens: int, stored: int) -> Request:
        return Request(stored, num_tokens - stored, stored // self.chunk_tokens)

    def _restoration_s(self, num_tokens: int, stored: int, beat: float = math.inf) -> float:
        """The planner's predicted time to first token of a restoration of [0, stored) with the rest as its query,
        or ``math.inf`` (not planned) where its T* is no sooner than ``beat`` — the best other way's time, which a
        restoration then cannot beat. A plan takes ~30 ms to make (smollm2-135m, 5 chunks x 30 layers), so it is
        kept per (lengths, calibration state, pool bandwidth): requests of one shape share it until a restoration
        or a device changes what the planner would say; a kept plan is used without its bound."""
        cal = self.restorer.calibration
        key = (num_tokens, stored, self.pool.read_bandwidth, None if cal is None else (cal.compute_seen, cal.io_seen))
        if key not in self._plans:
            if self._restoration_bound(num_tokens, stored) >= beat:
                return math.inf
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            self._plans[key] = self.restorer.planner().plan(self.strategy,
                                                            self._request(num_tokens, stored)).predicted.ttft_s
        return self._plans[key]

    def load(self, token_ids: list[int], start: int, stop: int, cache: PagedKVCache, block_table: list[int]) -> int:
        """Copy the stored KV of positions [start, stop) (whole chunks, and a stored tail where ``stop`` ends inside
        one) from the pool into the sequence's blocks, chunk by chunk, every layer; returns where it stopped:
        ``stop``, or the start of the first chunk with a record missing, foreign or failing its checks (a miss: the
        caller computes from there). No planner, no model: what a resident prefix leaves of a pool hit is only read."""
        C = self.chunk_tokens
        ids = torch.as_tensor(token_ids[:stop], dtype=torch.long)
        rows = self.restorer.keys(ids, tail=True)[start // C:]      # a stored tail is the last row
        got = self.pool.get_many([k for row in rows for k in row])
        done = start
        for row in rows:
            c0, c1 = row[0].tokens
            recs = [got.get(k) for k in row]
            if any(r is None or tuple(r.shape) != (k.layers[1] - k.layers[0], 2, cache.kv_heads, c1 - c0,
                                                   cache.head_dim) for k, r in zip(row, recs)):
                break
            lo = max(start, c0)
            slots = cache.slots(block_table, lo, c1)
            for k, rec in zip(row, recs):
                part = rec[:, :, :, lo - c0:].to(device=cache.kv.device, dtype=cache.kv.dtype)
                for i, layer in enumerate(range(*k.layers)):
                    cache.write(layer, slots, part[i, 0:1], part[i, 1:2])
            done = c1
        self.counters["loads"] += 1
        self.counters["load_tokens"] += done - start
        return done

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
    def store(self, token_ids: list[int], num_computed: int, cache: PagedKVCache, block_table: list[int],
              tail: bool = False) -> None:
        """Queue the full chunks of positions [0, num_computed) that the pool does not hold yet; with ``tail`` (a
        preempted sequence, which comes back with these very tokens) the partial chunk after them too."""
        if num_computed == 0 or self.writes.closed:
            return
        ids = torch.as_tensor(token_ids[:num_computed], dtype=torch.long)
        keys = [k for row in self.restorer.keys(ids, tail=tail) for k in row]
        if not keys:
            return
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
