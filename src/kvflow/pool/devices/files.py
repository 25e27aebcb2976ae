"""``files``: the baseline peers use — one file per record through the kernel filesystem (like LMCache's local
disk backend). Kept for comparison with ``extent``; offsets from the pool's allocator only name the files
(``<dir>/<xx>/<offset>.kvr``) and account capacity. With ``drop_cache`` every file is dropped from the page cache
after it is written or read, so repeated benchmark reads measure the disk, not memory."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, replace

import torch

from kvflow.errors import ConfigError, RecordError
from kvflow.pool.devices.base import Device, Owner, aligned_empty, flock_writer, into

_MARKER = ".kvflow-device"
_SYNCFS_AFTER = 8     # dirty record files beyond which one syncfs() of the file system beats an fsync per file


def _syncfs(path: str) -> bool:
    """syncfs(2) on the file system holding ``path``; False where it is unavailable."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return True
    finally:
        os.close(fd)


class FilesDevice(Device):
    kind = "fs"

    def __init__(self, cfg, readonly: bool = False):
        super().__init__(cfg, readonly)
        self.root = cfg.path
        marker = os.path.join(self.root, _MARKER)
        self.fresh = not os.path.exists(marker)
        if readonly and self.fresh:
            raise ConfigError(f"{self.root} is not an initialised kvflow files device (run kvflow pool init)")
        if self.fresh and not readonly:
            if os.path.isdir(self.root) and set(os.listdir(self.root)) - {_MARKER + ".tmp"}:
                raise ConfigError(f"{self.root} exists, is not empty and is not a kvflow device")
            os.makedirs(self.root, exist_ok=True)
            self._write_marker(None)
        elif not self.fresh:
            try:
                with open(marker) as f:
                    owner = json.load(f).get("owner")
                self.owner = Owner(**owner) if isinstance(owner, dict) else None
            except (OSError, ValueError, TypeError):
                self.owner = None    # an unreadable marker names no owner; the records still describe themselves
        self._lockfd = -1
        if not readonly:             # one writer per device, as for extents
            self._lockfd = os.open(marker, os.O_RDONLY)
            if not flock_writer(self._lockfd):
                os.close(self._lockfd)
                raise ConfigError(f"{self.root} is in use by another writable kvflow pool")
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        self.meta_s = 0.0   # time in open/close/fadvise (filesystem work), summed over threads
        self.data_s = 0.0   # time in read/write calls

    def _path(self, offset: int) -> str:
        return os.path.join(self.root, f"{(offset >> 12) & 0xff:02x}", f"{offset:x}.kvr")

    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            fd = os.open(self._path(offset), os.O_RDONLY)
        except FileNotFoundError:
            raise RecordError(f"{self.name}: record file {self._path(offset)} is missing") from None
        t1 = time.perf_counter()
        try:
            buf = into(out, length)
            got = os.preadv(fd, [buf.numpy()], 0)
            t2 = time.perf_counter()
            if self.cfg.drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self._account(t1 - t0 + time.perf_counter() - t2, t2 - t1)
        if got < length:
            raise RecordError(f"{self.name}: record file {self._path(offset)} holds {got} of {length} bytes")
        return buf

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        path = self._path(offset)
        t0 = time.perf_counter()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t1 = time.perf_counter()
        try:
            view, done = buf.numpy(), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            t2 = time.perf_counter()
            if self.cfg.drop_cache:
                os.fdatasync(fd)   # dirty pages cannot be dropped; write them first
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with self._lock:
                self._dirty.add(path)
        finally:
            os.close(fd)
        self._account(t1 - t0 + time.perf_counter() - t2, t2 - t1)

    def _write_marker(self, owner: Owner | None) -> None:
        """The marker that makes the folder a device, written durably (temp file, fsync, rename, fsync folder)."""
        marker = os.path.join(self.root, _MARKER)
        tmp = marker + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"capacity": self.capacity, "owner": None if owner is None else asdict(owner)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.owner = owner

    def claim(self, owner: Owner) -> None:
        if not self.readonly:
            self._write_marker(replace(owner, capacity=self.capacity))

    def record_offsets(self) -> list[int]:
        """Offsets of every record file present (for a scan that rebuilds the index), in order."""
        out = []
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name, _, ext = entry.name.partition(".")
                if ext == "kvr":
                    try:
                        out.append(int(name, 16))
                    except ValueError:
                        continue
        return sorted(o for o in out if 0 <= o < self.capacity)

    def staging(self, offset: int, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes)

    def discard(self, offset: int) -> None:
        try:
            os.unlink(self._path(offset))
        except FileNotFoundError:
            pass

    def sync(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        if len(dirty) > _SYNCFS_AFTER and _syncfs(self.root):
            return           # one syncfs() makes every file and folder durable: far fewer round trips than fsyncs
        for path in list(dirty) + sorted({os.path.dirname(p) for p in dirty}):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)   # file data, then the directories that name the new files
            finally:
                os.close(fd)

    def _account(self, meta: float, data: float) -> None:
        with self._lock:
            self.meta_s += meta
            self.data_s += data

    def close(self) -> None:
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def describe(self) -> dict:
        return super().describe() | {"path": self.root, "fs_meta_s": self.meta_s, "fs_data_s": self.data_s}
