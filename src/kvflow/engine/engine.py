"""LLMEngine: requests in, tokens out, one ``step()`` at a time.

    engine = LLMEngine(load_model("tiny"), EngineConfig(block_size=16))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))        # -> [Completion(token_ids=[...], ...)]

    sid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...                                    # RequestOutput per sequence that moved

A step: restorations that finished since the last step are copied into their blocks; the scheduler picks prefill
chunks and decodes under the token budget; sequences admitted with a pool hit are handed to the restoration worker
(PoolTier, one thread: the step's hits go together through the batch-aware scheduler) and skip the steps until it
returns — the other sequences keep decoding meanwhile; every other scheduled token runs in one forward pass
(BatchRunner); sampled tokens are appended, stop conditions checked, finished sequences stored to the pool and
their blocks freed. Not thread-safe: one thread drives an engine (the server's engine loop).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvflow.engine.block_manager import BlockManager
from kvflow.engine.config import EngineConfig
from kvflow.engine.elastic import ElasticReserve
from kvflow.engine.model_runner import BatchRunner, StepItem
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.engine.pool_tier import PoolTier
from kvflow.engine.reserve import TRIM_TOKENS, MemoryBudget, auto_kv_budget, engine_reserve, weight_bytes
from kvflow.engine.sampling import SamplingError, SamplingParams, sample
from kvflow.engine.scheduler import Scheduler
from kvflow.engine.sequence import Sequence, Status
from kvflow.errors import ConfigError, KVFlowError
from kvflow.model.host_memory import hold_to_live_set, release_freed_memory
from kvflow.model.runner import ModelRunner
from kvflow.threads import single_threaded

log = logging.getLogger("kvflow.engine")


class RequestError(KVFlowError):
    """A request the engine cannot serve as asked (the server answers 400)."""


@dataclass(slots=True)
class RequestOutput:
    seq_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens not computed: resident + pool hits
    error: str | None = None    # finish_reason "error": this request alone failed inside a step (the others go on)


@dataclass(slots=True)
class Completion:
    seq_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class _RestoreJob:
    future: Future
    scheduled: list            # the Scheduled entries it restores, in request order


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0        # tokens run through the model by steps (prefill chunks + decodes)
    generated_tokens: int = 0
    decode_steps_batched: int = 0   # decode tokens that shared a forward pass with another sequence
    resident_hit_tokens: int = 0
    pool_hit_tokens: int = 0
    miss_tokens: int = 0
    requests_by_hit: dict = field(default_factory=lambda: {"resident": 0, "pool": 0, "miss": 0})
    preemptions: int = 0
    swaps: int = 0                  # decoding sequences swapped out for a first token (first-token policy)
    failed: int = 0                 # requests ended by an error of their own inside a step (finish_reason "error")


def model_len(runner: ModelRunner, cfg: EngineConfig) -> int:
    """The longest context the engine accepts: ``engine.max_model_len``, else the model's positions."""
    return cfg.max_model_len or getattr(runner.config, "max_position_embeddings", 2**31)


def longest_sequence(runner: ModelRunner, cfg: EngineConfig, num_blocks: int) -> int:
    """The longest sequence an engine of ``num_blocks`` base blocks can hold (what its activation reserve covers)."""
    return min(model_len(runner, cfg), num_blocks * cfg.block_size)


class LLMEngine:
    def __init__(self, runner: ModelRunner, config: EngineConfig | None = None, *, restorer=None, tokenizer=None):
        self.runner, self.config, self.tokenizer = runner, config or EngineConfig(), tokenizer
        cfg = self.config
        per_block = cfg.block_size * runner.shape.kv_bytes_per_token(runner.dtype)
        self.max_model_len = model_len(runner, cfg)
        if cfg.elastic_reserve and runner.device.type != "cpu":
            raise ConfigError(f"engine.elastic_reserve runs on the CPU only: its {runner.device.type} path (mapping "
                              "and unmapping the lent range of device memory) is not written; serve without it")
        if cfg.holds_to_live_set:   # before any reserve is measured: the probe and the served steps, one heap regime
            hold_to_live_set()
        self.kv_sizing = None       # engine.kv_budget auto: how it was sized (reserve.py)
        if cfg.auto_kv_budget:
            self.kv_sizing = auto_kv_budget(runner, cfg, self.max_model_len,
                                            engine_reserve(runner, cfg, self.max_model_len)[0])
            log.info("%s", self.kv_sizing.line())
        budget = self.kv_sizing.budget if self.kv_sizing else cfg.kv_budget
        self.num_blocks = cfg.num_blocks or budget // per_block
        if self.num_blocks < 1:
            raise ConfigError(f"engine.kv_budget {cfg.kv_budget} B holds no block ({per_block} B per block)")
        longest = longest_sequence(runner, cfg, self.num_blocks)
        self.elastic = (ElasticReserve.create(runner, cfg, self.num_blocks, per_block, longest)
                        if cfg.elastic_reserve else None)
        lent = self.elastic.lent_ids if self.elastic else []
        self.cache = PagedKVCache(runner.num_layers, self.num_blocks + len(lent), cfg.block_size, runner.kv_heads,
                                  runner.head_dim, runner.dtype, self.elastic.region.kv if self.elastic else None,
                                  runner.device)
        self.blocks = BlockManager(self.num_blocks + len(lent), cfg.block_size, cfg.enable_prefix_caching, lent)
        self.batch_runner = BatchRunner(runner, self.cache, longest)
        began = time.perf_counter()
        reserve, how = engine_reserve(runner, cfg, longest)       # stated, measured or estimated: reserve.py
        self.memory = MemoryBudget(weight_bytes(runner), reserve, self.num_blocks * per_block, self.num_blocks,
                                   cfg.block_size, len(lent))
        log.info("activation reserve %s%s (engine/reserve.py)", how, f" in {time.perf_counter() - began:.1f} s"
                 if how == "measured" else " from the model's shape, no step run" if how == "estimated" else "")
        log.info("%s", self.memory.line())
        self.pool = (PoolTier(restorer, cfg.strategy, cfg.write_queue, load=cfg.pool_load) if restorer is not None
                     else None)
        if restorer is not None and cfg.holds_to_live_set:
            restorer.executor.transfer.staging.keep_bytes = 0   # no staging kept between restores: not in the budget
        self._restorer = (ThreadPoolExecutor(1, thread_name_prefix="kvflow-restore", initializer=single_threaded)
                          if self.pool else None)     # one OpenMP team per process: kvflow/threads.py
        self._jobs: list[_RestoreJob] = []
        self.scheduler = Scheduler(cfg, self.blocks, self.pool.lookup if self.pool else None, self._store_preempted,
                                   self.pool.choose if self.pool else None)
        if self.elastic is not None:
            self.elastic.attach(self)
        eos = getattr(runner.hf_model.generation_config, "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.vocab_size = runner.config.vocab_size
        self.seqs: dict[int, Sequence] = {}
        self.stats = EngineStats()
        self._next_id = 0

    # -------------------------------------------------------------------------------------- requests
    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer (give token ids)")
            prompt = self.tokenizer.encode(prompt)
        ids = list(prompt)
        self.check_prompt(ids, params)
        seq = Sequence(self._next_id, ids, len(ids), params, generator=params.generator(),
                       stop_token_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                           else self.eos_token_ids))
        self._next_id += 1
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(ids)
        return seq.seq_id

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError/SamplingError for a request this engine cannot serve."""
        if not ids:
            raise RequestError("the prompt is empty")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len or total > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                               f"context of {self.max_model_len} tokens")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        capacity = self.num_blocks * self.config.block_size
        if total > capacity:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's "
                               f"KV budget of {capacity} tokens")
        if not self.config.chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise RequestError(f"prompt of {len(ids)} tokens exceeds max_num_batched_tokens "
                               f"({self.config.max_num_batched_tokens}) and chunked prefill is off")
        if params.stop and self.tokenizer is None:
            raise SamplingError("stop strings need a tokenizer")

    def abort(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None and not seq.finished:
            seq.finish_reason = "abort"
            if seq.restoring:
                seq.abort_pending = True     # its blocks are freed when the restoration returns
            else:
                self.scheduler.finish(seq)
            self.stats.aborted += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        outputs = self._finish_restores()
        if self.elastic is not None:          # lend the reserve, or take it back before a prefill (engine/elastic.py)
            outputs += [RequestOutput(s.seq_id, [], "", True, s.finish_reason, s.num_prompt_tokens, s.num_output, 0)
                        for s in self.elastic.before_schedule()]
        plan = self.scheduler.schedule()
        if self.elastic is not None:
            self.elastic.check(plan)
        self.stats.preemptions += len(plan.preempted)
        self.stats.swaps += len(plan.swapped)
        if not plan.scheduled:
            if self._jobs and not outputs:         # only restorations in flight: wait a little for one
                wait([j.future for j in self._jobs], timeout=0.01, return_when=FIRST_COMPLETED)
                outputs = self._finish_restores()
            return outputs
        self.stats.steps += 1
        logits: dict[int, object] = {}
        restoring = [s for s in plan.scheduled if s.seq.pool_restore]
        if restoring and self.config.async_restore:
            self._submit(restoring)
        elif restoring:
            self._restore_now(restoring, logits)
        for s in plan.scheduled:
            if s.seq.pool_load:
                self._load(s)
        for seq in plan.admitted:
            if seq.num_preemptions == 0 and not seq.restoring:
                self._count_hit(seq)
        items, sampled = [], []
        for s in plan.scheduled:
            if s.seq.restoring or s.seq.seq_id in logits or s.seq.pool_restore:
                continue
            seq, end = s.seq, s.start + s.num_tokens
            items.append(StepItem(seq.block_table, s.start, seq.token_ids[s.start:end], end == seq.num_tokens))
            if end == seq.num_tokens:
                sampled.append(seq)
        greedy: dict[int, int] = {}
        if items:
            step_logits = self.batch_runner.execute(items)
            logits.update((seq.seq_id, row) for seq, row in zip(sampled, step_logits))
            if any(seq.params.greedy for seq in sampled):       # one argmax for the step's rows, not one per row
                greedy = dict(zip((seq.seq_id for seq in sampled), step_logits.argmax(-1).tolist()))
            computed = sum(len(it.token_ids) for it in items)
            self.stats.computed_tokens += computed
            if self.config.holds_to_live_set and computed >= TRIM_TOKENS:    # each large step starts from the
                release_freed_memory()                                   # heap the probe measured from
            if len(items) > 1:
                self.stats.decode_steps_batched += sum(1 for it in items if len(it.token_ids) == 1)
        for s in plan.scheduled:
            seq = s.seq
            if seq.restoring:
                continue
            seq.num_computed = s.start + s.num_tokens
            seq.pool_restore = 0
            self.blocks.commit(seq)
            if seq.seq_id in logits and seq.num_computed == seq.num_tokens:
                outputs.append(self._next_token(seq, logits[seq.seq_id], greedy.get(seq.seq_id)))
        return outputs

    def _count_hit(self, seq: Sequence) -> None:
        st = self.stats
        st.resident_hit_tokens += seq.resident_hit_tokens
        st.pool_hit_tokens += seq.pool_hit_tokens
        st.miss_tokens += seq.num_prompt_tokens - seq.resident_hit_tokens - seq.pool_hit_tokens
        kind = "pool" if seq.pool_hit_tokens else "resident" if seq.resident_hit_tokens else "miss"
        st.requests_by_hit[kind] += 1

    # ----------------------------------------------------------------------------- pool restoration
    @staticmethod
    def _requests(restoring) -> list[tuple[list[int], list[int]]]:
        """(context [0, pool_restore), query: this step's slice after it) per restoring sequence."""
        return [(s.seq.token_ids[:s.start], s.seq.token_ids[s.start:s.start + s.num_tokens]) for s in restoring]

    def _submit(self, restoring) -> None:
        """Restore this step's pool hits on the worker (together: the batch-aware scheduler) while steps go on."""
        for s in restoring:
            s.seq.restoring = True
        self._jobs.append(_RestoreJob(self._restorer.submit(self.pool.restore, self._requests(restoring)),
                                      restoring))

    def _finish_restores(self) -> list[RequestOutput]:
        """Copy the KV of every finished restoration into its blocks and sample where the prompt is complete."""
        outputs = []
        for job in [j for j in self._jobs if j.future.done()]:
            self._jobs.remove(job)
            try:
                results = job.future.result()
            except Exception as err:    # a failed restoration is a recompute, never a failed request
                log.warning("pool restore failed, recomputing: %s", err)
                self.pool.counters["restore_errors"] += 1
                results = None
            for i, s in enumerate(job.scheduled):
                seq = s.seq
                seq.restoring = False
                if seq.abort_pending:
                    seq.abort_pending = False
                    self.scheduler.finish(seq)
                    continue
                seq.pool_restore = 0
                if results is None:
                    seq.pool_hit_tokens = 0          # the next steps compute it from its resident hit
                else:
                    end = s.start + s.num_tokens
                    self.cache.write_sequence(seq.block_table, results[i].kv, seq.num_computed, end)
                    self.stats.computed_tokens += s.num_tokens
                    seq.num_computed = end
                    self.blocks.commit(seq)
                    if end == seq.num_tokens:
                        outputs.append(self._next_token(seq, results[i].logits))
                if seq.num_preemptions == 0:
                    self._count_hit(seq)
        return outputs

    def _load(self, s) -> None:
        """A pool hit admitted as a load (PoolTier.choose): the records of [num_computed, pool_load) — past the
        resident blocks — are read into the sequence's blocks (PoolTier.load) and the step computes from where
        they end; from the first miss on if a record is missing or bad (a miss, never a wrong token)."""
        seq = s.seq
        try:
            got = self.pool.load(seq.token_ids, seq.num_computed, seq.pool_load, self.cache, seq.block_table)
        except Exception as err:      # a failed load is a recompute, never a failed request
            log.warning("pool load failed, recomputing: %s", err)
            self.pool.counters["load_errors"] += 1
            got = seq.num_computed
        if got < seq.pool_load:
            if seq.num_preemptions == 0:
                seq.pool_hit_tokens = got - seq.num_computed
            s.start = got
        seq.pool_load = 0

    def _restore_now(self, restoring, logits: dict) -> None:
        """Pool hits of this step restored inside the step (async_restore off)."""
        try:
            results = self.pool.restore(self._requests(restoring))
        except Exception as err:    # a failed restoration is a recompute, never a failed request
            log.warning("pool restore failed, recomputing: %s", err)
            self.pool.counters["restore_errors"] += 1
            for s in restoring:
                s.seq.pool_hit_tokens, s.seq.pool_restore = 0, 0
                s.start = s.seq.num_computed
            return
        for s, res in zip(restoring, results):
            seq, end = s.seq, s.start + s.num_tokens
            self.cache.write_sequence(seq.block_table, res.kv, seq.num_computed, end)
            self.stats.computed_tokens += s.num_tokens
            logits[seq.seq_id] = res.logits if end == seq.num_tokens else None   # None: restored, not sampled yet
            seq.pool_restore = 0

    def _next_token(self, seq: Sequence, logits, best: int | None = None) -> RequestOutput:
        """Sample and append ``seq``'s next token (``best``: the logits' argmax, computed with the step's other rows,
        which greedy sampling picks). What fails here is this request's own (its sampling, its stop strings, its
        text): it ends alone with finish_reason "error", the step's other requests go on."""
        try:
            token = best if best is not None and seq.params.greedy else sample(logits, seq.params, seq.generator)
            return self._append(seq, token)
        except Exception as err:
            log.exception("request %d failed inside a step; the others go on", seq.seq_id)
            seq.finish_reason = "error"
            if not seq.finished:
                self.scheduler.finish(seq)
            self.seqs.pop(seq.seq_id, None)
            self.stats.failed += 1
            return RequestOutput(seq.seq_id, [], "", True, "error", seq.num_prompt_tokens, seq.num_output,
                                 seq.resident_hit_tokens + seq.pool_hit_tokens, f"{type(err).__name__}: {err}")

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        now = time.perf_counter()
        seq.first_token_s = seq.first_token_s or now
        seq.last_token_s = now
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        p = seq.params
        delta = ""
        if token in seq.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_output >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids)
            for stop in p.stop:
                at = text.find(stop, max(0, len(seq.text) - len(stop)))
                if at >= 0:
                    text, seq.finish_reason, seq.stop_text = text[:at], "stop", stop
            if seq.finish_reason is None:
                text = text.rstrip("\ufffd")       # an incomplete UTF-8 sequence: wait for the next token
            if text.startswith(seq.text):
                delta, seq.text = text[len(seq.text):], text
        finished = seq.finish_reason is not None
        if finished:
            self._store(seq)
            self.scheduler.finish(seq)
            self.seqs.pop(seq.seq_id, None)
            self.stats.finished += 1
        return RequestOutput(seq.seq_id, [token], delta, finished, seq.finish_reason, seq.num_prompt_tokens,
                             seq.num_output, seq.resident_hit_tokens + seq.pool_hit_tokens)

    def _store(self, seq: Sequence, tail: bool = False) -> None:
        if self.pool is not None and seq.block_table:
            self.pool.store(seq.token_ids, seq.num_computed, self.cache, seq.block_table, tail=tail)

    def _store_preempted(self, seq: Sequence) -> None:
        """A preempted (or swapped) sequence's KV; a decoder's partial last chunk too: it comes back with exactly
        these tokens (its lookup asks for that tail) and reads them instead of computing them again."""
        self._store(seq, tail=seq.num_computed == seq.num_tokens - 1)

    # ------------------------------------------------------------------------------------ one-shot
    def generate(self, prompts: list[list[int] | str], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[Completion]:
        """Run ``prompts`` together (continuous batching) to completion; one Completion per prompt, in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[int, Completion] = {}
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        texts: dict[int, str] = {i: "" for i in ids}
        while len(done) < len(ids):
            for out in self.step():
                tokens[out.seq_id] += out.new_token_ids
                texts[out.seq_id] += out.text_delta
                if out.finished:
                    done[out.seq_id] = Completion(out.seq_id, tokens[out.seq_id], texts[out.seq_id],
                                                  out.finish_reason, out.prompt_tokens, out.cached_tokens)
        return [done[i] for i in ids]

    def close(self) -> None:
        """Wait for restorations in flight, flush pending pool writes, stop the worker and the writer."""
        if self.pool is not None:
            self._restorer.shutdown(wait=True)
            self.pool.close()

    # --------------------------------------------------------------------------------------- gauges
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
