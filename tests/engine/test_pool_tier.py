"""The pool is the tier below the resident blocks: a prefix not resident is loaded or restored from the pool by any
strategy, the way predicted soonest, and the output still equals generate; finished and preempted sequences are
stored asynchronously; a full write queue drops (and counts) writes instead of blocking the engine."""

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVPool, Restorer
from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.engine.pool_tier import PoolTier
from kvflow.planner import STRATEGIES
from tests.engine.helpers import hf_greedy, ids, synthetic_cost


@pytest.fixture
def restorer(tiny):
    return Restorer(tiny, KVPool.memory("64M", chunk_tokens=32), cost=synthetic_cost(tiny))


def engine(tiny, restorer, **cfg):
    return LLMEngine(tiny, EngineConfig(**{"block_size": 16, **cfg}), restorer=restorer)


def test_a_finished_conversation_is_restored_from_the_pool_by_a_fresh_engine(tiny, restorer):
    first = engine(tiny, restorer)
    base = ids(100, 1)
    out = first.generate([base], SamplingParams(max_tokens=5))[0]
    first.close()                                              # flushes the write queue
    assert first.pool.counters["records_written"] == 3 * tiny.num_layers    # 104 computed tokens: 3 full chunks
    second = engine(tiny, restorer)
    prompt = base + out.token_ids + ids(3, 2)
    res = second.generate([prompt], SamplingParams(max_tokens=6))[0]
    assert res.token_ids == hf_greedy(tiny, prompt, 6)
    assert res.cached_tokens == 96 and second.stats.requests_by_hit["pool"] == 1
    second.close()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pool_load", [False, True])
def test_every_strategy_continues_pool_hits_exactly(tiny, restorer, strategy, pool_load):
    """pool_load off: every pool hit goes through the strategy's restoration. On: each goes the way predicted
    soonest — on this memory pool a load, except under ``recompute``, which never loads."""
    restorer.store(ids(130, 3))
    eng = engine(tiny, restorer, strategy=strategy, max_num_batched_tokens=24, pool_load=pool_load)
    prompts = [ids(130, 3) + ids(5, 4), ids(130, 3)[:70] + ids(2, 5)]          # 4 and 2 chunks stored
    outs = eng.generate(prompts, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny, p, 5) for p in prompts]
    assert [o.cached_tokens for o in outs] == [128, 64]
    c = eng.pool.counters
    assert c["restores"] + c["loads"] == 2
    if not pool_load or strategy == "recompute":
        assert c["restores"] == 2
    eng.close()


def test_the_way_to_a_first_token_is_the_one_predicted_soonest(tiny, restorer):
    """PoolTier.choose: over a fast pool a hit is loaded (with or without resident blocks); over a link that
    barely moves a byte a resident prefix is continued by a prefill and, with nothing resident, the strategy's
    plan rebuilds the prefix (cacheflow: by recompute); ``recompute`` and ``pool_load`` off never load."""
    from kvflow.engine.pool_tier import PoolTier
    from kvflow.planner import IOModel
    tier = PoolTier(restorer)
    assert tier.choose(200, 0, 128)[0] == "load" and tier.choose(200, 64, 128)[0] == "load"
    assert tier.choose(200, 100, 0)[0] == "prefill" and tier.choose(200, 128, 128)[0] == "prefill"
    _, seconds = tier.choose(200, 64, 128)
    assert seconds == tier.predicted_s(200, 64, 128) < tier.predicted_s(200, 64, 0)
    for no_loads in (PoolTier(restorer, "recompute"), PoolTier(restorer, load=False)):
        assert no_loads.choose(200, 0, 128)[0] == "restore"
        assert no_loads.choose(200, 64, 128)[0] in ("restore", "prefill")
    cell = restorer.io_model().cell_bytes
    restorer.io_model = lambda calibrated=True: IOModel(bandwidth=1.0, cell_bytes=cell)    # 1 B/s
    slow = PoolTier(restorer)
    assert slow.choose(200, 64, 128)[0] == "prefill"
    assert slow.choose(200, 0, 128)[0] == "restore"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 700), resident=st.integers(0, 700), stored=st.integers(0, 700),
       rate=st.sampled_from([1e3, 1e6, 1e9]))
def test_the_way_chosen_is_the_same_whether_or_not_a_restoration_is_planned_where_its_bound_loses(
        tiny, restorer, n, resident, stored, rate):
    """``choose`` plans a restoration only where the planner's T* beats the other ways; planning it every time gives
    the same way and the same predicted seconds (T* is below every plan's prediction)."""
    resident, stored = min(resident // 16 * 16, n - 1), min(stored, n - 1)
    restorer.pool.set_throttle(rate)                           # a slow link: restorations that recompute can win
    tier = PoolTier(restorer)
    pruned = tier.choose(n, resident, stored)
    tier._restoration_bound = lambda *a: float("-inf")          # always planned
    assert tier.choose(n, resident, stored) == pruned


def test_a_hit_mostly_resident_is_priced_without_a_restoration_plan(tiny, restorer):
    tier = PoolTier(restorer)
    assert tier.choose(400, 384, 396)[0] in ("prefill", "load") and not tier._plans


def test_a_pool_hit_longer_than_the_resident_hit_keeps_the_resident_blocks(tiny, restorer):
    base = ids(100, 6)
    restorer.store(base)                                       # 3 chunks in the pool
    eng = engine(tiny, restorer)
    eng.generate([base[:40]], SamplingParams(max_tokens=1))   # 2 resident blocks of 16
    before = dict(eng.pool.counters)
    out = eng.generate([base + [7]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == hf_greedy(tiny, base + [7], 4)
    assert out.cached_tokens == 96
    # over the resident blocks the hit is read into the blocks (no restoration): [32, 96), every layer
    c = eng.pool.counters
    assert c["loads"] - before["loads"] == 1 and c["load_tokens"] - before["load_tokens"] == 64
    assert c["restores"] == before["restores"]
    eng.close()


def test_a_load_that_meets_a_missing_record_computes_from_that_chunk_on_and_stays_exact(tiny, restorer):
    base = ids(100, 7)
    restorer.store(base)                                       # 3 chunks of 32 in the pool
    eng = engine(tiny, restorer)
    eng.generate([base[:40]], SamplingParams(max_tokens=1))   # 2 resident blocks of 16
    get_many = eng.pool.pool.get_many

    def losing_the_third_chunk(keys, *a, **kw):
        got = get_many(keys, *a, **kw)
        return {k: (None if k.tokens[0] == 64 and k.layers[0] == 1 else v) for k, v in got.items()}
    eng.pool.pool.get_many = losing_the_third_chunk
    before = eng.pool.counters["load_tokens"]
    out = eng.generate([base + [7]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == hf_greedy(tiny, base + [7], 4)
    assert eng.pool.counters["load_tokens"] - before == 32       # [32, 64) read; [64, 101) computed
    assert out.cached_tokens == 64
    eng.close()


def test_preempted_sequences_come_back_exactly_through_the_pool_or_recompute(tiny):
    restorer = Restorer(tiny, KVPool.memory("64M", chunk_tokens=8), cost=synthetic_cost(tiny))
    eng = LLMEngine(tiny, EngineConfig(num_blocks=9, block_size=4, enable_prefix_caching=False),
                    restorer=restorer)
    prompts = [ids(13, 7), ids(14, 8)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=16))
    assert eng.stats.preemptions >= 1
    assert [o.token_ids for o in outs] == [hf_greedy(tiny, p, 16) for p in prompts]
    eng.close()


def test_a_preempted_decoder_comes_back_reading_its_partial_last_chunk_and_computing_one_token(tiny, restorer):
    """A decoder preempted at 75 tokens (2 chunks of 32 + 11) stores its tail [64, 75) under the tail key; when it
    comes back its lookup finds all 75 and the step computes only its last token; its tokens still equal generate.
    A finished sequence stores no tail (a follow-up never asks for that exact prefix)."""
    eng = engine(tiny, restorer, enable_prefix_caching=False)
    prompt = ids(70, 21)
    sid = eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    got = []
    while len(got) < 6:
        got += [t for o in eng.step() for t in o.new_token_ids]
    seq = eng.seqs[sid]
    assert seq.num_tokens == 76 and seq.num_computed == 75
    eng.scheduler.running.remove(seq)
    eng.scheduler._preempt(seq)                 # as a swap or a preemption does
    eng.pool.flush()
    assert eng.pool.lookup(seq.token_ids[:75]) == 75 and eng.pool.lookup(seq.token_ids[:74]) == 64
    computed = eng.stats.computed_tokens
    got += [t for o in eng.step() for t in o.new_token_ids]
    assert eng.stats.computed_tokens - computed == 1 and eng.pool.counters["load_tokens"] == 75
    while eng.has_unfinished():
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert got == hf_greedy(tiny, prompt, 12, ignore_eos=True)
    eng.pool.flush()
    done = prompt + got
    assert eng.pool.lookup(done[:-1]) == (len(done) - 1) // 32 * 32     # stored when it finished: whole chunks
    eng.close()


def test_a_full_write_queue_drops_and_counts_instead_of_blocking(tiny, restorer):
    gate = threading.Event()
    put = restorer.pool.put_many
    restorer.pool.put_many = lambda items, **kw: (gate.wait(30), put(items, **kw))[1]
    eng = engine(tiny, restorer, write_queue=1)
    prompts = [ids(40, 10 + i) for i in range(4)]              # each finishes with a full chunk to store
    outs = eng.generate(prompts, SamplingParams(max_tokens=2))
    assert len(outs) == 4                                      # the engine finished with the writer stuck
    c = eng.pool.counters
    assert c["writes_dropped"] >= 2 and c["records_dropped"] == c["writes_dropped"] * tiny.num_layers
    gate.set()
    eng.close()
    assert c["records_written"] == (4 - c["writes_dropped"]) * tiny.num_layers


@pytest.mark.parametrize("way", ["restore", "load"])
def test_a_failing_restoration_or_load_falls_back_to_recompute(tiny, restorer, way):
    base = ids(70, 11)
    restorer.store(base)
    eng = engine(tiny, restorer, pool_load=way == "load")

    def broken(*args):
        raise RuntimeError("device gone")
    setattr(eng.pool, way, broken)
    out = eng.generate([base + [3]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == hf_greedy(tiny, base + [3], 4)
    assert eng.pool.counters[f"{way}_errors"] == 1
    eng.close()


def test_with_async_restore_other_sequences_keep_decoding_while_a_restoration_is_in_flight(tiny, restorer):
    base = ids(96, 12)
    restorer.store(base)
    eng = engine(tiny, restorer, async_restore=True, pool_load=False)
    gate = threading.Event()
    real = eng.pool.restore
    eng.pool.restore = lambda requests: (gate.wait(60), real(requests))[1]
    hit = eng.add_request(base + [4], SamplingParams(max_tokens=3))
    plain = eng.add_request(ids(7, 13), SamplingParams(max_tokens=5))
    done, finished = {}, set()
    while plain not in finished:
        for out in eng.step():
            done.setdefault(out.seq_id, []).extend(out.new_token_ids)
            assert out.seq_id != hit                          # still restoring
            if out.finished:
                finished.add(out.seq_id)
    assert done[plain] == hf_greedy(tiny, ids(7, 13), 5)
    gate.set()
    while eng.has_unfinished():
        for out in eng.step():
            done.setdefault(out.seq_id, []).extend(out.new_token_ids)
    assert done[hit] == hf_greedy(tiny, base + [4], 3)
    eng.close()


def test_aborting_a_request_while_it_is_restored_frees_its_blocks_when_the_restore_returns(tiny, restorer):
    base = ids(64, 14)
    restorer.store(base)
    eng = engine(tiny, restorer, async_restore=True, pool_load=False)
    gate = threading.Event()
    real = eng.pool.restore
    eng.pool.restore = lambda requests: (gate.wait(60), real(requests))[1]
    sid = eng.add_request(base + [1], SamplingParams(max_tokens=3))
    eng.step()
    eng.abort(sid)
    assert eng.blocks.num_free < eng.num_blocks                # the worker may still be reading into them
    gate.set()
    while eng.has_unfinished():
        assert eng.step() == []
    assert eng.blocks.num_free == eng.num_blocks
    eng.close()


def test_restoring_on_the_async_worker_is_exact_too(tiny, restorer):
    restorer.store(ids(130, 3))
    eng = engine(tiny, restorer, async_restore=True, pool_load=False)
    prompts = [ids(130, 3) + ids(5, 4), ids(130, 3)[:70] + ids(2, 5)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == [hf_greedy(tiny, p, 5) for p in prompts]
    assert [o.cached_tokens for o in outs] == [128, 64]
    eng.close()


def test_an_engine_held_to_its_budget_keeps_no_staging_buffer_between_restores(tiny, restorer):
    context = ids(130, 3)
    restorer.store(context)
    held = engine(tiny, restorer, release_heap=True, activation_reserve=1 << 20, pool_load=False)
    prompt = context + ids(4, 4)
    assert held.generate([prompt], SamplingParams(max_tokens=3))[0].token_ids == hf_greedy(tiny, prompt, 3)
    staging = restorer.executor.transfer.staging
    assert held.stats.requests_by_hit["pool"] == 1 and staging.allocated > 0
    assert staging.free_bytes == 0 and staging.outstanding == 0     # what the memory budget line does not count
    held.close()


def test_a_restorations_predicted_time_is_planned_once_per_shape_until_the_calibration_moves(tiny, restorer):
    from kvflow.engine.pool_tier import PoolTier
    tier, plans = PoolTier(restorer), []
    tier._restoration_bound = lambda *a: float("-inf")   # the bound never rules a restoration out: the cache is asked
    real = restorer.planner

    def counting():
        planner = real()
        plan = planner.plan
        planner.plan = lambda *a: plans.append(1) or plan(*a)
        return planner
    restorer.planner = counting
    first = tier.predicted_s(200, 0, 128)
    assert tier.predicted_s(200, 0, 128) == first and len(plans) == 1        # the same shape: the same plan
    tier.predicted_s(200, 64, 128)
    assert len(plans) == 1                                                   # resident blocks: the same plan
    tier.predicted_s(300, 0, 256)
    assert len(plans) == 2                                                   # another shape, another plan
    restorer.calibration.compute_seen += 1                                   # a restoration was folded in
    tier.predicted_s(200, 0, 128)
    assert len(plans) == 3
    assert tier.predicted_s(200, 100, 0) < tier.predicted_s(200, 0, 0) and len(plans) == 3   # prefills: no plan
