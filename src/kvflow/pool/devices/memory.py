"""``memory``: a preallocated, page-aligned host buffer. Anonymous by default (gone with the process); with
``path`` (e.g. /dev/shm/kvflow0) a shared file mapping, so other processes opening the pool read-only see the same
records and they survive a crash of the writer (not a reboot)."""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from kvflow.errors import ConfigError
from kvflow.pool.devices.base import (SUPERBLOCK, Device, copy_bytes, file_size, not_a_device,
                                      into, pack_superblock, parse_superblock)


class MemoryDevice(Device):
    kind = "mem"
    needs_path = False

    def __init__(self, cfg, readonly: bool = False):
        super().__init__(cfg, readonly)
        base = 0
        if cfg.path is None:
            self._mm = mmap.mmap(-1, self.capacity)
        else:
            base = SUPERBLOCK
            self._mm = self._map_file(cfg.path, readonly)
        with warnings.catch_warnings():  # a read-only mapping is only ever copied from
            warnings.simplefilter("ignore", UserWarning)
            self._mem = torch.frombuffer(self._mm, dtype=torch.uint8)[base:base + self.capacity]

    def _map_file(self, path: str, readonly: bool) -> mmap.mmap:
        size = SUPERBLOCK + self.capacity
        exists = os.path.exists(path)
        if readonly and not exists:
            raise ConfigError(f"memory device file {path} does not exist (create the pool first: kvflow pool init)")
        fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT, 0o600)
        try:
            have = file_size(fd)
            head = os.pread(fd, SUPERBLOCK, 0) if have else b""
            self.fresh = parse_superblock(head) is None
            if self.fresh and have:
                raise not_a_device(path)      # never overwrite a file kvflow did not make (even an all-zero one)
            if readonly:
                self.capacity = min(self.capacity, max(have - SUPERBLOCK, 0))
                return mmap.mmap(fd, SUPERBLOCK + self.capacity, access=mmap.ACCESS_READ)
            if not self.fresh and have < size:
                self.intact_bytes = max(have - SUPERBLOCK, 0)
            os.pwrite(fd, pack_superblock(self.capacity), 0)   # first: a crash from here leaves a kvflow device
            if have != size:
                os.ftruncate(fd, size)
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def staging(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._mem[offset:offset + nbytes]      # encode straight into the device: no second copy

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        if buf.data_ptr() != self._mem[offset:].data_ptr():
            copy_bytes(self._mem[offset:offset + buf.numel()], buf)

    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if offset + length > self.capacity:
            raise OSError(f"{self.name}: read past the end of the device")
        out = into(out, length)
        copy_bytes(out, self._mem[offset:offset + length])   # releases the GIL, starts no OpenMP team
        return out

    def sync(self) -> None:
        if self.cfg.path is not None and not self.readonly:
            self._mm.flush()

    def close(self) -> None:
        self._mem = None
        try:
            self._mm.close()
        except BufferError:   # a staging view still alive somewhere; the mapping goes with it
            pass
