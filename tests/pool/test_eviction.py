"""Eviction: a full pool evicts least recently used records (per device, from the high to the low watermark)
instead of failing a put; a record being read is pinned and its extent is not reused until the read is done."""

import threading

import pytest
import torch

from kvflow.pool import KVPool
from kvflow.pool.devices import DEVICE_TYPES, MemoryDevice

from .helpers import context_keys, tensor_for

UNIT = 4096   # a test record (2 KiB payload + 128 B header) takes one 4 KiB unit


def small_pool(records: int, **kw) -> KVPool:
    return KVPool.memory(records * UNIT, chunk_tokens=16, **kw)


def test_a_full_pool_evicts_instead_of_failing_a_put():
    keys = context_keys(100)
    with small_pool(20) as pool:
        for k in keys:
            assert pool.put_many({k: tensor_for(k)}) == 1
        st = pool.stats()
        assert st["put_dropped"] == 0 and st["evictions"] >= 80
        assert st["used"] <= 0.95 * st["capacity"]
        latest = pool.get_many(keys[-10:])
        assert all(torch.equal(latest[k], tensor_for(k)) for k in keys[-10:]), "the newest records stay"
        assert pool.get_many(keys[:1])[keys[0]] is None, "the oldest went first"


def test_eviction_goes_from_the_high_down_to_the_low_watermark():
    keys = context_keys(40)
    with small_pool(20, high_watermark=0.9, low_watermark=0.5) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:18]})
        assert pool.stats()["evictions"] == 0
        pool.put_many({k: tensor_for(k) for k in keys[18:19]})
        st = pool.stats()
        assert st["evictions"] > 0 and st["used"] <= 0.5 * st["capacity"]


def test_recently_read_records_survive_eviction():
    keys = context_keys(30)
    with small_pool(20) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:15]})
        pool.get_many(keys[:3])                       # touched: now the most recently used
        pool.put_many({k: tensor_for(k) for k in keys[15:]})
        assert all(v is not None for v in pool.get_many(keys[:3]).values())
        assert pool.get_many(keys[3:4])[keys[3]] is None


class GatedMemory(MemoryDevice):
    """A memory device whose reads stop halfway until the test opens the gate."""
    started = threading.Event()
    gate = threading.Event()

    def read(self, offset, length):
        first = super().read(offset, length // 2)
        GatedMemory.started.set()
        assert GatedMemory.gate.wait(30)
        rest = super().read(offset + length // 2, length - length // 2)
        return torch.cat([first, rest])


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setitem(DEVICE_TYPES, "gated", GatedMemory)
    GatedMemory.started.clear(), GatedMemory.gate.clear()
    return {"type": "gated", "capacity": 20 * UNIT, "bandwidth": 1 << 30}


def test_a_record_being_read_is_pinned_and_its_extent_not_reused_mid_read(gated):
    keys = context_keys(60)
    with KVPool.open({"devices": [gated], "chunk_tokens": 16}) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:10]})
        victim = keys[0]                               # the least recently used record
        result = {}
        reader = threading.Thread(target=lambda: result.update(pool.get_many([victim])))
        reader.start()
        assert GatedMemory.started.wait(30)
        GatedMemory.gate.clear()
        pool.put_many({k: tensor_for(k) for k in keys[10:]})   # forces eviction all around the pinned record
        assert pool.stats()["evictions"] > 0
        pinned = [e for e in pool.entries() if e[0] == victim.digest]
        assert pinned, "a pinned record is never evicted"
        others = [e for e in pool.entries() if e[0] != victim.digest and e[2] < pinned[0][2] + pinned[0][3]
                  and pinned[0][2] < e[2] + e[3]]
        assert not others, "nothing was written over the pinned extent"
        GatedMemory.gate.set()
        reader.join(30)
        assert torch.equal(result[victim], tensor_for(victim))


def test_when_every_record_is_pinned_a_put_is_skipped_not_failed(gated):
    keys = context_keys(40)
    with KVPool.open({"devices": [{**gated, "workers": 32}], "chunk_tokens": 16}) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:19]})
        reader = threading.Thread(target=lambda: pool.get_many(keys[:19]))   # pins all 19 until the gate opens
        reader.start()
        assert GatedMemory.started.wait(30)
        stored = pool.put_many({k: tensor_for(k) for k in keys[19:]})
        st = pool.stats()
        assert stored + st["put_dropped"] == 21 and st["put_dropped"] > 0
        GatedMemory.gate.set()
        reader.join(30)
