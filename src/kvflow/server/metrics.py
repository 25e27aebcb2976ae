"""Prometheus metrics of one server: latency histograms observed by the engine loop, and everything else read from
the engine, its block manager and its pool tier at scrape time (a custom collector: no double bookkeeping)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvflow import spin

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, engine, loop_ref=lambda: None):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("kvflow_time_to_first_token_seconds", "request received -> first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvflow_inter_token_latency_seconds", "gap between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.responses = Counter("kvflow_http_responses", "HTTP responses by route and status",
                                 ["route", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, loop_ref))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine, loop_ref):
        self.engine, self.loop_ref = engine, loop_ref

    def describe(self):
        return []

    def collect(self):
        e, st = self.engine, self.engine.stats
        loop = self.loop_ref()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            return g

        def counter(name, doc, value, labels=None):
            c = CounterMetricFamily(name, doc, labels=list(labels or {}))
            c.add_metric(list((labels or {}).values()), value)
            return c

        yield gauge("kvflow_running_sequences", "sequences being prefilled or decoded", e.num_running)
        yield gauge("kvflow_waiting_sequences", "sequences admitted by the server, waiting for blocks", e.num_waiting)
        yield gauge("kvflow_queue_length", "requests not yet handed to the engine",
                    loop.queue_length if loop is not None else 0)
        yield gauge("kvflow_inflight_requests", "requests the server holds a handle for (admitted, not finished)",
                    len(loop.handles) if loop is not None else 0)
        yield gauge("kvflow_process_threads", "threads of the server process (the spin governor's throttle thread, which "
                    "comes and goes, not counted)",
                    sum(t.name != spin.THROTTLE_THREAD for t in threading.enumerate()))
        governor = spin.current()
        if governor is not None:
            yield gauge("kvflow_omp_spinning", "1 while OpenMP workers spin at barriers (other processes leave the "
                        "cores free), 0 while throttled (kvflow/spin.py)", float(governor.spinning))
            yield counter("kvflow_omp_spin_switches", "times the spin governor switched", governor.switches)
        yield gauge("kvflow_kv_blocks_total", "resident KV blocks", e.num_blocks)
        yield gauge("kvflow_kv_block_usage_ratio", "share of resident KV blocks held by sequences", e.blocks.usage)
        yield gauge("kvflow_kv_cached_blocks", "resident blocks holding a hashed prefix", len(e.blocks.cached))
        hits = CounterMetricFamily("kvflow_prefix_hit_tokens", "prompt tokens by where their KV came from",
                                   labels=["source"])
        for source, v in (("resident", st.resident_hit_tokens), ("pool", st.pool_hit_tokens),
                          ("miss", st.miss_tokens)):
            hits.add_metric([source], v)
        yield hits
        reqs = CounterMetricFamily("kvflow_prefix_hit_requests", "requests by their longest prefix hit",
                                   labels=["source"])
        for source, v in list(st.requests_by_hit.items()):
            reqs.add_metric([source], v)
        yield reqs
        yield counter("kvflow_requests", "requests admitted", st.requests)
        yield counter("kvflow_prompt_tokens", "prompt tokens admitted", st.prompt_tokens)
        yield counter("kvflow_generation_tokens", "tokens generated", st.generated_tokens)
        yield counter("kvflow_computed_tokens", "tokens run through the model by engine steps", st.computed_tokens)
        yield counter("kvflow_engine_steps", "engine steps", st.steps)
        yield counter("kvflow_preemptions", "sequences preempted for lack of blocks", st.preemptions)
        yield counter("kvflow_swaps", "decoding sequences swapped out to the pool for a first token", st.swaps)
        yield counter("kvflow_kv_block_evictions", "cached resident blocks reused for new data", e.blocks.evictions)
        yield counter("kvflow_engine_step_errors", "engine steps that raised", loop.step_errors if loop else 0)
        yield counter("kvflow_requests_failed", "requests ended alone by an error of their own inside a step",
                      st.failed)
        yield counter("kvflow_requests_aborted", "requests aborted (client gone, or a sibling prompt failed)",
                      st.aborted)
        el = e.elastic
        if el is not None:                  # engine.elastic_reserve (engine/elastic.py)
            es = el.stats
            yield gauge("kvflow_elastic_reserve_blocks", "KV blocks the activation reserve lends", es.lent_blocks)
            yield gauge("kvflow_elastic_lent_blocks", "reserve blocks lent to the block manager now",
                        es.lent_blocks if el.lent else 0)
            yield counter("kvflow_elastic_lends", "times the reserve was lent (decode-only phases)", es.lends)
            yield counter("kvflow_elastic_takebacks", "times the reserve was taken back before a prefill", es.takebacks)
            yield counter("kvflow_elastic_blocks_moved", "lent blocks copied to base blocks by take-backs",
                          es.blocks_moved)
            yield counter("kvflow_elastic_takeback_preemptions", "sequences preempted by take-backs", es.preempted)
            yield counter("kvflow_elastic_takeback_failures", "take-backs that could not complete", es.failures)
            yield counter("kvflow_elastic_failed_admissions", "requests not admitted: their take-back failed",
                          es.failed_admissions)
            yield gauge("kvflow_elastic_takeback_p50_seconds", "take-back latency, median of the last 4096",
                        es.takeback_percentile(50))
            yield gauge("kvflow_elastic_takeback_p99_seconds", "take-back latency, P99 of the last 4096",
                        es.takeback_percentile(99))
        pool = e.pool
        c = pool.counters if pool is not None else {}
        yield counter("kvflow_pool_restores", "restorations from the pool", c.get("restores", 0))
        yield counter("kvflow_pool_restore_errors", "restorations that failed (recomputed)", c.get("restore_errors", 0))
        yield counter("kvflow_pool_loads", "pool hits read straight into their blocks", c.get("loads", 0))
        yield counter("kvflow_pool_load_tokens", "tokens those loads read", c.get("load_tokens", 0))
        yield counter("kvflow_pool_load_errors", "loads that failed (recomputed)", c.get("load_errors", 0))
        yield counter("kvflow_pool_writes_dropped", "pool writes dropped because the write queue was full",
                      c.get("writes_dropped", 0))
        yield counter("kvflow_pool_records_dropped", "records in dropped pool writes", c.get("records_dropped", 0))
        yield counter("kvflow_pool_records_written", "records the writer stored", c.get("records_written", 0))
        yield counter("kvflow_pool_write_errors", "pool writes that failed", c.get("write_errors", 0))
        yield gauge("kvflow_pool_write_queue", "pool writes waiting", pool.writes.pending() if pool else 0)
        yield counter("kvflow_pool_restore_seconds", "seconds spent restoring", pool.restore_s if pool else 0.0)
        yield counter("kvflow_pool_blocked_io_seconds", "seconds compute waited for pool reads",
                      pool.blocked_io_s if pool else 0.0)
        loaded = CounterMetricFamily("kvflow_restored_tokens", "restored context tokens by strategy and how",
                                     labels=["strategy", "how"])
        if pool is not None:
            for strategy, v in list(pool.loaded_tokens.items()):         # a snapshot: the worker adds strategies
                loaded.add_metric([strategy, "loaded"], v)
            for strategy, v in list(pool.recomputed_tokens.items()):
                loaded.add_metric([strategy, "recomputed"], v)
        yield loaded
        if pool is not None:
            ps = pool.pool.stats()
            yield gauge("kvflow_pool_used_bytes", "bytes stored in the pool", ps["used"])
            yield gauge("kvflow_pool_capacity_bytes", "pool capacity", ps["capacity"])
            yield gauge("kvflow_pool_read_bandwidth_bytes_per_second", "read bandwidth the organizer measures",
                        ps["read_bandwidth"])
            yield counter("kvflow_pool_read_bytes", "bytes read from pool devices",
                          sum(d.get("read_bytes", 0) for d in ps["devices"]))
            yield counter("kvflow_pool_write_bytes", "bytes written to pool devices",
                          sum(d.get("write_bytes", 0) for d in ps["devices"]))
