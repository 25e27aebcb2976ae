"""``extent``: KV-passthrough to an SSD. One preallocated file or raw block device, opened O_DIRECT; records move
with one ``os.preadv``/``os.pwritev`` each between page-aligned buffers and 4 KiB-aligned offsets the pool's extent
allocator chose — no per-record files, no open/stat/close, no page cache on the read path.

    [ superblock 4 KiB | data: capacity bytes, addressed by the pool as offsets 0 .. capacity | backup superblock ]

The superblock names the owning pool (id, device id, generation, index folder) and is kept twice, so a zeroed first
page is recovered from the last one. A file that exists without a kvflow superblock is refused, never zero-filled,
and so is a block device carrying a file system or partition signature or other non-zero bytes in its first or
last MiB (``devices/signatures.py``); a writer holds an flock on the device.

Works on a regular file (zero-filled once at creation so first writes do not allocate blocks) and on a block
device, e.g. a loop device: ``losetup --direct-io=on --sector-size 4096 -f --show disk.img``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import replace

import torch

from kvflow.errors import ConfigError, RecordError
from kvflow.pool.devices.base import (SUPERBLOCK, Device, Owner, aligned_empty, file_size, flock_writer, not_a_device,
                                      into, pack_owner, padded, parse_owner, parse_superblock)
from kvflow.pool.devices.signatures import looks_like_data

log = logging.getLogger("kvflow.pool")


def odirect_supported(folder: str | os.PathLike) -> bool:
    """Whether files in ``folder`` can be opened O_DIRECT (tmpfs and some overlays cannot)."""
    path = os.path.join(folder, ".odirect-probe")
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    os.unlink(path)
    return True

_ZERO_STEP = 8 << 20


def _data_beyond_first_page(path: str, size: int) -> str | None:
    """File system / partition signatures (btrfs and ISO 9660 leave the first page empty) or any non-zero byte in
    the head or tail of a block device, read through the page cache (a probe, not a record read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return looks_like_data(fd, size)
    finally:
        os.close(fd)


class ExtentDevice(Device):
    kind = "ssd"
    needs_capacity = False   # a block device's size is its capacity

    def __init__(self, cfg, readonly: bool = False):
        super().__init__(cfg, readonly)
        path = cfg.path
        exists = os.path.exists(path)
        if readonly and not exists:
            raise ConfigError(f"extent device {path} does not exist (create the pool first: kvflow pool init)")
        self.block_device = exists and stat.S_ISBLK(os.stat(path).st_mode)
        flags = (os.O_RDONLY if readonly else os.O_RDWR | (0 if self.block_device else os.O_CREAT))
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if cfg.direct else 0), 0o600)
        except OSError as err:
            if err.errno == errno.EINVAL and cfg.direct:
                raise ConfigError(f"{path}: this filesystem does not support O_DIRECT; put the extent file on a "
                                  f"disk filesystem (ext4, xfs) or a block device, or set direct: false") from None
            raise ConfigError(f"{path}: cannot open extent device: {err.strerror}") from None
        try:
            if not readonly:
                self._lock(path)
            self._open_layout(path, readonly, exists)
        except BaseException:
            os.close(self._fd)
            if not exists and not self.block_device:
                os.unlink(path)          # a file this open created and could not finish is not left behind
            raise

    def _lock(self, path: str) -> None:
        if not flock_writer(self._fd):
            raise ConfigError(f"{path} is in use by another writable kvflow pool (an extent device has one "
                              f"writer; open other pools read-only)")

    def _open_layout(self, path: str, readonly: bool, existed: bool) -> None:
        have = file_size(self._fd)
        head = self._pread_aligned(SUPERBLOCK, 0) if have >= SUPERBLOCK else b""
        recorded, self.owner = parse_superblock(head), parse_owner(head)
        last = (have // SUPERBLOCK - 1) * SUPERBLOCK
        if recorded is None and last >= SUPERBLOCK:          # a zeroed or torn primary: the backup says what it is
            self.owner = parse_owner(self._pread_aligned(SUPERBLOCK, last))
            if self.owner is not None:
                recorded = self.owner.capacity
                log.warning("%s: primary superblock damaged; recovered from the backup copy", path)
                if not readonly:
                    self._pwrite_aligned(pack_owner(self.owner), 0)
        self.fresh = recorded is None
        if self.fresh and (any(head) or (have > 0 and not self.block_device)):
            raise not_a_device(path)          # never zero-fill what may be someone's data
        if self.fresh and self.block_device and (why := _data_beyond_first_page(path, have)):
            raise ConfigError(f"{path} is not a kvflow device and carries {why}; kvflow formats only an empty block "
                              f"device — wipe it yourself (wipefs -a) if it is really unused")
        if self.block_device:
            self.capacity = min(self.cfg.capacity or have, have - 2 * SUPERBLOCK) // SUPERBLOCK * SUPERBLOCK
            if not self.fresh:
                self.capacity = min(self.capacity, recorded)
        elif not self.cfg.capacity:
            if recorded is None:
                raise ConfigError(f"{path}: capacity is required to create an extent file")
            self.capacity = recorded
        if readonly:
            if self.fresh:
                raise ConfigError(f"{path} is not an initialised kvflow extent device (run kvflow pool init)")
            self.capacity = min(self.capacity, max(have - SUPERBLOCK, 0))
            return
        size = 2 * SUPERBLOCK + self.capacity           # superblock | data | backup superblock
        if self.block_device:
            self._backup_at = have // SUPERBLOCK * SUPERBLOCK - SUPERBLOCK
        else:
            self._backup_at = size - SUPERBLOCK
            if not self.fresh and have < size - SUPERBLOCK:
                self.intact_bytes = max(have - SUPERBLOCK, 0)
            if self.fresh:
                self._reserve(path, size)
            elif have != size:
                os.ftruncate(self._fd, size)
        if self.owner is None:                           # new, or written by a kvflow without owners
            self.owner = Owner(self.capacity, "00" * 16, 0, 0, "")
        self._write_superblocks(replace(self.owner, capacity=self.capacity))
        if self.fresh and self.cfg.zero_fill:
            self._zero(0, self.capacity)

    def _reserve(self, path: str, size: int) -> None:
        """A new file gets its whole capacity now, or a clear error: free space is checked first, then the blocks
        are allocated (fallocate), so a full disk is an error at init, not ENOSPC under later writes."""
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise ConfigError(f"{path}: capacity {self.capacity / 2**20:,.0f} MiB does not fit the "
                              f"{free / 2**20:,.0f} MiB free on its file system")
        # the superblock first: a crash from here on leaves a kvflow device (never a file init would refuse)
        self._pwrite_aligned(pack_owner(Owner(self.capacity, "00" * 16, 0, 0, "")), 0)
        os.fsync(self._fd)
        os.ftruncate(self._fd, size)
        if self.cfg.zero_fill:
            try:
                os.posix_fallocate(self._fd, 0, size)
            except OSError as err:
                os.ftruncate(self._fd, 0)
                raise ConfigError(f"{path}: cannot allocate {size / 2**20:,.0f} MiB: {err.strerror}") from None

    def _write_superblocks(self, owner: Owner) -> None:
        self.owner = owner
        block = pack_owner(owner)
        self._pwrite_aligned(block, 0)
        self._pwrite_aligned(block, self._backup_at)
        os.fsync(self._fd)

    def claim(self, owner: Owner) -> None:
        """Make this device ``owner``'s (primary and backup superblock, fsynced)."""
        if not self.readonly:
            self._write_superblocks(replace(owner, capacity=self.capacity))

    def _zero(self, start: int, end: int) -> None:
        zeros = aligned_empty(min(_ZERO_STEP, max(end - start, SUPERBLOCK))).zero_()
        for pos in range(start, end, _ZERO_STEP):
            n = min(_ZERO_STEP, end - pos)
            os.pwritev(self._fd, [zeros[:n].numpy()], SUPERBLOCK + pos)

    def _pread_aligned(self, n: int, pos: int) -> bytes:
        buf = aligned_empty(n)
        got = os.preadv(self._fd, [buf.numpy()], pos)
        return bytes(buf[:got].numpy())

    def _pwrite_aligned(self, data: bytes, pos: int) -> None:
        buf = aligned_empty(padded(len(data)))
        buf[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        os.pwritev(self._fd, [buf.numpy()], pos)

    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        buf = into(out, padded(length))
        got = os.preadv(self._fd, [buf.numpy()], SUPERBLOCK + offset)  # DMA into our buffer; GIL released
        if got < length:
            raise RecordError(f"{self.name}: short read at {offset} ({got} of {length} bytes): device truncated?")
        return buf[:length]

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        view, pos = buf.numpy(), SUPERBLOCK + offset
        done = 0
        while done < len(view):
            n = os.pwritev(self._fd, [view[done:]], pos + done)
            if n <= 0:
                raise OSError(errno.EIO, f"{self.name}: write at {offset} made no progress")
            done += n
            if done < len(view) and done % SUPERBLOCK:
                # O_DIRECT needs aligned buffers, offsets and lengths: resubmit from the last whole page, not from
                # an unaligned view (which the kernel refuses with EINVAL)
                done -= done % SUPERBLOCK

    def sync(self) -> None:
        if not self.readonly:
            os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def describe(self) -> dict:
        return super().describe() | {"path": self.cfg.path, "direct": self.cfg.direct,
                                     "block_device": self.block_device}
