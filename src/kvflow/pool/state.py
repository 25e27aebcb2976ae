"""What every part of the pool shares: the devices as the pool sees them (``Slot``) and one ``PoolState`` — the
lookup table, the log, the lock and the counters. The façade (``pool.py``), recovery, fsck and eviction each work on
a ``PoolState``; none reaches into another's privates.

    PoolState ── slots[i]: Slot(device behind its throttle, allocator, I/O workers, b_i, health, counters,
                                store: the keyed store behind the device, None for a striped one)
              ── table:    LookupTable (digest -> Entry(dev, offset, length, seq, checksum, pins))
              ── journal:  Journal | None (manifest + write-ahead log + checkpoint; None: nothing persists)
              ── lock:     guards table, allocators, counters, discards and next_seq
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvflow.pool.allocator import ExtentAllocator
from kvflow.pool.config import DeviceConfig, PoolConfig
from kvflow.pool.devices import KeyedStore, Throttled
from kvflow.pool.index import LookupTable
from kvflow.pool.journal import Journal
from kvflow.pool.organizer import Bandwidth, effective

POOL_COUNTERS = ("hits", "misses", "corrupt", "evictions", "put_records", "put_bytes", "put_skipped", "put_dropped",
                 "put_errors", "recovery_dropped", "recovery_conflicts", "lookup_calls")
DEVICE_COUNTERS = ("reads", "read_bytes", "writes", "write_bytes", "errors", "evictions", "corrupt", "full")


@dataclass(slots=True)
class Slot:
    """One device as the pool sees it: the device (behind its throttle), its allocator and its I/O workers."""
    device: Throttled
    cfg: DeviceConfig
    id: int | None                 # manifest id; None for a volatile device (never logged)
    alloc: ExtentAllocator
    io: ThreadPoolExecutor
    bw: Bandwidth                  # unthrottled
    cap: float | None = None       # current throttle (bytes/s)
    store: KeyedStore | None = None   # a keyed store (asked by name for what the index does not know); None: striped
    healthy: bool = True
    errors_in_row: int = 0
    counters: dict = field(default_factory=lambda: dict.fromkeys(DEVICE_COUNTERS, 0))

    @property
    def read_bw(self) -> float:
        return effective(self.bw.read, self.cap)


@dataclass(slots=True)
class PoolState:
    cfg: PoolConfig
    readonly: bool
    journal: Journal | None
    slots: list[Slot] = field(default_factory=list)
    table: LookupTable = field(default_factory=lambda: LookupTable(0))
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_seq: int = 0
    discards: list[tuple[int, int]] = field(default_factory=list)  # freed extents to tell their device once logged
    counters: dict = field(default_factory=lambda: {**dict.fromkeys(POOL_COUNTERS, 0), "lookup_s": 0.0})
