"""The restorer's planning inputs describe the pool it plans over."""

import torch

from kvflow import KVPool, Restorer
from kvflow.chunks.record import HEADER_SIZE
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost


def test_a_restorer_without_its_own_dtype_plans_and_counts_bytes_in_the_pools_dtype(tiny):
    pool = KVPool.memory("64M", chunk_tokens=32, storage_dtype="bfloat16")
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))          # storage_dtype=None: the pool's
    fp32 = Restorer(tiny, KVPool.memory("64M", chunk_tokens=32), cost=synthetic_cost(tiny))
    cell_fp32 = fp32.io_model().cell_bytes - HEADER_SIZE
    assert restorer.io_model().cell_bytes - HEADER_SIZE == cell_fp32 // 2
    stored = restorer.store(ids(200, 1))
    assert stored.bytes_written == stored.chunks_written * tiny.num_layers * (cell_fp32 // 2 + HEADER_SIZE)
    out = restorer.restore(ids(200, 1), ids(5, 2), "load")
    assert out.logits.shape[-1] == tiny.config.vocab_size             # bf16 records restore (not exactly: lossy)


def test_the_io_model_prices_the_pools_per_read_latency(tiny):
    pool = KVPool.memory("64M", chunk_tokens=32, devices=2)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    assert restorer.io_model().step_latency == 0.0
    pool.set_throttle(1e9, latency_s=0.004)
    depth = max(2, pool.parallelism)
    assert restorer.io_model().step_latency == 0.004 / depth
    context, query = ids(100, 3), ids(4, 4)
    restorer.store(context)
    assert_exact(tiny, restorer.restore(context, query, "cacheflow"), context, query)
