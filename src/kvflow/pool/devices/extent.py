"""``extent``: KV-passthrough to an SSD. One preallocated file or raw block device, opened O_DIRECT; records move
with one ``os.preadv``/``os.pwritev`` each between page-aligned buffers and 4 KiB-aligned offsets the pool's extent
allocator chose — no per-record files, no open/stat/close, no page cache on the read path.

    [ superblock 4 KiB | data: capacity bytes, addressed by the pool as offsets 0 .. capacity ]

Works on a regular file (zero-filled once at creation so first writes do not allocate blocks) and on a block
device, e.g. a loop device: ``losetup --direct-io=on --sector-size 4096 -f --show disk.img``.
"""

from __future__ import annotations

import errno
import os
import stat

import torch

from kvflow.errors import ConfigError, RecordError
from kvflow.pool.devices.base import (SUPERBLOCK, Device, aligned_empty, file_size, not_a_device, pack_superblock,
                                      padded, parse_superblock)

_ZERO_STEP = 8 << 20


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
            self._open_layout(path, readonly)
        except BaseException:
            os.close(self._fd)
            raise

    def _open_layout(self, path: str, readonly: bool) -> None:
        have = file_size(self._fd)
        head = self._pread_aligned(SUPERBLOCK, 0) if have >= SUPERBLOCK else b""
        recorded = parse_superblock(head)
        self.fresh = recorded is None
        if self.fresh and any(head):
            raise not_a_device(path)
        if self.block_device:
            self.capacity = min(self.cfg.capacity or have, have - SUPERBLOCK) // SUPERBLOCK * SUPERBLOCK
        elif not self.cfg.capacity:
            if recorded is None:
                raise ConfigError(f"{path}: capacity is required to create an extent file")
            self.capacity = recorded
        if readonly:
            if self.fresh:
                raise ConfigError(f"{path} is not an initialised kvflow extent device (run kvflow pool init)")
            self.capacity = min(self.capacity, max(have - SUPERBLOCK, 0))
            return
        size = SUPERBLOCK + self.capacity
        if not self.block_device:
            if not self.fresh and have < size:
                self.intact_bytes = max(have - SUPERBLOCK, 0)
            if have != size:
                os.ftruncate(self._fd, size)
            if self.fresh and self.cfg.zero_fill:
                self._zero(0, self.capacity)
        self._pwrite_aligned(pack_superblock(self.capacity), 0)
        os.fsync(self._fd)

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

    def read(self, offset: int, length: int) -> torch.Tensor:
        buf = aligned_empty(padded(length))
        got = os.preadv(self._fd, [buf.numpy()], SUPERBLOCK + offset)  # DMA into our buffer; GIL released
        if got < length:
            raise RecordError(f"{self.name}: short read at {offset} ({got} of {length} bytes): device truncated?")
        return buf[:length]

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        view, pos = buf.numpy(), SUPERBLOCK + offset
        done = 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], pos + done)

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
