"""An unreadable device degrades the pool instead of failing it: its records become misses, after a few errors in
a row it leaves service (no new placements, contains() says no); a failed write raises StoreError in strict mode
(the rest of the put is stored) and is counted in relaxed mode."""

import errno

import pytest
import torch

from kvflow.errors import StoreError
from kvflow.pool import KVPool
from kvflow.pool.devices import DEVICE_TYPES, MemoryDevice

from .helpers import context_keys, tensor_for


class BrokenMemory(MemoryDevice):
    """Works until ``broken`` is set, then every read and write fails like a dead disk."""
    broken = False

    def read(self, offset, length, out=None):
        if BrokenMemory.broken:
            raise OSError(errno.EIO, "Input/output error")
        return super().read(offset, length, out)

    def commit(self, offset, buf):
        if BrokenMemory.broken:
            raise OSError(errno.EIO, "Input/output error")
        super().commit(offset, buf)


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setitem(DEVICE_TYPES, "broken", BrokenMemory)
    BrokenMemory.broken = False
    with KVPool.open({"chunk_tokens": 16, "devices": [
            {"type": "memory", "capacity": 1 << 20, "bandwidth": 1 << 30},
            {"type": "broken", "capacity": 1 << 20, "bandwidth": 1 << 30}]}) as p:
        yield p


def test_records_on_a_failing_device_are_misses_and_the_rest_is_served(pool):
    keys = context_keys(12)
    pool.put_many({k: tensor_for(k) for k in keys})
    on_broken = {d for d, dev, *_ in pool.entries() if dev == 1}
    assert 0 < len(on_broken) < len(keys)
    BrokenMemory.broken = True
    got = pool.get_many(keys)
    for k in keys:
        assert (got[k] is None) == (k.digest in on_broken)
        assert got[k] is None or torch.equal(got[k], tensor_for(k))
    st = pool.stats()
    assert not st["devices"][1]["healthy"] and st["devices"][1]["errors"] >= 3
    assert pool.contains(keys) == [k.digest not in on_broken for k in keys]
    assert pool.read_bandwidth == st["devices"][0]["read_bw"]


def test_after_a_device_leaves_service_new_records_go_elsewhere(pool):
    BrokenMemory.broken = True
    keys = context_keys(12)
    with pytest.raises(StoreError, match="broken") as err:       # strict: a failed write is an error, not a count
        pool.put_many({k: tensor_for(k) for k in keys})
    assert err.value.stored + err.value.failed == len(keys) == err.value.stored + pool.stats()["put_errors"]
    pool.put_many({k: tensor_for(k) for k in keys})
    assert all(dev == 0 for _, dev, *_ in pool.entries())
    assert all(v is not None for v in pool.get_many(keys).values())
