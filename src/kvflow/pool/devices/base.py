"""The one small interface every storage device implements. A device is a flat byte range of ``capacity`` bytes;
the pool's allocator picks offsets (multiples of ``align``) and the device moves whole records at those offsets.
Calls are blocking and thread-safe; the pool runs them on one I/O worker pool per device.

    buf = dev.staging(offset, n)   # a page-aligned buffer to encode a record into (memory: the device itself)
    ...encode into buf...
    dev.commit(offset, buf)        # make it the content of [offset, offset + n)
    data = dev.read(offset, n)     # a fresh page-aligned uint8 tensor the caller owns
    dev.sync()                     # durable up to here
    dev.discard(offset)            # the extent was freed (the files baseline deletes the file)
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import xxhash

from kvflow.errors import ConfigError

if TYPE_CHECKING:
    from kvflow.pool.config import DeviceConfig

ALIGN = 4096          # every offset and every transfer of a file-backed device is a multiple of this
SUPERBLOCK = 4096     # file-backed devices keep a self-describing header in their first ALIGN bytes
_SB = struct.Struct("<4sHxxQ")
_SB_MAGIC = b"KVFD"


def aligned_empty(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """Uninitialised uint8 tensor of ``nbytes`` whose data starts on a page boundary (O_DIRECT-able; page-locked
    for a CUDA copy with ``pinned``)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for uint8 tensors, on the calling thread only (numpy's copy: one thread, GIL released).

    Pool I/O runs on worker threads beside the engine's compute; a torch ``copy_`` of more than 32K elements from
    such a thread starts its own OpenMP team, whose threads spin on the cores the compute threads use. Inside
    vLLM's worker (compute threads pinned to the cores) that slowed the forward the loads overlap by ~50%."""
    with warnings.catch_warnings():          # a read-only mapping's tensor: numpy only reads from it
        warnings.simplefilter("ignore", UserWarning)
        np.copyto(dst.numpy(), src.numpy())


def into(out: torch.Tensor | None, nbytes: int) -> torch.Tensor:
    """``out`` (a caller's page-aligned buffer of at least ``nbytes``) or a fresh aligned buffer."""
    if out is None:
        return aligned_empty(nbytes)
    assert out.numel() >= nbytes and out.data_ptr() % ALIGN == 0, (out.numel(), nbytes)
    return out[:nbytes]


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack_superblock(capacity: int) -> bytes:
    return _SB.pack(_SB_MAGIC, 1, capacity).ljust(SUPERBLOCK, b"\0")


def parse_superblock(data: bytes) -> int | None:
    """Capacity recorded in a device header (either version), or None when ``data`` is not one."""
    if len(data) < _SB.size:
        return None
    magic, version, capacity = _SB.unpack_from(data)
    if magic != _SB_MAGIC:
        return None
    if version == 1:
        return capacity
    owner = parse_owner(data)
    return owner.capacity if owner is not None else None


# Version 2: the device says which pool owns it. Kept twice (first and last 4 KiB of the device) with a checksum,
# so a zeroed or torn primary is recovered from the backup and never mistaken for a new device.
#   magic | version=2 | capacity | pool id (16 B) | device id | generation | index_dir (utf-8) ... | xxh64
_SB2 = struct.Struct("<4sHxxQ16sHxxxxxxQH")


@dataclass(frozen=True, slots=True)
class Owner:
    capacity: int
    pool_id: str          # hex of the manifest's pool id
    device_id: int        # the device's id in that pool's manifest
    generation: int       # writable opens so far
    index_dir: str        # where that pool's index lives


def pack_owner(owner: Owner) -> bytes:
    path = owner.index_dir.encode()[:SUPERBLOCK - _SB2.size - 8]
    body = _SB2.pack(_SB_MAGIC, 2, owner.capacity, bytes.fromhex(owner.pool_id), owner.device_id, owner.generation,
                     len(path)) + path
    body = body.ljust(SUPERBLOCK - 8, b"\0")
    return body + xxhash.xxh64_intdigest(body).to_bytes(8, "little")


def parse_owner(data: bytes) -> Owner | None:
    """The owner recorded in a version-2 device header, or None (not one, or its checksum fails)."""
    if len(data) < SUPERBLOCK:
        return None
    body = bytes(data[:SUPERBLOCK - 8])
    if int.from_bytes(data[SUPERBLOCK - 8:SUPERBLOCK], "little") != xxhash.xxh64_intdigest(body):
        return None
    magic, version, capacity, pool_id, device_id, generation, n = _SB2.unpack_from(body)
    if magic != _SB_MAGIC or version != 2:
        return None
    return Owner(capacity, pool_id.hex(), device_id, generation, body[_SB2.size:_SB2.size + n].decode(errors="replace"))


def not_a_device(path: str) -> ConfigError:
    return ConfigError(f"{path} exists and is not a kvflow device; it is left untouched (kvflow formats only its own "
                       f"devices and empty files: remove it yourself, or choose another path)")


class Device(ABC):
    kind: ClassVar[str]   # what the lookup table records as device type: "mem", "ssd" or "fs"
    needs_path: ClassVar[bool] = True
    needs_capacity: ClassVar[bool] = True
    align: int = ALIGN

    def __init__(self, cfg: DeviceConfig, readonly: bool = False):
        self.cfg = cfg
        self.name = cfg.name
        self.readonly = readonly
        self.persistent = cfg.persistent
        self.capacity = (cfg.capacity or 0) // ALIGN * ALIGN
        self.fresh = True             # created by this open: nothing stored on it survives from before
        self.intact_bytes: int | None = None   # set when a file was found truncated: data beyond it is gone
        self.owner: Owner | None = None        # the pool this device says it belongs to (None: not recorded)

    @abstractmethod
    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``length`` bytes at ``offset`` as a uint8 tensor: a new one, or the first ``length`` bytes of ``out``
        (a page-aligned buffer of at least ``padded(length)`` bytes: a staging buffer the caller reuses). Raises
        OSError or RecordError."""

    @abstractmethod
    def commit(self, offset: int, buf: torch.Tensor) -> None:
        """Store ``buf`` (from ``staging``) at ``offset``."""

    def staging(self, offset: int, nbytes: int) -> torch.Tensor:
        return aligned_empty(padded(nbytes))

    def sync(self) -> None:
        """Make every committed record durable."""

    def discard(self, offset: int) -> None:
        """The extent at ``offset`` was freed (called under the pool lock, before it can be handed out again)."""

    def claim(self, owner: Owner) -> None:
        """Record ``owner`` durably on the device (devices that cannot record one ignore it)."""

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name, "type": self.cfg.type, "kind": self.kind, "capacity": self.capacity}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, capacity={self.capacity})"


def flock_writer(fd: int, wait_s: float = 1.0) -> bool:
    """Take the exclusive writer lock on ``fd``; False if another process holds it for ``wait_s``. The short wait
    covers a writer that was just killed: its exit releases its locks a moment after it is reported dead."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def check_writable(dev: Device) -> None:
    assert not dev.readonly, f"{dev.name} was opened read-only"


def file_size(fd: int) -> int:
    return os.lseek(fd, 0, os.SEEK_END)
