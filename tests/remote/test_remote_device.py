"""The ``remote`` device on a Redis cluster (and one server): records stored unchanged under their content address,
spread over every node, striped with local devices by p_i or copied beside them, verified on every read, found by a
second pool that has no index of them with a handful of pipelined rounds."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVPool
from kvflow.chunks.record import decode
from kvflow.errors import ConfigError
from kvflow.pool.config import PoolConfig
from kvflow.pool.devices.keyed import record_name
from tests.remote.helpers import FP, GROUPS, context, remote_cfg, remote_slot

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(autouse=True)
def _empty(request):
    yield
    rp = request.node.funcargs.get("cluster") or request.node.funcargs.get("server")
    if rp is not None:          # the module's cluster is shared: each test starts from an empty store
        for p in rp.live:
            rp._cli("flushall", port=p)


def node_keys(rp) -> list[int]:
    return [int(rp._cli("dbsize", port=p).stdout.strip()) for p in rp.ports]


def test_striped_records_come_back_verified_and_the_store_holds_each_on_the_node_of_its_slot(cluster):
    ids, keys, data = context(24)
    with KVPool.open(remote_cfg(cluster, {"type": "memory", "capacity": "16M"})) as pool:
        i = remote_slot(pool)
        assert 0 < pool.stats()["devices"][i]["p"] < 1
        pool.put_many(data)
        got = pool.get_many(list(data))
        assert all(torch.equal(got[k], v) for k, v in data.items())
        on_remote = pool.stats()["devices"][i]["records"]
        assert 0 < on_remote < len(data) and cluster.keys() == on_remote
        assert pool.stats()["devices"][i]["reads"] == on_remote
    with redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as r:   # the very record bytes
        for k in data:
            raw = r.get(b"kvflow:" + k.hex.encode())
            if raw is not None:
                assert torch.equal(decode(bytearray(raw), expect=k)[1], data[k])


def test_copy_placement_keeps_every_record_local_and_a_copy_of_each_in_the_store(cluster):
    ids, keys, data = context(30)
    cfg = remote_cfg(cluster, {"type": "memory", "capacity": "16M"}, remote_placement="copy")
    with KVPool.open(cfg) as pool:
        assert pool.put_many(data) == len(data)
        devs = pool.stats()["devices"]
        assert devs[0]["records"] == len(data) and devs[1]["records"] == 0 and devs[1]["writes"] == len(data)
    assert cluster.keys() == len(data) and all(n > 0 for n in node_keys(cluster))   # every node holds some


def test_a_second_pool_without_an_index_finds_the_context_in_a_few_rounds_and_reads_it(cluster):
    ids, keys, data = context(40)
    with KVPool.open(remote_cfg(cluster)) as first:
        first.put_many(data)
    with KVPool.open(remote_cfg(cluster)) as second:
        dev = second.slots[0].store
        before = dev.rounds
        assert second.longest_prefix(ids, FP, GROUPS) == 40 * 16
        assert dev.rounds - before == 1                        # the whole context: the last chunk answers
        half = ids[:20 * 16].tolist() + [7] * 16 * 20           # only the first 20 chunks are stored
        before = dev.rounds
        assert second.longest_prefix(half, FP, GROUPS) == 20 * 16
        assert dev.rounds - before <= 2 + math.ceil(math.log2(40))   # binary search, not a round per chunk
        flat = list(data)
        assert second.contains(flat) == [True] * len(flat)
        got = second.get_many(flat)
        assert all(torch.equal(got[k], data[k]) for k in flat)
        assert second.stats()["hits"] == len(flat)


def test_one_server_mode_stores_and_finds_like_the_cluster(server):
    ids, keys, data = context(8)
    with KVPool.open(remote_cfg(server, {"type": "memory", "capacity": "16M"}, remote_placement="copy")) as pool:
        pool.put_many(data)
    with KVPool.open(remote_cfg(server)) as other:
        assert other.longest_prefix(ids, FP, GROUPS) == 8 * 16
        got = other.get_many(list(data))
        assert all(torch.equal(got[k], v) for k, v in data.items())


def test_store_keys_are_the_record_digest_in_every_process_whatever_its_hash_seed(cluster):
    ids, keys, _ = context(3)
    with KVPool.open(remote_cfg(cluster)) as pool:
        here = [pool.slots[0].store.key(record_name(k.digest)).decode() for row in keys for k in row]
    code = ("import sys, json, torch; from kvflow.chunks.keys import chunk_keys; "
            "ids = torch.tensor(json.loads(sys.argv[1])); "
            f"print(json.dumps(['kvflow:' + k.hex for row in chunk_keys(ids, {FP!r}, 16, {GROUPS!r}) for k in row]))")
    for seed in ("1", "4242"):
        out = subprocess.run([sys.executable, "-c", code, json.dumps(ids.tolist())], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120)
        assert json.loads(out.stdout) == here, out.stderr


def test_a_record_tampered_with_in_the_store_is_a_miss_counted_and_deleted(cluster):
    ids, keys, data = context(4)
    with KVPool.open(remote_cfg(cluster)) as pool:
        pool.put_many(data)
    victim = keys[2][1]
    store_key = b"kvflow:" + victim.hex.encode()
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    raw = bytearray(client.get(store_key))
    raw[-1] ^= 0xFF                                           # one payload byte
    client.set(store_key, bytes(raw))
    with KVPool.open(remote_cfg(cluster)) as other:
        got = other.get_many(list(data))
        assert got[victim] is None and sum(v is not None for v in got.values()) == len(data) - 1
        assert other.stats()["corrupt"] == 1
    assert client.exists(store_key) == 0                     # nobody reads it again
    client.close()


def test_a_record_the_store_evicted_is_a_miss_for_the_writer_and_for_others(cluster):
    ids, keys, data = context(6)
    with KVPool.open(remote_cfg(cluster)) as pool:
        pool.put_many(data)
        for p in cluster.live:
            cluster._cli("flushall", port=p)                 # what allkeys-lru does to cold records
        got = pool.get_many(list(data))
        assert all(v is None for v in got.values())
        assert pool.longest_prefix(ids, FP, GROUPS) == 0
    with KVPool.open(remote_cfg(cluster)) as other:
        assert other.longest_prefix(ids, FP, GROUPS) == 0 and other.contains(list(data)) == [False] * len(data)


def test_a_remote_device_is_configured_or_refused_with_one_line_naming_the_key():
    base = {"chunk_tokens": 16}
    for dev, words in [({"type": "remote"}, "pool.devices[0].url: required"),
                       ({"type": "remote", "url": "http://x:1"}, "pool.devices[0].url: expected redis://"),
                       ({"type": "remote", "url": "redis://host"}, "is not host:port"),
                       ({"type": "remote", "url": "redis://h:1", "timeout_s": 0}, "timeout_s: must be positive"),
                       ({"type": "remote", "url": "redis://h:1", "tls": {"ssl_bogus": 1}}, "tls: unknown key")]:
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            PoolConfig.load({**base, "devices": [dev]})
    with pytest.raises(ConfigError, match="remote_placement: must be stripe or copy"):
        PoolConfig.load({**base, "remote_placement": "mirror", "devices": [{"type": "remote", "url": "redis://h:1"}]})


def test_credentials_never_appear_in_names_or_reprs(monkeypatch):
    monkeypatch.setenv("KVFLOW_POOL_REMOTE_PASSWORD", "s3cret-pw")
    cfg = PoolConfig.load({"chunk_tokens": 16, "devices": [
        {"type": "remote", "url": "redis://u:url-pw@127.0.0.1:1"}]})
    assert cfg.devices[0].password == "s3cret-pw"             # the pool-level (env) password reaches the device
    text = repr(cfg) + cfg.devices[0].name
    assert "s3cret" not in text and "url-pw" not in text


def test_a_context_the_store_does_not_hold_costs_one_round_trip(cluster):
    ids, _, _ = context(64, seed=9)
    with KVPool.open(remote_cfg(cluster)) as pool:
        dev = pool.slots[0].store
        before = dev.rounds
        assert pool.longest_prefix(ids, FP, GROUPS) == 0
        assert dev.rounds - before == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.integers(1, 40), stored=st.data())
def test_longest_prefix_over_the_store_is_exactly_the_stored_prefix(cluster, chunks, stored):
    """Whatever prefix [0, m) of a context the store holds and whatever prefix [0, n <= m) the local index knows,
    the answer is m."""
    m = stored.draw(st.integers(0, chunks), label="stored chunks")
    n = stored.draw(st.integers(0, m), label="known locally")
    ids, keys, data = context(chunks, seed=chunks * 100 + m)
    tiny = {k: v[:, :, :1] for k, v in data.items()}
    try:
        with KVPool.open(remote_cfg(cluster, remote_placement="copy")) as writer:
            writer.put_many({k: tiny[k] for row in keys[:m] for k in row})
        with KVPool.open(remote_cfg(cluster, {"type": "memory", "capacity": "8M"}, remote_placement="copy")) as pool:
            pool.put_many({k: tiny[k] for row in keys[:n] for k in row})
            assert pool.longest_prefix(ids, FP, GROUPS) == m * 16
    finally:
        for p in cluster.live:
            cluster._cli("flushall", port=p)
