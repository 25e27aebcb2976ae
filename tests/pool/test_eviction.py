"""Eviction: a full pool evicts least recently used records (per device) instead of failing a put — only when
the record fits on no device, only on one device, and only the fewest LRU records after which it fits; a record
larger than a device goes to another, one larger than every device is one clear error; a record being read is
pinned and its extent is not reused until the read is done."""

import threading
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import RecordError
from kvflow.pool import KVPool
from kvflow.pool.devices import DEVICE_TYPES, MemoryDevice

from .helpers import context_keys, tensor_for

UNIT = 4096   # a test record (2 KiB payload + 128 B header) takes one 4 KiB unit


def small_pool(records: int, **kw) -> KVPool:
    return KVPool.memory(records * UNIT, chunk_tokens=16, **kw)


def sized(key, units: int) -> torch.Tensor:
    """A record of exactly ``units`` 4 KiB units (128 B header + payload)."""
    return tensor_for(key, numel=(units * UNIT - 128) // 4)


def test_a_full_pool_evicts_instead_of_failing_a_put_one_record_for_one_record():
    keys = context_keys(100)
    with small_pool(20) as pool:
        for k in keys:
            assert pool.put_many({k: tensor_for(k)}) == 1
        st = pool.stats()
        assert st["put_dropped"] == 0 and st["evictions"] == 80, "each put past the 20th evicts exactly one"
        latest = pool.get_many(keys[-20:])
        assert all(torch.equal(latest[k], tensor_for(k)) for k in keys[-20:]), "the newest 20 all stay"
        assert pool.get_many(keys[:1])[keys[0]] is None, "the oldest went first"


def test_a_device_above_its_high_watermark_takes_records_only_when_no_device_below_it_has_room():
    keys = context_keys(40)
    devices = [{"type": "memory", "capacity": 10 * UNIT, "bandwidth": 1 << 30}] * 2
    with KVPool.open({"devices": devices, "chunk_tokens": 16, "high_watermark": 0.5, "placement": "overflow"}) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:5]})
        assert [d["records"] for d in pool.stats()["devices"]] == [5, 0]
        pool.put_many({k: tensor_for(k) for k in keys[5:10]})      # device 0 is at its watermark: spill
        assert [d["records"] for d in pool.stats()["devices"]] == [5, 5]
        pool.put_many({k: tensor_for(k) for k in keys[10:20]})     # both above it: fill before evicting
        st = pool.stats()
        assert [d["records"] for d in st["devices"]] == [10, 10] and st["evictions"] == 0


def test_a_record_larger_than_a_device_goes_to_another_and_one_larger_than_every_device_is_one_error():
    small, big = {"type": "memory", "capacity": 4 * UNIT, "bandwidth": 4 << 30}, \
        {"type": "memory", "capacity": 16 * UNIT, "bandwidth": 1 << 30}
    keys = context_keys(30)
    with KVPool.open({"devices": [small, big], "chunk_tokens": 16}) as pool:
        pool.put_many({k: sized(k, 1) for k in keys[:20]})          # both devices full
        assert pool.put_many({keys[20]: sized(keys[20], 6)}) == 1   # too large for the small device
        row = [e for e in pool.entries() if e[0] == keys[20].digest]
        assert row and row[0][1] == 1
        assert pool.stats()["devices"][0]["evictions"] == 0, "nothing evicted on the device it cannot fit"
        before = pool.entries()
        with pytest.raises(RecordError, match=r"larger than every device of this pool \(largest: 65,536 bytes\)"):
            pool.put_many({keys[21]: sized(keys[21], 17)})
        assert pool.entries() == before, "a refused record evicts nothing"


def _largest_hole(capacity: int, extents) -> int:
    pos, best = 0, 0
    for off, n in sorted(extents):
        best, pos = max(best, off - pos), off + n
    return max(best, capacity - pos)


def _units(length: int) -> int:
    return -(-length // UNIT) * UNIT


@settings(max_examples=60, deadline=None)
@given(caps=st.lists(st.integers(2, 12), min_size=1, max_size=3), high=st.sampled_from([0.5, 0.95, 1.0]),
       script=st.lists(st.one_of(st.tuples(st.just("put"), st.integers(1, 13)),
                                 st.tuples(st.just("get"), st.integers(0, 10**6)),
                                 st.tuples(st.just("again"), st.integers(0, 10**6))), max_size=40))
def test_a_put_evicts_only_the_fewest_lru_records_its_record_needs_on_one_device(caps, high, script):
    keys = iter(context_keys(64, seed=len(script)))
    devices = [{"type": "memory", "capacity": c * UNIT, "bandwidth": (1 + i) << 30} for i, c in enumerate(caps)]
    lru: OrderedDict[bytes, object] = OrderedDict()             # the model: every stored key, least recent first
    with KVPool.open({"devices": devices, "chunk_tokens": 16, "high_watermark": high}) as pool:
        for op, arg in script:
            rows = {d: (dev, off, _units(n)) for d, dev, off, n, _ in pool.entries()}
            assert set(rows) == set(lru)
            if op in ("get", "again"):                          # a hit or a re-put of a stored key: a touch
                if lru:
                    key = list(lru.values())[arg % len(lru)]
                    if op == "get":
                        assert pool.get_many([key])[key] is not None
                    else:
                        assert pool.put_many({key: sized(key, 1)}) == 0
                    lru.move_to_end(key.digest)
                    assert {e[0] for e in pool.entries()} == set(rows), "a touch evicts nothing"
                continue
            key, need = next(keys), arg * UNIT
            if need > max(caps) * UNIT:
                with pytest.raises(RecordError):
                    pool.put_many({key: sized(key, arg)})
                assert {e[0] for e in pool.entries()} == set(rows)
                continue
            assert pool.put_many({key: sized(key, arg)}) == 1, "with nothing pinned a record that fits a device " \
                                                               "is always stored"
            after = {d: dev for d, dev, *_ in pool.entries()}
            dev = after[key.digest]
            evicted = [d for d in lru if d not in after]
            holes = [_largest_hole(c * UNIT, [(o, n) for r, (v, o, n) in rows.items() if v == i])
                     for i, c in enumerate(caps)]
            if evicted:
                assert max(holes) < need, "a put evicts only when its record fits on no device"
                on_dev = [d for d in lru if rows[d][0] == dev]
                assert evicted == on_dev[:len(evicted)], "only the device it went to, least recently used first"
                kept = [(o, n) for r, (v, o, n) in rows.items() if v == dev and r not in evicted[:-1]]
                assert _largest_hole(caps[dev] * UNIT, kept) < need, "one record fewer would not have made room"
            for d in evicted:
                del lru[d]
            lru[key.digest] = key


@pytest.mark.parametrize("k", [1, 2, 3, 5, 16])
def test_a_put_needing_k_pages_on_a_full_device_evicts_exactly_the_k_least_recently_used_pages(k):
    """16 one-page records fill the device in address order, so the LRU order is the address order: a record of k
    pages needs exactly the k oldest (contiguous) records gone — no more, and never one that was read since."""
    keys = context_keys(18, seed=k)
    with small_pool(16) as pool:
        for key in keys[:16]:
            pool.put_many({key: sized(key, 1)})
        touched = keys[k] if k < 16 else None       # the oldest record it does not need: read now, newest again
        if touched is not None:
            assert pool.get_many([touched])[touched] is not None
        assert pool.put_many({keys[16]: sized(keys[16], k)}) == 1
        left = {d for d, *_ in pool.entries()}
        assert pool.stats()["evictions"] == k and left == {key.digest for key in keys[k:17]}
        free = 16 * UNIT - sum(_units(n) for *_, n, _ in pool.entries())
        assert free == 0, "the evicted records freed exactly the k pages the record took"


def test_one_put_of_several_records_evicts_only_what_all_of_them_need():
    keys = context_keys(24, seed=7)
    with small_pool(16) as pool:
        pool.put_many({key: sized(key, 1) for key in keys[:16]})
        batch = {keys[16]: sized(keys[16], 2), keys[17]: sized(keys[17], 1), keys[18]: sized(keys[18], 3)}
        assert pool.put_many(batch) == 3
        assert pool.stats()["evictions"] == 6 and {d for d, *_ in pool.entries()} == \
            {key.digest for key in keys[6:19]}, "2 + 1 + 3 pages: the six oldest records, no other"


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

    def read(self, offset, length, out=None):
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
