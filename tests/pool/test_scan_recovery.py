"""Recovery keeps everything intact: the index is a cache of what the devices hold, so a damaged checkpoint, a
damaged log entry, a corrupt manifest or a deleted index folder is rebuilt from the records' own headers; only a
record whose own bytes are damaged disappears, and fsck right after recovery is clean."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvflow.cli.main import main
from kvflow.pool import KVPool
from kvflow.pool.recovery import scan_device

from .helpers import context_keys, flip_byte, tensor_for


def make_pool(tmp_path, n=24) -> tuple[dict, list]:
    cfg = {"index_dir": str(tmp_path / "idx"), "chunk_tokens": 16, "checkpoint_interval_s": 3600,
           "wal_compact_bytes": 64 << 20, "devices": [
               {"type": "extent", "path": str(tmp_path / "disk.img"), "capacity": "4M", "bandwidth": "1G",
                "zero_fill": False, "direct": False},
               {"type": "files", "path": str(tmp_path / "files"), "capacity": "4M", "bandwidth": "1G"},
               {"type": "memory", "path": str(tmp_path / "shm"), "capacity": "4M", "bandwidth": "1G"}]}
    keys = context_keys(n, seed=3)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[: n // 2]})
        pool.checkpoint()                                   # half in the checkpoint ...
        pool.put_many({k: tensor_for(k) for k in keys[n // 2:]})
        pool._state.journal.sync()                          # ... half only in the log (as after a crash)
        pool._closed = True                                 # leave without the closing checkpoint
        pool._stop.set()
        pool._bg.join()
        pool._teardown()
    return cfg, keys


def served_intact(cfg, keys) -> int:
    with KVPool.open(cfg) as pool:
        got = pool.get_many(keys)
        assert not pool.fsck(repair=False)["bad"], "fsck is clean right after recovery"
    assert all(got[k] is None or torch.equal(got[k], tensor_for(k)) for k in keys), "never a wrong record"
    return sum(got[k] is not None for k in keys)


def flip(path, pos):
    flip_byte(path, pos, 0x10)


DAMAGES = ["checkpoint", "log-entry", "manifest", "index-folder", "checkpoint-deleted", "log-deleted",
           "log-first-page-zeroed", "device-id-changed"]


def damage_index(idx, damage):
    if damage == "checkpoint-deleted":
        (idx / "checkpoint").unlink()
    elif damage == "log-deleted":
        for wal in idx.glob("wal.*"):
            wal.unlink()
    elif damage == "log-first-page-zeroed":
        wal = max(idx.glob("wal.*"), key=lambda p: p.stat().st_size)
        with open(wal, "r+b") as f:
            f.write(bytes(min(4096, wal.stat().st_size)))
    elif damage == "device-id-changed":
        manifest = json.loads((idx / "manifest.json").read_text())
        for d in manifest["devices"]:
            d["id"] += 7
        (idx / "manifest.json").write_text(json.dumps(manifest))
    else:
        return False
    return True


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_index_is_rebuilt_from_the_records(tmp_path, damage):
    cfg, keys = make_pool(tmp_path)
    idx = tmp_path / "idx"
    if damage_index(idx, damage):
        pass
    elif damage == "checkpoint":
        flip(idx / "checkpoint", 100)
    elif damage == "log-entry":
        wal = max(idx.glob("wal.*"), key=lambda p: p.stat().st_size)
        flip(wal, 64 * 3 + 10)
    elif damage == "manifest":
        (idx / "manifest.json").write_text("{not json")
    else:
        shutil.rmtree(idx)
    assert served_intact(cfg, keys) == len(keys)


@pytest.mark.parametrize("damage", ["checkpoint-deleted", "log-deleted", "log-first-page-zeroed"])
def test_puts_after_a_lost_index_file_never_overwrite_the_records_it_named(tmp_path, damage):
    cfg, keys = make_pool(tmp_path)
    damage_index(tmp_path / "idx", damage)
    more = context_keys(40, seed=9)
    with KVPool.open(cfg) as pool:
        assert pool.put_many({k: tensor_for(k) for k in more}) == len(more)
    assert served_intact(cfg, keys + more) == len(keys) + len(more)
    assert main(["pool", "fsck", "--rebuild", str(write_config(tmp_path, cfg))]) == 0


def write_config(tmp_path, cfg):
    import yaml
    path = tmp_path / "kvflow.yaml"
    path.write_text(yaml.safe_dump({"pool": cfg}))
    return path


def test_a_damaged_record_is_the_only_one_that_goes(tmp_path):
    cfg, keys = make_pool(tmp_path)
    with KVPool.open(cfg, readonly=True) as pool:
        digest, dev, off, n, _ = next(r for r in pool.entries() if r[1] == 0)
    flip(tmp_path / "disk.img", 4096 + off + 200)        # payload of one record on the extent
    shutil.rmtree(tmp_path / "idx")                     # and the index: the scan must skip exactly that record
    assert served_intact(cfg, keys) == len(keys) - 1


def test_the_newest_record_of_a_key_wins_a_scan(tmp_path):
    cfg, keys = make_pool(tmp_path, n=4)
    with KVPool.open(cfg) as pool:
        rows = {d: (dev, seq) for d, dev, _, _, seq in pool.entries()}
    with KVPool.open(cfg) as pool:
        device = pool.slots[0].device.inner
        found, bad = scan_device(device, pool.slots[0].id)
    assert bad == 0 and {d: op.seq for d, op in found.items()} == {d: s for d, (dev, s) in rows.items() if dev == 0}


def test_fsck_rebuild_reports_what_it_found(tmp_path, capsys):
    cfg, keys = make_pool(tmp_path)
    import yaml
    (tmp_path / "kvflow.yaml").write_text(yaml.safe_dump({"pool": cfg}))
    shutil.rmtree(tmp_path / "idx")
    (tmp_path / "idx").mkdir()
    assert main(["pool", "fsck", str(tmp_path / "kvflow.yaml"), "--rebuild"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{len(keys)} indexed" in out and "0 bad" in out
    assert main(["pool", "fsck", str(tmp_path / "kvflow.yaml"), "--rebuild", "--dry-run"]) == 2


def test_fsck_counts_the_records_on_the_devices_that_the_index_does_not_name(tmp_path, capsys):
    cfg, keys = make_pool(tmp_path)
    with KVPool.open(cfg) as pool:
        assert pool.fsck(repair=False, scan=True)["unindexed"] == 0
        lost = [(d, dev) for d, dev, *_ in pool.entries() if dev != 2][:5]     # memory rows are not scanned
        with pool._state.lock:                                                # the index forgets 5 rows
            for d, _ in lost:
                pool._state.table.remove(d)
        assert pool.fsck(repair=False, scan=True)["unindexed"] == 5
    path = write_config(tmp_path, cfg)               # the closing checkpoint made the forgetting durable
    assert main(["pool", "fsck", str(path)]) == 0
    assert "5 intact records on the devices are not in the index" in capsys.readouterr().out
    assert main(["pool", "fsck", "--rebuild", str(path)]) == 0
    assert "not in the index" not in capsys.readouterr().out
    assert served_intact(cfg, keys) == len(keys)
