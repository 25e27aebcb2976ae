"""Owned devices: each extent names its pool (id, device id, generation, index folder) in a superblock kept twice;
a zeroed first page is recovered from the backup, a file that is not a kvflow device is refused and left as it was,
a device of another pool is refused, one writer holds the device, a capacity the disk cannot hold is an error at
init, ``pool init --force`` formats, and a short O_DIRECT write is resubmitted aligned."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import yaml

from kvflow.cli.main import main
from kvflow.errors import ConfigError, KVFlowError
from kvflow.pool import KVPool
from kvflow.pool.config import DeviceConfig
from kvflow.pool.devices import open_device
from kvflow.pool.devices.base import SUPERBLOCK, aligned_empty, parse_owner

from .helpers import fill, odirect_supported, served


def cfg_for(tmp_path, index="idx", **dev) -> dict:
    return {"index_dir": str(tmp_path / index), "chunk_tokens": 16, "devices": [
        {"type": "extent", "path": str(tmp_path / "disk.img"), "capacity": "2M", "bandwidth": "1G",
         "zero_fill": False, "direct": False, **dev}]}


def test_the_superblock_names_the_pool_and_has_a_backup(tmp_path):
    cfg = cfg_for(tmp_path)
    fill(cfg)
    data = (tmp_path / "disk.img").read_bytes()
    primary, backup = parse_owner(data[:SUPERBLOCK]), parse_owner(data[-SUPERBLOCK:])
    assert primary == backup and primary.index_dir == str(tmp_path / "idx") and primary.generation >= 1


def test_a_zeroed_superblock_is_recovered_from_its_backup(tmp_path):
    cfg = cfg_for(tmp_path)
    keys = fill(cfg)
    with open(tmp_path / "disk.img", "r+b") as f:
        f.write(bytes(SUPERBLOCK))
    assert served(cfg, keys) == len(keys)


@pytest.mark.parametrize("content", [b"my thesis\n" * 1000, bytes(8192), bytes(100)])
def test_a_file_that_is_not_a_kvflow_device_is_refused_and_left_as_it_was(tmp_path, content):
    (tmp_path / "disk.img").write_bytes(content)
    with pytest.raises(ConfigError, match="not a kvflow device"):
        KVPool.open(cfg_for(tmp_path))
    assert (tmp_path / "disk.img").read_bytes() == content


@pytest.mark.parametrize("content", [b"shared segment\n" * 1000, bytes(8192)])
def test_a_memory_file_that_is_not_a_kvflow_device_is_refused_and_left_as_it_was(tmp_path, content):
    (tmp_path / "shm").write_bytes(content)
    cfg = {"index_dir": str(tmp_path / "idx"),
           "devices": [{"type": "memory", "path": str(tmp_path / "shm"), "capacity": "1M", "bandwidth": 1 << 30}]}
    with pytest.raises(ConfigError, match="not a kvflow device"):
        KVPool.open(cfg)
    assert (tmp_path / "shm").read_bytes() == content


def test_a_second_pool_on_the_same_device_is_refused(tmp_path):
    keys = fill(cfg_for(tmp_path))
    with pytest.raises(KVFlowError, match="belongs to another kvflow pool"):
        KVPool.open(cfg_for(tmp_path, index="idx-b"))
    assert served(cfg_for(tmp_path), keys) == len(keys)


def test_one_writer_holds_a_device(tmp_path):
    with KVPool.open(cfg_for(tmp_path)):
        with pytest.raises(KVFlowError, match="in use by another writable kvflow pool"):
            KVPool.open(cfg_for(tmp_path, index="idx-b"))


def test_a_deleted_index_adopts_its_devices_and_rebuilds(tmp_path):
    cfg = cfg_for(tmp_path)
    keys = fill(cfg)
    shutil.rmtree(tmp_path / "idx")
    assert served(cfg, keys) == len(keys)
    assert served(cfg, keys) == len(keys), "and the adopted pool opens again as itself"


def test_a_capacity_larger_than_the_free_space_is_an_error_at_init(tmp_path):
    with pytest.raises(ConfigError, match="does not fit"):
        KVPool.open(cfg_for(tmp_path, capacity="1P"))
    assert not (tmp_path / "disk.img").exists(), "nothing left behind"


def test_init_force_formats_an_idle_pools_device_and_never_an_ordinary_file(tmp_path, capsys):
    (tmp_path / "disk.img").write_bytes(b"old bytes" * 100)
    (tmp_path / "kvflow.yaml").write_text(yaml.safe_dump({"pool": cfg_for(tmp_path)}))
    for force in ([], ["--force"]):
        assert main(["pool", "init", str(tmp_path / "kvflow.yaml"), *force]) == 2
        err = capsys.readouterr().err
        assert "not a kvflow device" in err and "--force" not in err.replace("--force formats", "")
    assert (tmp_path / "disk.img").read_bytes() == b"old bytes" * 100, "left exactly as it was"
    (tmp_path / "disk.img").unlink()
    fill(cfg_for(tmp_path, index="other-idx"))             # an idle device another pool owns: --force takes it
    assert main(["pool", "init", str(tmp_path / "kvflow.yaml")]) == 2
    assert main(["pool", "init", str(tmp_path / "kvflow.yaml"), "--force"]) == 0
    owner = parse_owner((tmp_path / "disk.img").read_bytes()[:SUPERBLOCK])
    assert owner is not None and owner.index_dir == str(tmp_path / "idx")


def test_a_short_direct_write_is_resubmitted_from_an_aligned_page(tmp_path, monkeypatch):
    if not odirect_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    dev = open_device(DeviceConfig(type="extent", path=str(tmp_path / "d.img"), capacity=1 << 20, zero_fill=False))
    real, calls = os.pwritev, []

    def short_once(fd, bufs, offset):
        calls.append((offset, len(bufs[0])))
        if len(calls) == 1:                         # the kernel stops half way, inside a page
            return real(fd, [bufs[0][:SUPERBLOCK]], offset) - 100
        return real(fd, bufs, offset)

    buf = aligned_empty(3 * SUPERBLOCK)
    buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).to(torch.uint8))
    monkeypatch.setattr(os, "pwritev", short_once)
    dev.commit(8192, buf)
    monkeypatch.setattr(os, "pwritev", real)
    assert all(off % SUPERBLOCK == 0 and n % SUPERBLOCK == 0 for off, n in calls), calls
    assert torch.equal(dev.read(8192, buf.numel()), buf)
    dev.close()


def test_init_force_never_removes_what_is_not_a_file_or_block_device(tmp_path, capsys):
    os.symlink("/dev/null", tmp_path / "disk.img")
    (tmp_path / "kvflow.yaml").write_text(yaml.safe_dump({"pool": cfg_for(tmp_path)}))
    assert main(["pool", "init", str(tmp_path / "kvflow.yaml"), "--force"]) == 2
    assert "not a regular file" in capsys.readouterr().err and os.path.exists("/dev/null")
