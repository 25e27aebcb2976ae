"""Recovery: the lookup table and every device's allocator rebuilt together, so after any crash the index and the
allocators agree and no two live rows share an extent. Two sources, one result:

    journal.recover() ── rows {digest: PUT op} (checkpoint + every log entry that verifies)
    scan(devices)     ── rows from the records themselves: every header on an ``align`` boundary (files: every
                         record file), payload checksum verified; newest sequence per key wins
                            │  the scan runs when the index cannot be trusted whole — a damaged checkpoint, log
                            │  entry or manifest, a device the index does not know, ``fsck --rebuild`` — and
                            │  replaces the index's rows of the devices it read
                            ▼
    per device: drop rows the device cannot hold, sort by offset, keep the newest of overlapping rows
    allocator = used extents of the kept rows;  table = kept rows in sequence order (LRU order = age)

Before any of it, ``claim_devices`` checks every device's owner (its superblock names a pool and that pool's index
folder): another live pool's device is refused, a device whose index is gone is adopted; a writer then records
itself as the owner. In relaxed mode, after a crash, the rows only the log names are read and verified first (the
kernel may write a log page back before the record it names).

Records are self-describing (key, sequence, ranges, checksum: ``chunks/record.py``), so the index is a cache of
what the devices hold: losing it loses nothing but the time of a scan.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvflow.chunks.record import HEADER_SIZE, MAGIC, decode, parse_header
from kvflow.errors import KVFlowError, RecordError
from kvflow.pool.allocator import ExtentAllocator, round_up
from kvflow.pool.devices.base import Owner
from kvflow.pool.index import Entry, LookupTable
from kvflow.pool.journal import PUT, Op
from kvflow.pool.state import PoolState

log = logging.getLogger("kvflow.pool")

SCAN_CHUNK = 8 << 20          # bytes read per step of a device scan
_NO_POOL = "00" * 16          # a device written before devices named their pool
_MAGIC = np.frombuffer(MAGIC, dtype=np.uint8)


@dataclass(slots=True)
class ScanReport:
    devices: int = 0          # devices scanned
    found: int = 0            # intact records found (newest per key)
    bad: int = 0              # record headers whose record did not verify (damaged, torn or overwritten)
    reason: str = ""


def scan_device(device, ident: int) -> tuple[dict[bytes, Op], int]:
    """Every intact record on ``device`` (header and payload checksums verified) as PUT rows {digest: newest}, and
    how many candidates failed verification. Headers start on ``align`` boundaries; devices that keep one file per
    record list them instead (``record_offsets``)."""
    found: dict[bytes, Op] = {}
    bad = 0

    def take(offset: int, header) -> bool:
        nonlocal bad
        total = HEADER_SIZE + header.length
        if offset + total > device.capacity:
            bad += 1
            return False
        try:
            decode(device.read(offset, total).numpy())
        except (RecordError, OSError):
            bad += 1
            return False
        cur = found.get(header.digest)
        if cur is None or cur.seq < header.seq:
            found[header.digest] = Op(PUT, ident, header.digest, offset, total, header.seq, header.checksum)
        return True

    listing = getattr(device, "record_offsets", None)
    if listing is not None:
        for offset in listing():
            try:
                header = parse_header(device.read(offset, HEADER_SIZE).numpy())
            except (RecordError, OSError):
                bad += 1
                continue
            take(offset, header)
        return found, bad
    align, end, skip_to = device.align, device.capacity, 0
    for base in range(0, end, SCAN_CHUNK):
        n = min(SCAN_CHUNK, end - base) // align * align
        if n <= 0:
            break
        try:
            rows = device.read(base, n).numpy().reshape(-1, align)
        except (RecordError, OSError):
            continue                       # an unreadable stretch: its records are gone, the rest are not
        for r in np.flatnonzero((rows[:, :4] == _MAGIC).all(axis=1)):
            offset = base + int(r) * align
            if offset < skip_to:
                continue                   # inside a record already taken
            try:
                header = parse_header(rows[r, :HEADER_SIZE].tobytes())
            except RecordError:
                bad += 1
                continue
            if take(offset, header):
                skip_to = offset + round_up(HEADER_SIZE + header.length, align)
    return found, bad


def claim_devices(state: PoolState, manifest: dict, trusted: bool) -> list[str]:
    """Refuse a device another pool owns; adopt one whose pool's index is this one or gone (a deleted or rebuilt
    index); then (writable) record this pool as every device's owner, generation + 1. ``manifest["pool_id"]`` becomes
    the adopted pool's id, so the rebuilt index and its devices agree. Returns the devices of this pool whose id in
    the manifest is not the one they record (a manifest edited or swapped: the index's rows cannot be trusted)."""
    here = os.path.abspath(state.cfg.index_dir)
    adopted = None
    renumbered = []
    for s in state.slots:
        owner = getattr(s.device, "inner", s.device).owner
        if s.id is not None and owner is not None and owner.pool_id == manifest["pool_id"] and \
                owner.generation > 0 and owner.device_id != s.id:
            renumbered.append(s.cfg.name)
        if s.id is None or owner is None or owner.pool_id in (_NO_POOL, manifest["pool_id"]):
            continue
        theirs = Path(owner.index_dir) / "manifest.json"
        live = owner.index_dir != here and theirs.exists() and _pool_id(theirs) == owner.pool_id
        if trusted or live or adopted not in (None, owner.pool_id):
            raise KVFlowError(f"device {s.cfg.name} belongs to another kvflow pool (index {owner.index_dir}); "
                              f"refusing to open it — use another device, or reformat it with "
                              f"`kvflow pool init --force`")
        adopted = owner.pool_id
    if adopted is not None:
        log.warning("pool index %s: adopting devices of pool %s (its index is gone)", here, adopted)
        manifest["pool_id"] = adopted
    if state.readonly:
        return renumbered
    for s in state.slots:
        device = getattr(s.device, "inner", s.device)
        if s.id is not None:
            generation = device.owner.generation + 1 if device.owner is not None else 1
            device.claim(Owner(device.capacity, manifest["pool_id"], s.id, generation, here))
    return renumbered


def _pool_id(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("pool_id")
    except (OSError, ValueError, AttributeError):
        return None


def _verified(state: PoolState, rows: dict[bytes, Op], suspects, by_id) -> dict[bytes, Op]:
    def ok(op: Op) -> bool:
        i = by_id.get(op.dev)
        if i is None:
            return True                  # dropped below anyway
        device = getattr(state.slots[i].device, "inner", state.slots[i].device)
        try:
            header, _ = decode(device.read(op.offset, op.length).numpy())
        except (RecordError, OSError):
            return False
        return header.digest == op.digest and header.seq == op.seq

    check = [(d, op) for d, op in rows.items() if d in suspects and by_id.get(op.dev) is not None]
    futures = [(d, state.slots[by_id[op.dev]].io.submit(ok, op)) for d, op in check]
    bad = {d for d, f in futures if not f.result()}
    if bad:
        log.warning("pool index %s: %d logged records never reached their device before the crash (relaxed "
                    "durability); dropped", state.cfg.index_dir, len(bad))
    state.counters["recovery_unsynced"] = len(bad)
    return {d: op for d, op in rows.items() if d not in bad}


def recover(state: PoolState, rebuild: bool = False) -> ScanReport:
    """Replace ``state.table``, the slots' allocators and ``state.next_seq``. The journal's rows are used where they
    can be trusted; devices are scanned (see the module doc) where they cannot, or all of them with ``rebuild``.
    Rows on devices that are gone, new, truncated or too small are dropped; rows that would share an extent keep
    the newest. Counts in ``state.counters``; returns what the scan did."""
    journal = state.journal
    rec = journal.recover()
    manifest = journal.read_manifest()
    renumbered = claim_devices(state, manifest, trusted=journal.had_manifest and rec.manifest_ok)
    known = {d["id"] for d in manifest["devices"]} if journal.had_manifest else set()
    slots = state.slots
    report = ScanReport()
    scan_all = rebuild or rec.damaged or bool(renumbered)
    report.reason = ("requested" if rebuild else "checkpoint does not verify" if not rec.checkpoint_ok else
                     "manifest does not verify" if not rec.manifest_ok else
                     f"{rec.missing} is missing" if rec.missing else
                     f"the manifest gives {renumbered[0]} another id than the device records" if renumbered else
                     f"{rec.skipped} damaged log entries" if rec.skipped else "")
    rows = dict(rec.rows)
    next_seq = rec.next_seq
    scanned = [s for s in slots if s.id is not None and not s.device.fresh and (scan_all or s.id not in known)]
    if scan_all:      # rows under ids no device answers to now (a renumbered manifest) must not shadow the scan's
        unscanned = {s.id for s in slots if s.id is not None} - {s.id for s in scanned}
        rows = {d: op for d, op in rows.items() if op.dev in unscanned}
    for s in scanned:
        report.reason = report.reason or "a device the index does not know"
        found, bad = scan_device(getattr(s.device, "inner", s.device), s.id)
        report.devices += 1
        report.found += len(found)
        report.bad += bad
        rows = {d: op for d, op in rows.items() if op.dev != s.id}       # the device's own records are the truth
        for digest, op in found.items():
            cur = rows.get(digest)
            if cur is None or cur.seq <= op.seq:
                rows[digest] = op
            next_seq = max(next_seq, op.seq + 1)
    by_id = {s.id: i for i, s in enumerate(slots) if s.id is not None}
    if state.cfg.durability == "relaxed" and rec.from_log and not scan_all and not state.readonly:
        # relaxed: a PUT may reach the disk before its record does (the kernel writes the log back on its own), so
        # after a crash the rows only the log names are read and verified; those whose data never landed go
        rows = _verified(state, rows, rec.from_log, by_id)
    per_dev: dict[int, list[tuple[bytes, Op]]] = {}
    dropped = 0
    for digest, op in rows.items():
        i = by_id.get(op.dev)
        dev = slots[i].device if i is not None else None
        limit = None if dev is None else (dev.capacity if dev.intact_bytes is None else dev.intact_bytes)
        if dev is None or dev.fresh or op.offset + round_up(op.length, dev.align) > limit or op.offset % dev.align:
            dropped += 1
            continue
        per_dev.setdefault(i, []).append((digest, op))
    conflicts = 0
    kept_rows: list[tuple[int, bytes, Op]] = []
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
        kept_rows += [(i, d, op) for d, op in kept]
    table = LookupTable(len(slots))
    for i, digest, op in sorted(kept_rows, key=lambda r: r[2].seq):      # LRU order = age
        table.insert(digest, Entry(i, op.offset, op.length, op.seq, op.checksum))
    state.table = table
    state.next_seq = next_seq
    state.counters["recovery_dropped"] = dropped
    state.counters["recovery_conflicts"] = conflicts
    state.counters["recovery_scanned"] = report.devices
    state.counters["recovery_scan_found"] = report.found
    where = state.cfg.index_dir
    if report.devices:
        log.warning("pool index %s: rebuilt from a scan of %d devices (%s): %d intact records found, %d damaged",
                    where, report.devices, report.reason, report.found, report.bad)
    if conflicts:
        log.error("pool index %s: %d rows shared an extent after recovery; kept the newest", where, conflicts)
    if dropped or rec.torn or not rec.checkpoint_ok:
        log.info("pool index %s: recovered %d records (%d dropped: device gone, new or truncated%s)",
                 where, len(table), dropped, "; the log ended torn" if rec.torn else "")
    return report
