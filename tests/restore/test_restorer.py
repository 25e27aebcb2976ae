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


def test_a_bf16_models_kv_is_stored_in_bf16_even_in_an_fp32_pool():
    """Widening a bf16 model's K/V to fp32 records doubles the bytes every load moves and adds no information; the
    records keep the model's width, and a load restores the bf16 cache bit for bit."""
    from kvflow.model import load_model
    bf16 = load_model("tiny@layers=2", dtype="bfloat16")
    pool = KVPool.memory("64M", chunk_tokens=32)                          # storage_dtype float32 (the default)
    restorer = Restorer(bf16, pool, cost=synthetic_cost(bf16))
    assert restorer.record_dtype() == torch.bfloat16
    stored = restorer.store(ids(64, 1))
    per_layer = 32 * bf16.shape.kv_bytes_per_token_layer(torch.bfloat16) + HEADER_SIZE
    assert stored.bytes_written == stored.chunks_written * bf16.num_layers * per_layer
    out = restorer.restore(ids(64, 1), ids(4, 2), "load")
    ref_kv, ref_logits = bf16.reference_prefill(torch.cat([ids(64, 1), ids(4, 2)]))
    assert all(torch.equal(k[..., :64, :], r[..., :64, :]) for (k, _), (r, _) in zip(out.kv, ref_kv))
    fp32 = Restorer(load_model("tiny@layers=2"), pool, cost=synthetic_cost(bf16))
    assert fp32.record_dtype() == torch.float32                           # an fp32 model keeps the pool's fp32


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


def test_the_models_fingerprint_is_taken_when_the_restorer_is_built_not_by_the_first_lookup():
    """The fingerprint hashes every weight (~30 ms on smollm2-135m, paid by a served engine's first request when it
    was taken lazily); a restorer takes it once, at build, and keys records with it."""
    from kvflow.model import load_model
    runner = load_model("tiny@layers=2")
    assert "fingerprint" not in vars(runner)                 # a cached_property: not computed by loading
    restorer = Restorer(runner, KVPool.memory("16M", chunk_tokens=32), cost=synthetic_cost(runner))
    assert "fingerprint" in vars(runner) and restorer.model_id == runner.fingerprint
    assert restorer.stored_tokens(ids(64, 1)) == 0
