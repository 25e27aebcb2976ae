"""A node that hangs costs a restore one bounded wait, not one per round: the first request that times out makes
the node suspect, every later round (of the same restore and of the next ones) skips it — its records are misses,
recomputed exactly — and a background re-probe brings it back once it answers. Counted, never timed: the store's
``timed_out_rounds`` (rounds that waited out ``timeout_s``) per restore."""

import time

import pytest

from kvflow import KVPool, Restorer
from kvflow.bench.faults import LoopbackCluster
from kvflow.pool.devices import remote as remote_module
from kvflow.pool.redis_local import RedisProcs, redis_available
from tests.remote.helpers import remote_slot
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost

C = 32
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))]


def _until(cond, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


@pytest.fixture
def proxied():
    """3 masters on loopback, each behind a proxy that can hold every byte (a cut link)."""
    lc = LoopbackCluster().start()
    try:
        yield lc
    finally:
        lc.stop()


def _pool(url: str, cluster: bool = True) -> dict:
    return {"devices": [{"type": "remote", "url": url, "cluster": cluster, "timeout_s": 0.4}],
            "chunk_tokens": C, "probe_bytes": "1M"}


def test_a_hanging_node_costs_a_restore_one_timeout_the_next_none_and_is_found_again_once_it_answers(
        tiny, proxied, monkeypatch):
    monkeypatch.setattr(remote_module, "SUSPECT_REPROBE_S", 0.05)
    cfg = _pool(proxied.url)
    ctx, query = ids(6 * C + 3, 61), ids(5, 62)
    with KVPool.open(cfg) as first:
        Restorer(tiny, first, cost=synthetic_cost(tiny), calibrate=False).store(ctx)
    with KVPool.open(cfg) as pool:                    # no index of the records: every lookup and read is remote
        restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
        store = pool.slots[remote_slot(pool)].store
        assert restorer.lookup(ctx, query.numel())[0].stored_chunks == 6
        proxied.cut(1)
        waited = []
        for _ in range(3):                            # node 1 hangs through three restores
            before = store.timed_out_rounds
            assert_exact(tiny, restorer.restore(ctx, query, "load"), ctx, query)
            waited.append(store.timed_out_rounds - before)
        assert waited[0] == 1 and waited[1:] == [0, 0]   # one wait, then none: the node is skipped
        assert store.suspect and store.skipped > 0
        proxied.heal(1)
        assert _until(lambda: not store.suspect)      # the background re-probe finds it answering
        before, seen = store.timed_out_rounds, pool.stats()
        assert restorer.lookup(ctx, query.numel())[0].stored_chunks == 6
        assert_exact(tiny, restorer.restore(ctx, query, "load"), ctx, query)
        now = pool.stats()
        assert now["hits"] > seen["hits"] and now["misses"] == seen["misses"]     # node 1's records hit again
        assert store.timed_out_rounds == before and pool.stats()["devices"][0]["healthy"]


def test_a_hanging_one_server_store_leaves_service_without_a_second_wait_and_comes_back(tiny, monkeypatch):
    from kvflow.pool import pool as pool_module
    from kvflow.bench.faults import FaultProxy

    monkeypatch.setattr(remote_module, "SUSPECT_REPROBE_S", 0.05)
    rp = RedisProcs(masters=1, cluster=False).start()
    proxy = FaultProxy(rp.ports[0])
    try:
        cfg = _pool(f"redis://127.0.0.1:{proxy.port}", cluster=False)
        ctx, query = ids(4 * C + 3, 71), ids(5, 72)
        with KVPool.open(cfg) as first:
            Restorer(tiny, first, cost=synthetic_cost(tiny), calibrate=False).store(ctx)
        with KVPool.open(cfg) as pool:
            restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
            store = pool.slots[0].store
            proxy.stalled = True
            before = store.timed_out_rounds
            for _ in range(4):          # the rounds after the first fail at once: out of service after three
                assert_exact(tiny, restorer.restore(ctx, query, "cacheflow"), ctx, query)
            assert store.timed_out_rounds - before == 1 and not pool.stats()["devices"][0]["healthy"]
            monkeypatch.setattr(pool_module, "_REPROBE_S", 0.0)
            assert_exact(tiny, restorer.restore(ctx, query, "cacheflow"), ctx, query)   # the pool's re-probe
            assert store.timed_out_rounds - before == 1                                 # does not wait either
            proxy.stalled = False
            assert _until(lambda: not store.suspect)
            assert_exact(tiny, restorer.restore(ctx, query, "load"), ctx, query)        # re-probed: back
            assert pool.stats()["devices"][0]["healthy"] and store.timed_out_rounds - before == 1
            assert restorer.lookup(ctx, query.numel())[0].stored_chunks == 4
    finally:
        proxy.close()
        rp.stop()
