"""Removing rows: LRU eviction of a full device (only the records one new record needs), dropping one row,
releasing an extent once no reader pins it, and the order that makes removals crash-safe — log the DELs first,
only then let devices destroy the freed records.

    drop(digest, entry) ──> table row gone, DEL queued ──> release: pins == 0 ? free the extent : on the last unpin
    log_and_discard(DELs) ──> journal.append(DELs) ──> device.discard(offset) for every freed extent

Every function here runs with ``state.lock`` held.
"""

from __future__ import annotations

import logging

from kvflow.pool.allocator import round_up
from kvflow.pool.index import Entry
from kvflow.pool.journal import DEL, Op
from kvflow.pool.state import PoolState

log = logging.getLogger("kvflow.pool")


def evict(state: PoolState, dev: int, nbytes: int, dels: list[Op]) -> bool:
    """Make room for one record of ``nbytes`` on device ``dev`` by dropping its least recently used, unpinned
    records — the fewest, in LRU order, after which a free extent of that size exists, and none at all when even
    dropping every unpinned record would not make one. True when the record fits now."""
    slot = state.slots[dev]
    a = slot.alloc
    if round_up(nbytes, a.align) > a.capacity:
        return False
    candidates: list[tuple[bytes, Entry]] = []

    def starts():
        for digest, e in state.table.oldest(dev):
            if e.pins == 0:
                candidates.append((digest, e))
                yield e.offset

    n = a.frees_needed(starts(), nbytes)
    if n is None:
        return False
    for digest, e in candidates[:n]:
        drop(state, digest, e, dels)
        state.counters["evictions"] += 1
        slot.counters["evictions"] += 1
    return True


def drop(state: PoolState, digest: bytes, entry: Entry, dels: list[Op]) -> None:
    """Remove ``entry`` from the table (if it is still the row of ``digest``); queue its DEL in ``dels``."""
    if state.table.get(digest) is not entry:
        return
    state.table.remove(digest)
    if (ident := state.slots[entry.dev].id) is not None:
        dels.append(Op(DEL, ident, digest, entry.offset, entry.length, entry.seq, entry.checksum))
    release(state, entry)


def release(state: PoolState, entry: Entry) -> None:
    """Free the extent of a removed row once no reader holds it."""
    if entry.dead and entry.pins == 0:
        entry.pins = -1           # freed: exactly once
        state.slots[entry.dev].alloc.free(entry.offset)
        state.discards.append((entry.dev, entry.offset))


def log_and_discard(state: PoolState, ops: list[Op]) -> None:
    """Ends every critical section that removes rows. Appends ``ops`` to the log, and only then lets devices destroy
    freed records (the files baseline unlinks): a crash in between leaves a DEL'd row, never a logged row without
    its data. Freed extents are rewritten only after the lock is released."""
    if ops and state.journal is not None and not state.readonly:
        state.journal.append(ops)
    for dev, offset in state.discards:
        try:
            state.slots[dev].device.discard(offset)
        except OSError as err:      # e.g. a dead disk refusing an unlink: the extent is free all the same
            log.warning("pool: discard on %s failed: %s", state.slots[dev].device.name, err)
    state.discards.clear()
