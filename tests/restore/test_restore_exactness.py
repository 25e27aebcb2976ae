"""Every restoration strategy yields the KV and next-token logits of one fresh full prefill (fp32 <= 1e-4, same
argmax) — whatever the lengths, chunk size, throttle or cost model make the planner choose, and when chunks are
missing or corrupt."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVPool, Restorer
from kvflow.cost import CostModel
from kvflow.planner import STRATEGIES
from tests.conftest import max_abs_diff_kv

TOL = 1e-4
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def synthetic_cost(runner, b=2e-8) -> CostModel:
    """Plans depend on the cost model; exactness must not. Tests vary it to reach every kind of plan."""
    return CostModel(runner.name, runner.fingerprint, 2, a=2e-6, b=b, d=3e-4, e=2e-4, head=1e-4,
                     kv_bytes_per_token_layer=runner.kv_bytes_per_token() // runner.num_layers,
                     num_layers=runner.num_layers)


def ids(n, seed):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


def assert_exact(runner, out, context, query):
    ref_kv, ref_logits = runner.reference_prefill(torch.cat([context, query]))
    assert max_abs_diff_kv(out.kv, ref_kv) <= TOL
    assert (out.logits - ref_logits).abs().max().item() <= TOL
    assert out.logits.argmax() == ref_logits.argmax()


@SETTINGS
@given(n=st.integers(1, 700), q=st.integers(1, 40), chunk=st.sampled_from([16, 32, 64, 128]),
       rho=st.sampled_from([None, 0.25, 1.0, 8.0]), b=st.floats(1e-9, 1e-6), seed=st.integers(0, 2**16))
def test_every_strategy_equals_full_prefill(tiny, n, q, chunk, rho, b, seed):
    pool = KVPool.memory("64M", chunk_tokens=chunk, devices=2)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny, b))
    context, query = ids(n, seed), ids(q, seed + 1)
    restorer.store(context)
    if rho is not None:
        pool.set_throttle(rho * restorer.cost.short_context_rate(chunk) * 50)  # keep tests fast, ratios intact
    for strategy in STRATEGIES:
        out = restorer.restore(context, query, strategy)
        assert_exact(tiny, out, context, query)
        assert out.plan.num_chunks == n // chunk


def test_a_partly_stored_context_restores_its_stored_prefix_and_recomputes_the_rest(tiny):
    pool = KVPool.memory("64M", chunk_tokens=32)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(300, 5), ids(7, 6)
    restorer.store(context[:130])                   # 4 full chunks stored
    for strategy in STRATEGIES:
        out = restorer.restore(context, query, strategy)
        assert out.plan.num_chunks == 4
        assert_exact(tiny, out, context, query)


def _memory_of(pool, dev):
    device = pool.slots[dev].device
    return getattr(device, "inner", device)._mem


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_corrupt_chunk_is_recomputed_never_served(tiny, strategy):
    pool = KVPool.memory("64M", chunk_tokens=32)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(320, 8), ids(5, 9)
    restorer.store(context)
    victim = restorer.keys(context)[7][2]            # chunk 7 (of 10), layer 2
    dev, offset = next((d, off) for digest, d, off, _len, _seq in pool.entries() if digest == victim.digest)
    _memory_of(pool, dev)[offset + 300] ^= 0x55      # a payload byte
    pool.set_throttle(restorer.cost.short_context_rate(32) * 50)
    out = restorer.restore(context, query, strategy)
    assert_exact(tiny, out, context, query)
    assert out.fallback_chunks in ([], [7])
    if not out.plan.dynamic_meet:
        assert (out.fallback_chunks == [7]) == (out.plan.split[7] <= 2), "loaded that cell <=> recomputed chunk 7"
    assert pool.stats()["corrupt"] == len(out.fallback_chunks)


def test_a_chunk_evicted_after_lookup_is_recomputed(tiny):
    pool = KVPool.memory("64M", chunk_tokens=32)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(256, 10), ids(4, 11)
    restorer.store(context)
    keys = restorer.keys(context)
    real_get = pool.get_many

    def get_many_losing_chunk_5(wanted):
        got = real_get(wanted)
        return {k: (None if k.tokens[0] == 5 * 32 else v) for k, v in got.items()}

    pool.get_many = get_many_losing_chunk_5
    out = restorer.restore(context, query, "load")
    assert out.fallback_chunks == [5] and keys
    assert_exact(tiny, out, context, query)


@SETTINGS
@given(lens=st.lists(st.integers(1, 500), min_size=1, max_size=5), seed=st.integers(0, 1000),
       rho=st.sampled_from([0.5, 1.0, 4.0]))
def test_restore_batch_results_equal_single_restores(tiny, lens, seed, rho):
    pool = KVPool.memory("64M", chunk_tokens=32)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    requests = [(ids(n, seed + i), ids(3 + i, seed + 100 + i)) for i, n in enumerate(lens)]
    for context, _ in requests:
        restorer.store(context)
    pool.set_throttle(rho * restorer.cost.short_context_rate(32) * 50)
    batch = restorer.restore_batch(requests)
    fcfs = restorer.restore_batch(requests, "cake")
    for (context, query), b, f in zip(requests, batch, fcfs):
        single = restorer.restore(context, query, "recompute")
        assert max_abs_diff_kv(b.kv, single.kv) <= TOL and max_abs_diff_kv(f.kv, single.kv) <= TOL
        assert b.logits.argmax() == single.logits.argmax() == f.logits.argmax()
        assert_exact(tiny, b, context, query)


def test_bad_requests_are_clear_errors(tiny):
    from kvflow.errors import KVFlowError
    restorer = Restorer(tiny, KVPool.memory("16M", chunk_tokens=32), cost=synthetic_cost(tiny))
    with pytest.raises(KVFlowError, match="query token"):
        restorer.restore(ids(64, 0), [], "cacheflow")
    with pytest.raises(KVFlowError, match="unknown strategy"):
        restorer.restore(ids(64, 0), ids(2, 1), "nope")
    with pytest.raises(KVFlowError, match="scheduler"):
        restorer.restore_batch([(ids(64, 0), ids(2, 1))], "cake", scheduler="batch")


@SETTINGS
@given(n_chunks=st.integers(1, 6), rho=st.sampled_from([0.3, 1.0, 3.0]), seed=st.integers(0, 1000))
def test_token_pointers_meet_inside_a_chunk_and_fill_every_cell_once(tiny, n_chunks, rho, seed):
    """The token plan shares the last unclaimed chunk layer by layer (compute bottom-up, I/O top-down):
    every cell is filled exactly once by one side, and the result is exact."""
    pool = KVPool.memory("64M", chunk_tokens=32)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(32 * n_chunks + 5, seed), ids(4, seed + 1)
    restorer.store(context)
    pool.set_throttle(rho * restorer.cost.short_context_rate(32) * 20)
    out = restorer.restore(context, query, "token")
    assert_exact(tiny, out, context, query)
    cells = [(i, layer) for e in out.timeline if e.kind in ("compute", "load")
             for i in range(e.tokens[0] // 32, e.tokens[1] // 32) for layer in range(*e.layers)]
    assert sorted(cells) == [(i, layer) for i in range(n_chunks) for layer in range(tiny.num_layers)]
