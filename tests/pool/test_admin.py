"""The pool never loses what it acknowledged to an admin command or a neighbour (issue 37): ``init --force`` never
overrides a live writer and deletes nothing before everything is validated; an index folder belongs to one pool;
a block device or file that looks like data is never formatted; a full disk fails one put, not the device;
close() racing puts is a clear error, never a raw one; a remote store that cannot be used is one error line."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import yaml

from kvflow.cli.main import main
from kvflow.errors import ConfigError, KVFlowError, StoreError
from kvflow.pool import KVPool
from kvflow.pool.devices.signatures import looks_like_data

from .helpers import context_keys, fill as _fill, served, tensor_for


def fill(cfg, n=12, seed=0):
    return _fill(cfg, n, seed)


def cfg_for(tmp_path, index="idx", disk="disk.img", files="files") -> dict:
    return {"index_dir": str(tmp_path / index), "chunk_tokens": 16, "devices": [
        {"type": "extent", "path": str(tmp_path / disk), "capacity": "4M", "bandwidth": "1G", "zero_fill": False,
         "direct": False},
        {"type": "files", "path": str(tmp_path / files), "capacity": "4M", "bandwidth": "1G"}]}


def write_yaml(tmp_path, cfg, name="kvflow.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"pool": cfg}))
    return path


def one_error_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


def test_init_force_refuses_a_pool_a_live_writer_holds(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    keys = context_keys(12)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:6]})
        assert main(["pool", "init", str(write_yaml(tmp_path, cfg)), "--force"]) == 2
        one_error_line(capsys, "open for writing by a running kvflow process")
        assert pool.put_many({k: tensor_for(k) for k in keys[6:]}) == 6      # the writer goes on, undisturbed
    assert served(cfg, keys) == len(keys)


@pytest.mark.parametrize("spoil", ["files-folder-with-other-files", "index-with-other-files", "ordinary-file"])
def test_init_force_deletes_nothing_when_any_entry_is_refused(tmp_path, capsys, spoil):
    cfg = cfg_for(tmp_path)
    keys = fill(cfg)
    bad = {**cfg, "devices": [dict(d) for d in cfg["devices"]]}
    if spoil == "files-folder-with-other-files":          # the last entry is the refused one
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "notes.txt").write_text("mine")
        bad["devices"][1]["path"] = str(tmp_path / "other")
    elif spoil == "index-with-other-files":
        (tmp_path / "idx" / "notes.txt").write_text("mine")
    else:
        (tmp_path / "important.txt").write_text("mine")
        bad["devices"].append({"type": "extent", "path": str(tmp_path / "important.txt"), "capacity": "1M"})
    before = (tmp_path / "disk.img").read_bytes()
    assert main(["pool", "init", str(write_yaml(tmp_path, bad)), "--force"]) == 2
    one_error_line(capsys, "yourself")
    assert (tmp_path / "disk.img").read_bytes() == before
    if spoil == "index-with-other-files":
        (tmp_path / "idx" / "notes.txt").unlink()
    assert served(cfg, keys) == len(keys)


def test_init_force_formats_an_empty_file_and_an_idle_kvflow_device(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    fill(cfg)
    (tmp_path / "empty.img").touch()
    cfg["devices"].append({"type": "extent", "path": str(tmp_path / "empty.img"), "capacity": "1M",
                           "zero_fill": False, "direct": False})
    assert main(["pool", "init", str(write_yaml(tmp_path, cfg)), "--force"]) == 0
    with KVPool.open(cfg) as pool:
        assert pool.stats()["records"] == 0 and len(pool.stats()["devices"]) == 3


def test_a_second_config_on_the_same_index_dir_is_refused_and_the_first_loses_nothing(tmp_path):
    a = cfg_for(tmp_path)
    b = cfg_for(tmp_path, disk="other.img", files="other-files")
    keys = fill(a)
    with pytest.raises(ConfigError, match="give each pool its own index_dir"):
        KVPool.open(b)
    with pytest.raises(ConfigError, match="give each pool its own index_dir"):
        KVPool.open(b, readonly=True)
    assert served(a, keys) == len(keys)


def test_a_pool_may_gain_a_device_in_its_config(tmp_path):
    cfg = cfg_for(tmp_path)
    keys = fill(cfg)
    cfg["devices"].append({"type": "extent", "path": str(tmp_path / "more.img"), "capacity": "2M",
                           "bandwidth": "1G", "zero_fill": False, "direct": False})
    assert served(cfg, keys) == len(keys)


@pytest.mark.parametrize("value", ["", ".", "./", "env"])
def test_an_empty_or_dot_index_dir_is_an_error_not_the_config_folder(tmp_path, monkeypatch, capsys, value):
    cfg = cfg_for(tmp_path)
    if value == "env":
        monkeypatch.setenv("KVFLOW_POOL_INDEX_DIR", "")
    else:
        cfg["index_dir"] = value
    assert main(["pool", "init", str(write_yaml(tmp_path, cfg))]) == 2
    one_error_line(capsys, "pool.index_dir", "names no folder")
    assert not (tmp_path / "disk.img").exists() and not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("size", ["-5M", "0", "100K"])
def test_probe_size_below_one_probe_chunk_is_one_error_line(tmp_path, capsys, size):
    path = write_yaml(tmp_path, cfg_for(tmp_path))
    assert main(["pool", "probe", str(path), "--size", size]) == 2
    one_error_line(capsys, "--size")


def test_looks_like_data_finds_a_signature_beyond_a_zero_first_page(tmp_path):
    img = tmp_path / "fs.img"
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    fd = os.open(img, os.O_RDWR)
    try:
        assert looks_like_data(fd, 8 << 20) is None
        os.pwrite(fd, b"CD001", 32769)                           # ISO 9660: nothing in the first 32 KiB
        assert "ISO 9660" in looks_like_data(fd, 8 << 20)
        os.pwrite(fd, b"\0" * 5, 32769)
        os.pwrite(fd, b"x", (8 << 20) - 100)                     # something near the end (a backup GPT, md, ...)
        assert "non-zero bytes" in looks_like_data(fd, 8 << 20)
    finally:
        os.close(fd)


def test_a_block_device_with_a_filesystem_beyond_its_first_page_is_never_formatted(tmp_path, capsys):
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("loop devices need root and losetup")
    img = tmp_path / "btrfs.img"
    with open(img, "wb") as f:
        f.truncate(16 << 20)
        f.seek(65536 + 64)
        f.write(b"_BHRfS_M")                                    # btrfs: the first 64 KiB are zero
    before = img.read_bytes()
    try:
        loop = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True, check=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"losetup not allowed here: {err}")
    try:
        cfg = {"index_dir": str(tmp_path / "idx"), "chunk_tokens": 16,
               "devices": [{"type": "extent", "path": loop, "bandwidth": "1G", "direct": False}]}
        for force in ([], ["--force"]):
            assert main(["pool", "init", str(write_yaml(tmp_path, cfg)), *force]) == 2
            one_error_line(capsys, "btrfs", "wipefs")
    finally:
        subprocess.run(["losetup", "-d", loop], check=False, timeout=20)
    assert img.read_bytes() == before


def test_enospc_fails_one_put_and_keeps_the_device_serving(tmp_path):
    cfg = cfg_for(tmp_path)
    cfg["devices"] = cfg["devices"][:1]
    keys = context_keys(40, seed=1)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys[:30]})
        device = pool.slots[0].device.inner

        def full(offset, buf):
            raise OSError(errno.ENOSPC, "No space left on device")
        real, device.commit = device.commit, full
        for _ in range(5):                                   # more failures than take a failing device away
            with pytest.raises(StoreError, match="No space left"):
                pool.put_many({k: tensor_for(k) for k in keys[30:33]})
        device.commit = real
        dev = pool.stats()["devices"][0]
        assert dev["healthy"] and dev["full"] == 5 * 3
        got = pool.get_many(keys[:30])
        assert all(got[k] is not None and torch.equal(got[k], tensor_for(k)) for k in keys[:30])
        assert pool.put_many({k: tensor_for(k) for k in keys[30:]}) == 10


def test_close_racing_put_many_is_a_clear_error_never_a_raw_one(tmp_path):
    for trial in range(6):
        cfg = cfg_for(tmp_path / str(trial))
        pool = KVPool.open(cfg)
        keys = context_keys(60, seed=trial)
        acked, raw = [], []

        def put(part):
            for k in part:
                try:
                    if pool.put_many({k: tensor_for(k)}) == 1:
                        acked.append(k)
                except KVFlowError:
                    return
                except Exception as err:  # noqa: BLE001 — the property under test
                    raw.append(err)
                    return
        threads = [threading.Thread(target=put, args=(keys[i::3],)) for i in range(3)]
        for th in threads:
            th.start()
        pool.close()
        for th in threads:
            th.join()
        assert not raw, raw
        assert served(cfg, acked) == len(acked)


def test_a_remote_store_that_does_not_answer_is_one_error_line_at_init(tmp_path):
    cfg = {"index_dir": str(tmp_path / "idx"), "devices": [
        {"type": "memory", "capacity": "4M"}, {"type": "remote", "url": "redis://127.0.0.1:1", "timeout_s": 0.5}]}
    done = subprocess.run([sys.executable, "-m", "kvflow", "pool", "init", str(write_yaml(tmp_path, cfg))],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert "does not answer" in lines[0]


def test_a_standalone_redis_where_a_cluster_is_expected_is_one_error_line(tmp_path):
    from kvflow.pool.redis_local import RedisProcs, redis_available
    if (why := redis_available()) is not None:
        pytest.skip(why)
    rp = RedisProcs(masters=1, cluster=False).start()
    try:
        cfg = {"index_dir": str(tmp_path / "idx"), "devices": [
            {"type": "memory", "capacity": "4M"}, {"type": "remote", "url": rp.url}]}     # cluster: true default
        done = subprocess.run([sys.executable, "-m", "kvflow", "pool", "init", str(write_yaml(tmp_path, cfg))],
                              capture_output=True, text=True, timeout=120)
    finally:
        rp.stop()
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert "not a cluster" in lines[0] and "cluster: false" in lines[0]


@pytest.mark.parametrize("argv", [["init"], ["init", "--force"], ["probe"], ["fsck"], ["fsck", "--rebuild"]])
def test_every_writing_admin_command_is_refused_beside_a_live_writer(tmp_path, capsys, argv):
    cfg = cfg_for(tmp_path)
    keys = context_keys(6)
    path = write_yaml(tmp_path, cfg)
    with KVPool.open(cfg) as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
        assert main(["pool", argv[0], str(path), *argv[1:]]) == 2
        one_error_line(capsys, "open for writing")
    assert served(cfg, keys) == len(keys)
