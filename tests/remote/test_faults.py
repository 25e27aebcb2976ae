"""Faults of the shared tier: a node killed mid-read or restarted empty makes its records misses and the restore
recomputes them, exact; a store down at start leaves the pool working without it until the re-probe finds it; a
slower store is re-probed into a smaller share; a wrong password is one clear error line."""

import logging
import subprocess
import sys
import threading
import time

import pytest
import redis

from kvflow import KVPool, Restorer
from kvflow.bench.faults import FaultProxy
from kvflow.errors import ConfigError
from kvflow.pool import pool as pool_module
from kvflow.pool.devices.remote import RemoteStore
from tests.remote.helpers import context, remote_cfg, remote_slot
from kvflow.pool.redis_local import RedisProcs, redis_available
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost

C = 32
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))]


def stored_on(cluster, tiny, chunks: int = 6):
    """A context the cluster holds (stored by another pool, since closed) and a fresh pool + restorer over it."""
    cfg = remote_cfg(cluster, chunk_tokens=C)
    ctx, query = ids(chunks * C + 3, 51), ids(5, 52)
    with KVPool.open(cfg) as first:
        Restorer(tiny, first, cost=synthetic_cost(tiny), calibrate=False).store(ctx)
    pool = KVPool.open(cfg)
    return pool, Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False), ctx, query


def on_node(cluster, restorer, ctx, i: int) -> int:
    """Records of ``ctx`` whose hash slot node ``i`` of the cluster serves."""
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[(i + 1) % 3])
    try:
        keys = [k for row in restorer.keys(ctx) for k in row]
        return sum(client.get_node_from_key(b"kvflow:" + k.hex.encode()).port == cluster.ports[i] for k in keys)
    finally:
        client.close()


def test_a_node_killed_mid_read_makes_its_records_misses_and_the_restore_recomputes_them_exactly(
        tiny, fresh_cluster, monkeypatch):
    pool, restorer, ctx, query = stored_on(fresh_cluster, tiny)
    with pool:
        assert restorer.lookup(ctx, query.numel())[0].stored_chunks == 6
        lost = on_node(fresh_cluster, restorer, ctx, 1)
        real, once = RemoteStore._pipelined, threading.Lock()

        def kill_then_read(conn, op, keys, values=None, ttl=0):
            if op == "get" and once.acquire(blocking=False):
                fresh_cluster.kill(1)                 # while the restore's reads are in flight
            return real(conn, op, keys, values, ttl)

        monkeypatch.setattr(RemoteStore, "_pipelined", staticmethod(kill_then_read))
        out = restorer.restore(ctx, query, "load")
        assert_exact(tiny, out, ctx, query)
        st = pool.stats()
        assert 0 < lost and st["misses"] >= lost and st["hits"] > 0


def test_a_node_restarted_empty_serves_misses_and_the_others_still_hit(tiny, fresh_cluster):
    pool, restorer, ctx, query = stored_on(fresh_cluster, tiny)
    with pool:
        lost = on_node(fresh_cluster, restorer, ctx, 2)
        fresh_cluster.kill(2)
        fresh_cluster.restart(2)                      # nothing persisted: it comes back empty, owning its slots
        keys = [k for row in restorer.keys(ctx) for k in row]
        got = pool.get_many(keys)
        assert sum(v is None for v in got.values()) == lost > 0
        assert_exact(tiny, restorer.restore(ctx, query, "cacheflow"), ctx, query)


def test_a_store_down_at_start_leaves_the_pool_working_without_it_until_the_reprobe_finds_it(monkeypatch, caplog):
    rp = RedisProcs(masters=1, cluster=False).start()
    try:
        rp.kill(0)
        cfg = remote_cfg(rp, {"type": "memory", "capacity": "16M"}, remote={"required": False})
        with caplog.at_level(logging.WARNING, logger="kvflow.pool"):
            pool = KVPool.open(cfg)
        with pool:
            i = remote_slot(pool)
            assert any("unreachable" in r.getMessage() and "starting without it" in r.getMessage()
                       for r in caplog.records)
            assert not pool.stats()["devices"][i]["healthy"]
            _, _, data = context(8)
            assert pool.put_many(data) == len(data) and pool.stats()["devices"][0]["records"] == len(data)
            rp.restart(0)
            monkeypatch.setattr(pool_module, "_REPROBE_S", 0.0)
            _, _, more = context(16, seed=5)
            pool.put_many(more)                       # the re-probe runs first: the store is back, measured
            dev = pool.stats()["devices"][i]
            assert dev["healthy"] and dev["p"] > 0 and dev["records"] > 0 and rp.keys() >= dev["records"]
    finally:
        rp.stop()


def test_a_store_that_answers_at_open_but_times_out_in_its_probe_starts_out_of_service_until_it_answers(
        server, monkeypatch, caplog):
    proxy = FaultProxy(server.ports[0])
    real = pool_module.probe

    def stall_then_probe(device, *a, **kw):
        if device.name.startswith("remote:"):
            proxy.stalled = True              # the link stops after the reachability check, mid-probe
        return real(device, *a, **kw)

    try:
        monkeypatch.setattr(pool_module, "probe", stall_then_probe)
        cfg = {"devices": [{"type": "memory", "capacity": "16M", "bandwidth": "200M"},
                           {"type": "remote", "url": f"redis://127.0.0.1:{proxy.port}", "cluster": False,
                            "timeout_s": 1.0}],        # the stall times the probe out; a busy box still answers open
               "chunk_tokens": 16, "probe_bytes": "4M"}
        with caplog.at_level(logging.WARNING, logger="kvflow.pool"):
            pool = KVPool.open(cfg)
        with pool:
            i = remote_slot(pool)
            assert not pool.stats()["devices"][i]["healthy"]
            assert any("did not answer its bandwidth probe" in r.getMessage() for r in caplog.records)
            _, _, data = context(8)
            assert pool.put_many(data) == len(data) and pool.stats()["devices"][0]["records"] == len(data)
            monkeypatch.setattr(pool_module, "probe", real)
            proxy.stalled = False
            monkeypatch.setattr(pool_module, "_REPROBE_S", 0.0)
            deadline = time.monotonic() + 20      # the store asks a suspect node again every second
            while not pool.stats()["devices"][i]["healthy"] and time.monotonic() < deadline:
                pool.get_many([])                 # a read re-probes a device out of service
                time.sleep(0.2)
            _, _, more = context(16, seed=5)
            pool.put_many(more)
            dev = pool.stats()["devices"][i]
            assert dev["healthy"] and dev["p"] > 0 and dev["records"] > 0
    finally:
        proxy.close()


def test_a_slower_store_is_reprobed_into_a_smaller_share(server):
    proxy = FaultProxy(server.ports[0])
    try:
        cfg = {"devices": [{"type": "memory", "capacity": "16M", "bandwidth": "200M"},
                           {"type": "remote", "url": f"redis://127.0.0.1:{proxy.port}", "cluster": False}],
               "chunk_tokens": 16, "probe_bytes": "4M"}
        with KVPool.open(cfg) as pool:
            i = remote_slot(pool)
            before = pool.stats()["devices"][i]["p"]
            proxy.rate = 4e6                          # the link to the store drops to 4 MB/s
            pool.probe(i, 4 << 20)
            after = pool.stats()["devices"][i]["p"]
            assert after < before / 3 and pool.stats()["devices"][i]["probed_read_bw"] < 20e6
    finally:
        proxy.close()


def test_a_wrong_password_is_one_clear_error_that_never_shows_the_password(tmp_path):
    rp = RedisProcs(masters=1, cluster=False, password="right-pw").start()
    try:
        for password in ("wrong-pw", None):
            dev = {"type": "remote", "url": rp.url, "cluster": False, **({"password": password} if password else {})}
            with pytest.raises(ConfigError, match="refused the credentials"):
                KVPool.open({"devices": [dev], "chunk_tokens": 16})
        cfg = tmp_path / "kvflow.yaml"
        cfg.write_text(f"pool:\n  index_dir: index\n  devices:\n    - {{type: remote, url: '{rp.url}', "
                       f"cluster: false, password: wrong-pw}}\n")
        done = subprocess.run([sys.executable, "-m", "kvflow", "pool", "init", str(cfg)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "refused the credentials" in lines[0] and "wrong-pw" not in done.stderr
        ok = {"type": "remote", "url": rp.url, "cluster": False, "password": "right-pw"}
        with KVPool.open({"devices": [ok], "chunk_tokens": 16, "probe_bytes": "1M"}) as pool:
            assert pool.stats()["devices"][0]["healthy"]
    finally:
        rp.stop()


def test_a_pool_whose_only_store_left_service_restores_by_recomputing_exactly(tiny):
    rp = RedisProcs(masters=1, cluster=False).start()
    try:
        cfg = remote_cfg(rp, chunk_tokens=C, remote={"timeout_s": 0.3})
        ctx, query = ids(6 * C + 3, 81), ids(5, 82)
        with KVPool.open(cfg) as pool:
            restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
            restorer.store(ctx)
            rp.kill(0)
            for _ in range(4):                    # three failed rounds take it out of service: read bandwidth 0
                assert_exact(tiny, restorer.restore(ctx, query, "cacheflow"), ctx, query)
            assert not pool.stats()["devices"][0]["healthy"] and pool.stats()["read_bandwidth"] == 0
    finally:
        rp.stop()
