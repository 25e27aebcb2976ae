"""Restorer: the façade over model runner, pool, cost model, planner and executor.

    r = Restorer(runner, KVPool.memory())
    r.store(context_ids)                                   # prefill once, one record per (chunk, layer)
    r.store(context_ids, boundaries=[8])                   # + hidden states entering layer 8 (pipeline stages)
    out = r.restore(context_ids, query_ids, strategy="cacheflow")
    out.logits, out.kv, out.plan, out.timings, out.timeline

Data flows one way: prefix lookup -> plan -> (compute || I/O) -> assembled KV -> tail + query -> logits.
Each record holds one chunk of one layer, so any token x layer split loads exactly the cells it needs.
A boundary activation record (kind "act", layers (b, b)) holds one chunk's hidden states entering layer b, always
fp32: a pipeline stage starting at b recomputes its KV from it exactly (docs/PIPELINE.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from kvflow.chunks.keys import ChunkKey, chunk_keys, layer_groups, tail_keys
from kvflow.chunks.record import HEADER_SIZE, kv_record_dtype
from kvflow.cost.calibration import Calibration
from kvflow.cost.model import CostModel
from kvflow.cost.saved import cost_profile
from kvflow.errors import KVFlowError
from kvflow.executor import Event, Executor, Job, Timings
from kvflow.model.dtypes import parse_dtype
from kvflow.model.runner import KVCache, ModelRunner
from kvflow.planner import IOModel, Plan, Planner, PlannerConfig, Request
from kvflow.planner.batch import BatchPlan, plan_batch

log = logging.getLogger("kvflow.restore")


@dataclass
class StoreResult:
    tokens: int            # tokens now stored (full chunks)
    chunks_written: int
    bytes_written: int     # KV records
    seconds: float
    act_bytes_written: int = 0   # boundary activation records
    records_not_stored: int = 0  # records the pool could not store (relaxed pool: failed writes; strict raises)
    prefill_s: float = 0.0       # of ``seconds``: the prefill; the rest is the put path (copies, checksums, writes)

    @property
    def complete(self) -> bool:
        return self.records_not_stored == 0


ACT_DTYPE = torch.float32   # boundary activations: recomputing from a rounded activation would not be exact
STORE_SLICE = 256           # records copied out and written together by store()


class _GivenKV:
    """Per-layer (k, v) of a prefill made elsewhere, read as KVCache blocks."""
    read_block = KVCache.read_block

    def __init__(self, kv):
        self.keys, self.values = [k for k, _ in kv], [v for _, v in kv]


@dataclass
class RestoreResult:
    logits: torch.Tensor                       # next-token logits after the query, [vocab]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [1, kv_heads, context+query, head_dim]
    plan: Plan
    timings: Timings
    timeline: list[Event]
    fallback_chunks: list[int] = field(default_factory=list)


def as_ids(token_ids) -> torch.Tensor:
    t = torch.as_tensor(token_ids, dtype=torch.long).view(-1)
    return t


def _check_request(context_ids, query_ids) -> tuple[torch.Tensor, torch.Tensor]:
    ctx, query = as_ids(context_ids), as_ids(query_ids)
    if query.numel() == 0:
        raise KVFlowError("restore needs at least one query token (the next-token logits follow the query)")
    return ctx, query


class Restorer:
    def __init__(self, runner: ModelRunner, pool, *, cost: CostModel | None = None,
                 planner: PlannerConfig | None = None, storage_dtype: torch.dtype | str | None = None,
                 calibrate: bool = True):
        self.runner, self.pool = runner, pool
        # every record's key names the model by its fingerprint, a hash of all its weights (~30 ms of CPU on
        # smollm2-135m): taken here, with the engine's build, not by the first request that looks the pool up
        self.model_id = runner.fingerprint
        self.cost = cost or cost_profile(runner)          # the saved profile, or one measured now (cost/saved.py)
        # measured / predicted speed, folded in after every restoration (cost/calibration.py); None: plan on the
        # profiled model as it is
        self.calibration = Calibration() if calibrate else None
        self.planner_config = planner or PlannerConfig.load()
        self.storage_dtype = storage_dtype       # None: the pool's storage dtype
        self.executor = Executor(runner, pool)
        self.chunk_tokens = pool.chunk_tokens
        self.groups = layer_groups(runner.num_layers, 1)

    # ------------------------------------------------------------------------------------- storing
    def keys(self, token_ids: torch.Tensor, tail: bool = False) -> list[list[ChunkKey]]:
        """Record keys per full chunk (a row per chunk); ``tail``: and the partial chunk after them (chunks/keys.py)."""
        return chunk_keys(token_ids, self.model_id, self.chunk_tokens, self.groups, tail=tail)

    def tail_keys(self, token_ids: torch.Tensor) -> list[ChunkKey]:
        """Keys of the partial chunk at the end of ``token_ids`` ([] on a chunk boundary): chunks/keys.py."""
        return tail_keys(token_ids, self.model_id, self.chunk_tokens, self.groups)

    def act_keys(self, token_ids: torch.Tensor, boundary: int) -> list[ChunkKey]:
        """Keys of the boundary activation records (hidden states entering layer ``boundary``), one per full chunk."""
        return [row[0] for row in chunk_keys(token_ids, self.model_id, self.chunk_tokens,
                                             [(boundary, boundary)], kind="act")]

    def store(self, context_ids, boundaries=(), kv=None) -> StoreResult:
        """Prefill the context once and store every full chunk's KV (one record per chunk x layer), and with
        ``boundaries`` (layers 0 < b < num_layers: where pipeline stages start) the hidden states entering each
        boundary layer, one fp32 record per chunk. Records already in the pool are not written again. ``kv``:
        per-layer (k, v) [1, H, >= context, D] of this context from a full prefill already made (a benchmark's
        reference): stored as they are, no second prefill. Records are copied out and written a slice at a time,
        so the put path never holds a second copy of the context."""
        ids = as_ids(context_ids)
        boundaries = sorted(set(int(b) for b in boundaries))
        if any(not 0 < b < self.runner.num_layers for b in boundaries):
            raise KVFlowError(f"stage boundaries must be layers 1..{self.runner.num_layers - 1}, got {boundaries}")
        t0 = time.perf_counter()
        keys = self.keys(ids)
        flat = [k for row in keys for k in row]
        acts = [k for b in boundaries for k in self.act_keys(ids, b)]
        present = self.pool.contains(flat + acts)
        missing = [k for k, ok in zip(flat, present) if not ok]
        missing_acts = [k for k, ok in zip(acts, present[len(flat):]) if not ok]
        written = act_written = not_stored = 0
        prefill_s = 0.0
        if missing or missing_acts:
            n = len(keys) * self.chunk_tokens
            t1 = time.perf_counter()
            if kv is not None and not missing_acts:
                cache, hidden = _GivenKV(kv), {}
            else:
                cache, hidden = self._prefill_capturing(ids[:n], boundaries)
            prefill_s = time.perf_counter() - t1
            stored, dtype = 0, self.record_dtype()
            for a in range(0, len(missing), STORE_SLICE):
                part = missing[a:a + STORE_SLICE]
                items = dict(zip(part, self.executor.transfer.to_host([cache.read_block(k.tokens, k.layers)
                                                                        for k in part])))
                stored += self.pool.put_many(items, dtype=dtype)  # strict pools raise StoreError instead
                written += sum(HEADER_SIZE + t.numel() * dtype.itemsize for t in items.values())
                del items
            act_items = {k: hidden[k.layers[0]][:, k.tokens[0]:k.tokens[1]] for k in missing_acts}
            stored += self.pool.put_many(act_items, dtype=ACT_DTYPE)
            act_written = sum(HEADER_SIZE + t.numel() * ACT_DTYPE.itemsize for t in act_items.values())
            not_stored = len(missing) + len(act_items) - stored
        return StoreResult(len(keys) * self.chunk_tokens, len({k.tokens for k in missing + missing_acts}), written,
                           time.perf_counter() - t0, act_written, not_stored, prefill_s)

    def _prefill_capturing(self, ids: torch.Tensor, boundaries: list[int]):
        """Chunked prefill of ``ids`` that also keeps the hidden states entering each boundary layer."""
        runner, n = self.runner, ids.numel()
        cache = runner.new_cache(n)
        edges = [0, *boundaries, runner.num_layers]
        hidden = {b: torch.empty(1, n, runner.hidden_size, dtype=ACT_DTYPE, device=runner.device) for b in boundaries}
        step = self.planner_config.max_step
        for a in range(0, n, step):
            h = runner.embed(ids[a:a + step])
            for l0, l1 in zip(edges, edges[1:]):
                if l0 in hidden:
                    hidden[l0][:, a:a + h.shape[1]] = h
                h = runner.run_layers(cache, h, a, (l0, l1))
        return cache, hidden

    def record_dtype(self) -> torch.dtype:
        """The dtype KV records are stored in: the one asked for, else the pool's own, never wider than the model
        computes in (chunks/record.py ``kv_record_dtype``)."""
        asked = parse_dtype(self.storage_dtype) if self.storage_dtype else self.pool.dtype
        return kv_record_dtype(asked, self.runner.dtype)

    # ------------------------------------------------------------------------------------ planning
    def io_model(self, calibrated: bool = True) -> IOModel:
        """The pool's read bandwidth and per-read latency; the executor keeps ``depth`` reads in flight, so each
        read waits latency / depth beyond its bytes."""
        cell = self.chunk_tokens * self.runner.shape.kv_bytes_per_token_layer(self.record_dtype()) + HEADER_SIZE
        # no device in service (0 B/s, e.g. the shared store down): reads predicted at 1 B/s, so every plan recomputes
        bandwidth = self.cost.loaded_rate(max(1.0, float(self.pool.read_bandwidth)))   # + host-to-device on a GPU
        if calibrated and self.calibration is not None:
            bandwidth /= self.calibration.io
        depth = max(2, getattr(self.pool, "parallelism", 1))
        return IOModel(bandwidth=bandwidth, cell_bytes=cell,
                       step_latency=float(getattr(self.pool, "read_latency", 0.0)) / depth)

    def planned_cost(self) -> CostModel:
        """The cost model plans are made with: the profile, scaled by the speed measured since."""
        return self.cost if self.calibration is None else self.calibration.scaled(self.cost)

    def planner(self) -> Planner:
        """Plans on the calibrated model, holding cacheflow's choice under the speed band the calibration's own
        error calls for (cost/calibration.py: the configured band until each side was seen twice, then narrower
        on a steady machine)."""
        config = self.planner_config
        if self.calibration is not None:
            config = replace(config, compute_band=self.calibration.band("compute", config.compute_band),
                             io_band=self.calibration.band("io", config.io_band))
        return Planner(self.planned_cost(), self.io_model(), self.runner.num_layers, self.chunk_tokens, config)

    def _observe(self, events) -> None:
        if self.calibration is not None:
            self.calibration.observe(events, self.cost, self.io_model(calibrated=False).cells_time(1),
                                     self.chunk_tokens)

    def lookup(self, context_ids: torch.Tensor, query_len: int) -> tuple[Request, list[list[ChunkKey]]]:
        """Record keys of the context and how many of its chunks (a prefix) the pool holds."""
        keys = self.keys(context_ids)
        return Request(context_ids.numel(), query_len, self.stored_tokens(context_ids) // self.chunk_tokens), keys

    def stored_tokens(self, context_ids: torch.Tensor) -> int:
        """Tokens of the context's longest prefix of whole chunks whose records the pool holds for every layer
        group (one hash pass; no record keys built)."""
        return self.pool.longest_prefix(context_ids, self.model_id, self.groups)

    def plan(self, context_ids, query_len: int, strategy: str = "cacheflow") -> tuple[Plan, list[list[ChunkKey]], float]:
        ids = as_ids(context_ids)
        t0 = time.perf_counter()
        req, keys = self.lookup(ids, query_len)
        lookup = time.perf_counter() - t0
        return self.planner().plan(strategy, req), keys, lookup

    # ----------------------------------------------------------------------------------- restoring
    def restore(self, context_ids, query_ids, strategy: str = "cacheflow") -> RestoreResult:
        """Rebuild the context's KV with ``strategy``, prefill the query, return logits + KV + what happened."""
        ctx, query = _check_request(context_ids, query_ids)
        t0 = time.perf_counter()
        plan, keys, lookup = self.plan(ctx, query.numel(), strategy)
        planned = time.perf_counter()
        execution = self.executor.run(plan, keys, torch.cat([ctx, query]))
        self._observe(execution.timeline)
        timings = execution.timings
        timings.lookup_s, timings.plan_s = lookup, planned - t0 - lookup
        timings.ttft_s += planned - t0
        length = ctx.numel() + query.numel()
        return RestoreResult(execution.logits, execution.cache.layer_kv(length), plan, timings,
                             execution.timeline, execution.fallback_chunks)

    def restore_batch(self, requests, strategy: str = "cacheflow", scheduler: str | None = None) -> list[RestoreResult]:
        """Restore a batch that arrives together; one result per request, TTFT measured from the batch start.

        scheduler "batch" (default for cacheflow): global compute and I/O pointers over the whole batch
        (planner/batch.py). scheduler "fcfs" (default otherwise): each request restored in turn with its own
        ``strategy`` plan, as an engine without batch awareness does; "sjf": the same, shortest predicted
        restoration first (what reordering alone gains)."""
        scheduler = scheduler or ("batch" if strategy == "cacheflow" else "fcfs")
        if scheduler not in ("batch", "fcfs", "sjf"):
            raise KVFlowError(f"unknown scheduler {scheduler!r}: use batch, fcfs or sjf")
        if scheduler == "batch" and strategy != "cacheflow":
            raise KVFlowError("the batch-aware scheduler plans its own splits: use strategy='cacheflow'")
        pairs = [_check_request(c, q) for c, q in requests]
        t0 = time.perf_counter()
        if scheduler in ("fcfs", "sjf"):
            order = list(range(len(pairs)))
            if scheduler == "sjf":
                planner = self.planner()
                work = [planner.plan(strategy, self.lookup(ctx, q.numel())[0]).predicted.ttft_s for ctx, q in pairs]
                order.sort(key=lambda r: (work[r], r))
            results: list[RestoreResult | None] = [None] * len(pairs)
            for r in order:
                offset = time.perf_counter() - t0
                res = self.restore(*pairs[r], strategy)
                res.timings.start_s = offset
                res.timings.ttft_s += offset
                results[r] = res
            return results
        looked = [self.lookup(ctx, query.numel()) for ctx, query in pairs]
        lookup = time.perf_counter() - t0
        batch = self.plan_batch([req for req, _ in looked])
        planned = time.perf_counter()
        jobs = [Job(plan, keys, torch.cat(pair)) for plan, (_, keys), pair in zip(batch.plans, looked, pairs)]
        executions = self.executor.run_batch(jobs, list(batch.compute_order), list(batch.io_order),
                                             list(batch.query_order))
        self._observe([e for ex in executions for e in ex.timeline])
        results = []
        for plan, pair, ex in zip(batch.plans, pairs, executions):
            ex.timings.lookup_s, ex.timings.plan_s = lookup, planned - t0 - lookup
            ex.timings.ttft_s += planned - t0
            length = pair[0].numel() + pair[1].numel()
            results.append(RestoreResult(ex.logits, ex.cache.layer_kv(length), plan, ex.timings, ex.timeline,
                                         ex.fallback_chunks))
        return results

    def plan_batch(self, requests: list[Request]) -> BatchPlan:
        return plan_batch(self.planner(), requests)
