"""Recovery: the lookup table and every device's allocator rebuilt together from checkpoint + write-ahead log, so
after any crash the index and the allocators agree and no two live rows share an extent.

    journal.recover() ── rows {digest: PUT op} ──> per device: drop rows the device cannot hold
                                                  sort by offset, keep the newest of overlapping rows
                                                  allocator = used extents of the kept rows
                                               ──> table: kept rows in sequence order (LRU order = age)
"""

from __future__ import annotations

import logging

from kvflow.pool.allocator import ExtentAllocator, round_up
from kvflow.pool.index import Entry, LookupTable
from kvflow.pool.journal import Op
from kvflow.pool.state import PoolState

log = logging.getLogger("kvflow.pool")


def recover(state: PoolState) -> None:
    """Replace ``state.table``, the slots' allocators and ``state.next_seq`` by what the log says. Rows on devices
    that are gone, new, truncated or too small are dropped; rows that would share an extent (never produced by a
    correct writer) keep the newest. Counts both in ``state.counters``."""
    rec = state.journal.recover()
    slots = state.slots
    by_id = {s.id: i for i, s in enumerate(slots) if s.id is not None}
    per_dev: dict[int, list[tuple[bytes, Op]]] = {}
    dropped = 0
    for digest, op in rec.rows.items():
        i = by_id.get(op.dev)
        dev = slots[i].device if i is not None else None
        limit = None if dev is None else (dev.capacity if dev.intact_bytes is None else dev.intact_bytes)
        if dev is None or dev.fresh or op.offset + round_up(op.length, dev.align) > limit or op.offset % dev.align:
            dropped += 1
            continue
        per_dev.setdefault(i, []).append((digest, op))
    conflicts = 0
    rows: list[tuple[int, bytes, Op]] = []
    for i, items in per_dev.items():
        align = slots[i].alloc.align
        items.sort(key=lambda r: r[1].offset)
        kept: list[tuple[bytes, Op]] = []
        for digest, op in items:
            if kept and op.offset < kept[-1][1].offset + round_up(kept[-1][1].length, align):
                conflicts += 1
                if kept[-1][1].seq > op.seq:
                    continue
                kept.pop()
            kept.append((digest, op))
        slots[i].alloc = ExtentAllocator.from_used(slots[i].alloc.capacity, align,
                                                   [(op.offset, op.length) for _, op in kept])
        rows += [(i, d, op) for d, op in kept]
    table = LookupTable(len(slots))
    for i, digest, op in sorted(rows, key=lambda r: r[2].seq):      # LRU order = age
        table.insert(digest, Entry(i, op.offset, op.length, op.seq, op.checksum))
    state.table = table
    state.next_seq = rec.next_seq
    state.counters["recovery_dropped"] = dropped
    state.counters["recovery_conflicts"] = conflicts
    where = state.cfg.index_dir
    if conflicts:
        log.error("pool index %s: %d rows shared an extent after recovery; kept the newest", where, conflicts)
    if dropped or rec.torn or not rec.checkpoint_ok:
        log.warning("pool index %s: recovered %d records (%d dropped: device gone, new or truncated%s)",
                    where, len(table), dropped, "; the log ended torn" if rec.torn else "")
