"""Corruption is always a miss, never served: flipped payload or header bytes, a truncated device file, a record
asked for under another model's fingerprint, a stale extent. Each is counted, logged and dropped; fsck finds them
all."""

import logging
import os

import pytest
import torch

from kvflow.chunks.keys import ChunkKey
from kvflow.pool import KVPool

from .helpers import context_keys, device_cfg, flip_byte, tensor_for

SB = 4096  # file-backed devices start their data after a 4 KiB superblock


def stored_pool(tmp_path, kind, n=8):
    cfg = {"index_dir": str(tmp_path / "idx"), "devices": [device_cfg(tmp_path, kind, bandwidth=1 << 30)]}
    keys = context_keys(n)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
        where = {d: off for d, _dev, off, _len, _seq in pool.entries()}
        files = pool.slots[0].device.inner
    locate = (lambda off: (files._path(off), 0)) if kind == "files" else (lambda off: (cfg["devices"][0]["path"],
                                                                                       SB + off))
    return cfg, keys, {k: locate(where[k.digest]) for k in keys}


def flip(path, pos):
    flip_byte(path, pos, 0x40)


@pytest.mark.parametrize("kind", ["memory", "extent", "files"])
@pytest.mark.parametrize("where", [200, 5, 100])       # payload byte, magic, header field
def test_a_flipped_byte_is_a_counted_logged_dropped_miss(tmp_path, kind, where, caplog):
    cfg, keys, loc = stored_pool(tmp_path, kind)
    path, base = loc[keys[3]]
    flip(path, base + where)
    with KVPool.open(cfg) as pool, caplog.at_level(logging.WARNING, logger="kvflow.pool"):
        got = pool.get_many(keys)
        assert got[keys[3]] is None
        assert all(torch.equal(got[k], tensor_for(k)) for k in keys if k != keys[3])
        assert pool.stats()["corrupt"] == 1 and pool.contains([keys[3]]) == [False]
        assert keys[3].hex in caplog.text
        pool.get_many(keys)
        assert pool.stats()["corrupt"] == 1, "dropped: not read (nor counted) again"
    with KVPool.open(cfg) as pool:
        assert pool.contains([keys[3]]) == [False], "the drop was logged durably"


def test_a_truncated_extent_file_loses_only_the_records_past_the_cut(tmp_path):
    cfg, keys, loc = stored_pool(tmp_path, "extent")
    cut = sorted(pos for _, pos in loc.values())[4]
    os.truncate(cfg["devices"][0]["path"], cut)
    with KVPool.open(cfg) as pool:
        got = pool.get_many(keys)
        kept = [k for k in keys if loc[k][1] < cut]
        assert len(kept) == 4 and pool.stats()["recovery_dropped"] == 4
        assert all(torch.equal(got[k], tensor_for(k)) for k in kept)
        assert all(got[k] is None for k in keys if k not in kept)
        pool.put_many({k: tensor_for(k) for k in keys})            # the device is whole again
        assert all(v is not None for v in pool.get_many(keys).values())


def test_a_truncated_record_file_is_a_miss(tmp_path):
    cfg, keys, loc = stored_pool(tmp_path, "files")
    os.truncate(loc[keys[0]][0], 1000)
    os.unlink(loc[keys[1]][0])
    with KVPool.open(cfg) as pool:
        got = pool.get_many(keys)
        assert got[keys[0]] is None and got[keys[1]] is None and pool.stats()["corrupt"] == 2
        assert all(got[k] is not None for k in keys[2:])


def test_a_record_asked_for_under_another_model_is_a_miss():
    key = context_keys(1)[0]
    imposter = ChunkKey(key.digest, "f" * 32, key.tokens, key.layers)
    with KVPool.memory("1M") as pool:
        pool.put_many({key: tensor_for(key)})
        assert pool.get_many([imposter])[imposter] is None
        assert pool.stats()["corrupt"] == 1


def test_a_stale_extent_holding_another_record_is_a_miss(tmp_path):
    cfg, keys, loc = stored_pool(tmp_path, "extent")
    (path, a), (_, b) = loc[keys[0]], loc[keys[1]]
    with open(path, "r+b") as f:
        f.seek(b)
        other = f.read(4096)
        f.seek(a)
        f.write(other)                                 # key 0's extent now holds key 1's (valid) record
    with KVPool.open(cfg) as pool:
        got = pool.get_many(keys[:2])
        assert got[keys[0]] is None and torch.equal(got[keys[1]], tensor_for(keys[1]))


def test_fsck_reports_and_drops_every_bad_record(tmp_path):
    cfg, keys, loc = stored_pool(tmp_path, "extent")
    for k in keys[:3]:
        flip(loc[k][0], loc[k][1] + 300)
    with KVPool.open(cfg, readonly=True) as ro:
        report = ro.fsck()
        assert len(report["bad"]) == 3 and not report["repaired"]
    with KVPool.open(cfg) as pool:
        report = pool.fsck()
        assert report["checked"] == 8 and report["overlaps"] == 0
        assert sorted(b["key"] for b in report["bad"]) == sorted(k.hex for k in keys[:3])
        assert pool.fsck()["bad"] == [] and len(pool.entries()) == 5
