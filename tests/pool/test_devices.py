"""Every device type moves whole records at allocator-chosen offsets, survives reopening when it has a path, and
refuses to clobber a file that is not a kvflow device."""

import errno
import fcntl
import os
import shutil
import subprocess

import pytest
import torch

from kvflow.errors import ConfigError, RecordError
from kvflow.pool.config import DeviceConfig
from kvflow.pool.devices import DEVICE_TYPES, open_device
from kvflow.pool.devices.base import ALIGN

from .helpers import device_cfg, odirect_supported


def roundtrip(dev, offset: int, payload: bytes) -> bytes:
    buf = dev.staging(offset, len(payload))
    buf[:len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dev.commit(offset, buf)
    dev.sync()
    out = dev.read(offset, len(payload))
    assert out.data_ptr() % ALIGN == 0, "reads land in page-aligned (pin-able) memory"
    return bytes(out.numpy())


@pytest.mark.parametrize("kind", ["memory", "extent", "files"])
def test_a_record_written_at_an_offset_reads_back_and_persists(tmp_path, kind):
    cfg = DeviceConfig(**device_cfg(tmp_path, kind, capacity=1 << 20))
    dev = open_device(cfg)
    assert dev.fresh and dev.capacity == 1 << 20
    payload = os.urandom(10_000)
    assert roundtrip(dev, 3 * ALIGN, payload) == payload
    dev.close()
    again = open_device(cfg)
    assert not again.fresh
    assert bytes(again.read(3 * ALIGN, len(payload)).numpy()) == payload
    again.close()
    ro = open_device(cfg, readonly=True)
    assert bytes(ro.read(3 * ALIGN, len(payload)).numpy()) == payload
    ro.close()


def test_anonymous_memory_is_volatile_and_encodes_in_place():
    dev = open_device(DeviceConfig(type="memory", capacity=1 << 20))
    assert not dev.persistent
    buf = dev.staging(ALIGN, 100)
    buf.fill_(7)
    dev.commit(ALIGN, buf)
    assert dev.read(ALIGN, 100).eq(7).all()
    dev.close()


def test_extent_device_uses_o_direct_when_the_filesystem_allows(tmp_path):
    if not odirect_supported(tmp_path):
        pytest.skip("tmp_path's filesystem has no O_DIRECT")
    dev = open_device(DeviceConfig(**device_cfg(tmp_path, "extent", capacity=1 << 20)))
    assert fcntl.fcntl(dev._fd, fcntl.F_GETFL) & os.O_DIRECT
    dev.close()


def test_extent_on_a_filesystem_without_o_direct_is_one_clear_error(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.raises(ConfigError, match="does not support O_DIRECT"):
        open_device(DeviceConfig(type="extent", path=str(tmp_path / "x.img"), capacity=1 << 20))


@pytest.mark.parametrize("kind", ["memory", "extent"])
def test_a_file_that_is_not_a_kvflow_device_is_never_overwritten(tmp_path, kind):
    cfg = DeviceConfig(**device_cfg(tmp_path, kind, capacity=1 << 20))
    with open(cfg.path, "wb") as f:
        f.write(b"precious user data" * 1000)
    with pytest.raises(ConfigError, match="not a kvflow device"):
        open_device(cfg)
    assert open(cfg.path, "rb").read(7) == b"preciou"


def test_a_truncated_extent_file_reports_what_survived_and_short_reads_fail(tmp_path):
    cfg = DeviceConfig(**device_cfg(tmp_path, "extent", capacity=1 << 20))
    dev = open_device(cfg)
    dev.close()
    os.truncate(cfg.path, ALIGN + 8 * ALIGN)
    ro = open_device(cfg, readonly=True)
    with pytest.raises(RecordError, match="short read"):
        ro.read(7 * ALIGN, 2 * ALIGN)
    ro.close()
    dev = open_device(cfg)
    assert dev.intact_bytes == 8 * ALIGN and dev.capacity == 1 << 20
    dev.close()


def test_registry_knows_every_device_type():
    assert set(DEVICE_TYPES) >= {"memory", "extent", "files"}


@pytest.fixture
def loop_device(tmp_path):
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("loop devices need root and losetup")
    img = tmp_path / "loop.img"
    with open(img, "wb") as f:
        f.truncate(4 << 20)
    try:
        dev = subprocess.run(["losetup", "--direct-io=on", "--sector-size", "4096", "-f", "--show", str(img)],
                             check=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except (subprocess.SubprocessError, OSError) as err:
        pytest.skip(f"losetup not allowed here: {err}")
    yield dev
    subprocess.run(["losetup", "-d", dev], check=False, timeout=20)


def test_extent_works_on_a_loop_block_device(loop_device):
    cfg = DeviceConfig(type="extent", path=loop_device)
    dev = open_device(cfg)
    assert dev.block_device and dev.capacity == (4 << 20) - 2 * ALIGN      # superblock and its backup copy
    payload = os.urandom(3 * ALIGN + 5)
    assert roundtrip(dev, 2 * ALIGN, payload) == payload
    dev.close()
    assert not open_device(cfg).fresh


@pytest.mark.parametrize("kind", ["memory", "extent"])
def test_a_capacity_that_is_not_a_multiple_of_4k_is_rounded_down(tmp_path, kind):
    dev = open_device(DeviceConfig(**device_cfg(tmp_path, kind, capacity=(1 << 20) + 1000)))
    assert dev.capacity == 1 << 20
    dev.close()
