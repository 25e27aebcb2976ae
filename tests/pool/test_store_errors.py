"""Errors that are errors: in strict mode a put that could not be made durable raises StoreError naming the device
and the cause (what was stored stays stored and served); relaxed returns the smaller count and counts the rest; a
transient error is retried; a device that left service is tried again after a while instead of never; a record
larger than every device is refused with a clear error and allocates nothing."""

from __future__ import annotations

import errno

import pytest
import torch

from kvflow.errors import RecordError, StoreError
from kvflow.pool import KVPool
from kvflow.pool import pool as pool_mod
from kvflow.pool.devices import DEVICE_TYPES, MemoryDevice

from .helpers import context_keys, tensor_for


class Flaky(MemoryDevice):
    """Fails the next ``fail_writes`` writes / ``fail_reads`` reads / every sync while ``fail_sync``."""
    fail_writes = fail_reads = 0
    fail_sync = False

    def commit(self, offset, buf):
        if Flaky.fail_writes:
            Flaky.fail_writes -= 1
            raise OSError(errno.EIO, "Input/output error")
        super().commit(offset, buf)

    def read(self, offset, length, out=None):
        if Flaky.fail_reads:
            Flaky.fail_reads -= 1
            raise OSError(errno.EIO, "Input/output error")
        return super().read(offset, length, out)

    def sync(self):
        if Flaky.fail_sync:
            raise OSError(errno.EIO, "Input/output error")


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setitem(DEVICE_TYPES, "flaky", Flaky)
    Flaky.fail_writes = Flaky.fail_reads = 0
    Flaky.fail_sync = False
    pools = []

    def build(durability="strict", placement="equal"):
        p = KVPool.open({"chunk_tokens": 16, "durability": durability, "placement": placement, "devices": [
            {"type": "memory", "capacity": 1 << 20, "bandwidth": 1 << 30},
            {"type": "flaky", "capacity": 1 << 20, "bandwidth": 1 << 30}]})
        pools.append(p)
        return p
    yield build
    for p in pools:
        p.close()


def on_flaky(pool):
    return {d for d, dev, *_ in pool.entries() if dev == 1}


def test_strict_raises_naming_the_device_and_keeps_what_was_stored(make):
    pool, keys = make("strict"), context_keys(8)
    Flaky.fail_writes = 10**6
    with pytest.raises(StoreError, match=r"device flaky:anonymous: \d+ of 8 records could not be stored") as err:
        pool.put_many({k: tensor_for(k) for k in keys})
    got = pool.get_many(keys)
    assert err.value.stored == sum(v is not None for v in got.values()) > 0 and err.value.failed > 0
    assert all(v is None or torch.equal(v, tensor_for(k)) for k, v in got.items())


def test_strict_raises_when_a_sync_fails_and_acknowledges_none_of_that_device(make):
    pool, keys = make("strict"), context_keys(8)
    Flaky.fail_sync = True
    with pytest.raises(StoreError):
        pool.put_many({k: tensor_for(k) for k in keys})
    assert not on_flaky(pool), "records whose device did not sync are not in the index"


def test_relaxed_returns_what_was_stored_and_counts_the_rest(make):
    pool, keys = make("relaxed"), context_keys(8)
    Flaky.fail_writes = 10**6
    stored = pool.put_many({k: tensor_for(k) for k in keys})
    assert 0 < stored < len(keys) and stored + pool.stats()["put_errors"] == len(keys)


def test_a_transient_error_is_retried(make):
    pool, keys = make("strict"), context_keys(8)
    Flaky.fail_writes = 1
    assert pool.put_many({k: tensor_for(k) for k in keys}) == len(keys)
    Flaky.fail_reads = 1
    assert all(v is not None for v in pool.get_many(keys).values())
    assert pool.stats()["put_errors"] == 0


def test_a_device_out_of_service_is_tried_again_after_a_while(make, monkeypatch):
    pool, keys = make("relaxed"), context_keys(8)
    pool.put_many({k: tensor_for(k) for k in keys})
    assert on_flaky(pool)
    Flaky.fail_reads = 10**6
    pool.get_many(keys)
    pool.get_many(keys)
    assert not pool.stats()["devices"][1]["healthy"]
    Flaky.fail_reads = 0
    assert any(v is None for v in pool.get_many(keys).values()), "out of service until the re-probe"
    monkeypatch.setattr(pool_mod, "_REPROBE_S", 0.0)
    got = pool.get_many(keys)
    assert pool.stats()["devices"][1]["healthy"]
    assert all(v is not None and torch.equal(v, tensor_for(k)) for k, v in got.items())


def test_a_record_larger_than_every_device_is_refused_and_allocates_nothing(make):
    pool = make("strict")
    (key,) = context_keys(1)
    with pytest.raises(RecordError, match="larger than every device"):
        pool.put_many({key: torch.zeros(1 << 19)})          # 2 MiB of fp32 > 1 MiB devices
    assert pool.stats()["used"] == 0


def test_restorer_store_reports_a_partial_store(make, tiny):
    from kvflow.restorer import Restorer
    from tests.restore.test_restore_exactness import synthetic_cost

    pool = make("relaxed")
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    Flaky.fail_writes = 10**6
    result = restorer.store(torch.arange(64) % 1000)
    assert result.records_not_stored > 0 and not result.complete
    Flaky.fail_writes = 0
    strict = make("strict")
    Flaky.fail_writes = 10**6
    with pytest.raises(StoreError):
        Restorer(tiny, strict, cost=synthetic_cost(tiny), calibrate=False).store(torch.arange(64) % 1000)
