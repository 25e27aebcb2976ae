"""fsck: read and verify every record the table names (header, checksum, key digest, sequence) on every device in
parallel, and check that no two rows share an extent. Rows are pinned while they are read, so eviction and puts may
run meanwhile; with ``repair`` bad rows are dropped (and their DELs logged)."""

from __future__ import annotations

from kvflow.chunks.record import decode
from kvflow.errors import RecordError
from kvflow.pool.allocator import round_up
from kvflow.pool.eviction import drop, log_and_discard, release
from kvflow.pool.index import Entry
from kvflow.pool.state import PoolState


def fsck(state: PoolState, repair: bool = True, scan: bool = False) -> dict:
    """{checked, bytes, overlaps, bad: [{key, device, offset, error}], repaired, unindexed}. With ``scan`` every
    persistent device's record headers are read too (``recovery.scan_device``), and ``unindexed`` counts the intact
    records there that the index does not name: records evicted or dropped whose extents were not yet reused, or
    records an index file lost — ``fsck --rebuild`` brings those back."""
    with state.lock:
        rows = list(state.table.items())
        for _, e in rows:
            e.pins += 1

    def verify(digest: bytes, e: Entry) -> str | None:
        try:
            data = state.slots[e.dev].device.read(e.offset, e.length)
            header, _ = decode(data.numpy())
            if header.digest != digest or header.seq != e.seq:
                return "record at this extent belongs to another key or write"
        except (RecordError, OSError) as err:
            return str(err)
        return None

    futures = [(d, e, state.slots[e.dev].io.submit(verify, d, e)) for d, e in rows]
    bad = [(d, e, err) for d, e, f in futures if (err := f.result()) is not None]
    overlaps = 0
    for i, s in enumerate(state.slots):
        ext = sorted((e.offset, round_up(e.length, s.alloc.align)) for _, e in rows if e.dev == i)
        overlaps += sum(a + n > b for (a, n), (b, _) in zip(ext, ext[1:]))
    repaired = repair and not state.readonly
    with state.lock:
        dels = []
        for _, e in rows:
            e.pins -= 1
            release(state, e)
        if repaired:
            for d, e, _ in bad:
                state.counters["corrupt"] += 1
                drop(state, d, e, dels)
        log_and_discard(state, dels)
    return {"checked": len(rows), "bytes": sum(e.length for _, e in rows), "overlaps": overlaps,
            "unindexed": _unindexed(state) if scan else None,
            "bad": [{"key": d.hex(), "device": state.slots[e.dev].device.name, "offset": e.offset, "error": err}
                    for d, e, err in bad], "repaired": repaired}


def _unindexed(state: PoolState) -> int:
    from kvflow.pool.recovery import scan_device
    n = 0
    for s in state.slots:
        if s.id is None or not s.healthy:
            continue
        found, _ = scan_device(getattr(s.device, "inner", s.device), s.id)
        with state.lock:
            n += sum(1 for d, op in found.items() if (e := state.table.get(d)) is None or e.seq < op.seq)
    return n
