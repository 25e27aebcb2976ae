"""Persistence of the lookup table: write-ahead log + checkpoint, in ``index_dir``::

    manifest.json   pool identity and its persistent devices: stable id, name, probed bandwidths
    checkpoint      header | PUT entry x count | xxh64 of all before   (written to a temp file, fsynced, renamed)
    wal.<gen>       64-byte entries appended since the checkpoint; each carries its own checksum
    lock            flock held by the one writable opener (readers never lock)

A WAL entry: op (PUT/DEL), device id, key digest, offset, length, seq, payload checksum, xxh32 of the first 56
bytes. Recovery = checkpoint + replay of every wal.<gen >= wal_from>, each entry judged by its own checksum (a
damaged one is skipped, the rest replayed; a torn tail is where a crash cut the last write). When anything was
skipped, the checkpoint or manifest does not verify, or a file the index must have is missing (the checkpoint
once a manifest exists; a log generation between ``wal_from`` and the newest; a log whose first entry does not
verify), recovery rebuilds from the devices' record headers. Ordering rules the pool keeps: a record's data is written before its PUT is appended; a key's DEL
is appended before its extent can be handed out again; so any prefix of the log describes records that do not
share extents. The allocator is then rebuilt from the recovered table, so index and allocator always agree.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvflow.errors import ConfigError, KVFlowError
from kvflow.pool.devices.base import flock_writer

log = logging.getLogger("kvflow.pool")

PUT, DEL = 1, 2
_ENTRY = struct.Struct("<BxH4x16sQQQQ")        # op, device id, digest, offset, length, seq, checksum
_CRC = struct.Struct("<I4x")
ENTRY_SIZE = _ENTRY.size + _CRC.size
assert ENTRY_SIZE == 64
_CKPT = struct.Struct("<4sHxxQQQ")             # magic, version, wal_from, next_seq, count
_CKPT_MAGIC = b"KVFC"


@dataclass(frozen=True, slots=True)
class Op:
    op: int
    dev: int          # device id from the manifest
    digest: bytes
    offset: int
    length: int
    seq: int
    checksum: int

    def pack(self) -> bytes:
        body = _ENTRY.pack(self.op, self.dev, self.digest, self.offset, self.length, self.seq, self.checksum)
        return body + _CRC.pack(xxhash.xxh32_intdigest(body))


def unpack_entries(data: bytes) -> tuple[list[Op], int]:
    """Entries up to the first one that does not verify; returns them and the byte length of that valid prefix."""
    ops, pos = [], 0
    while pos + ENTRY_SIZE <= len(data):
        op = _entry_at(data, pos)
        if op is None:
            break
        ops.append(op)
        pos += ENTRY_SIZE
    return ops, pos


def _entry_at(data: bytes, pos: int) -> Op | None:
    body = data[pos:pos + _ENTRY.size]
    (crc,) = _CRC.unpack_from(data, pos + _ENTRY.size)
    if crc != xxhash.xxh32_intdigest(body):
        return None
    op = Op(*_ENTRY.unpack(body))
    return op if op.op in (PUT, DEL) else None


def unpack_log(data: bytes) -> tuple[list[Op], int, bool]:
    """Every entry of a log that verifies, each judged by its own checksum: a damaged entry in the middle is
    skipped, not taken as the end. Returns (entries, entries skipped, torn) — torn: the log ends inside an entry
    or in entries that do not verify (a write cut short), which is normal after a crash and not counted as
    skipped."""
    ops, bad_run, skipped = [], 0, 0
    for pos in range(0, len(data) - ENTRY_SIZE + 1, ENTRY_SIZE):
        op = _entry_at(data, pos)
        if op is None:
            bad_run += 1
            continue
        skipped += bad_run
        bad_run = 0
        ops.append(op)
    return ops, skipped, bool(bad_run) or len(data) % ENTRY_SIZE != 0


def apply(rows: dict[bytes, Op], op: Op) -> None:
    """Replay one entry onto the table: a PUT (re)places its key; a DEL removes the key's record of that seq."""
    if op.op == PUT:
        rows[op.digest] = op
    elif (cur := rows.get(op.digest)) is not None and cur.seq == op.seq:
        del rows[op.digest]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)      # a full disk keeps the old file, and gets back the space of the new one
        raise
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(slots=True)
class Recovered:
    rows: dict[bytes, Op]
    next_seq: int
    wal_bytes: int         # log bytes replayed on top of the checkpoint
    torn: bool             # the log ended in an entry that did not verify
    checkpoint_ok: bool
    skipped: int = 0       # damaged entries inside the log, skipped one by one (their records may be on a device)
    manifest_ok: bool = True
    from_log: frozenset = frozenset()   # keys whose row came from the log, not the checkpoint (relaxed: unverified)
    missing: str = ""      # an index file that should be there and is not (or starts damaged), e.g. "wal.00000003"

    @property
    def damaged(self) -> bool:
        """Something the index said is gone: only a scan of the devices' record headers can bring it back."""
        return self.skipped > 0 or not self.checkpoint_ok or not self.manifest_ok or bool(self.missing)


class Journal:
    def __init__(self, root: str | os.PathLike, readonly: bool = False):
        self.root = Path(root)
        self.readonly = readonly
        self._lock = threading.Lock()
        self._fd = -1
        self._lockfd = -1
        self.gen = 0
        self.wal_bytes = 0
        self.manifest_ok = True
        self.had_manifest = True
        self.pending_dels = False               # DELs appended since the last fsync (strict: sync before reuse)
        self._created: dict | None = None      # a manifest made by this open, until it is written
        if readonly:
            if not (self.root / "manifest.json").exists():
                raise ConfigError(f"{self.root} holds no kvflow pool index (create the pool first: kvflow pool init)")
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"pool.index_dir {self.root}: {err.strerror}") from None
        self._lockfd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        if not flock_writer(self._lockfd):
            os.close(self._lockfd)
            raise KVFlowError(f"pool index {self.root} is open for writing in another process "
                              f"(open it with readonly=True to read alongside)")

    # -- manifest -------------------------------------------------------------------------------------------
    def read_manifest(self) -> dict:
        path = self.root / "manifest.json"
        if self._created is not None:
            return self._created
        if not path.exists():
            self.had_manifest = False
            self._created = {"format": 1, "pool_id": uuid.uuid4().hex, "devices": []}
            return self._created
        self.had_manifest = True
        try:
            manifest = json.loads(path.read_text())
            if not isinstance(manifest, dict) or not isinstance(manifest.get("devices"), list) or not all(
                    isinstance(d, dict) and isinstance(d.get("id"), int) and isinstance(d.get("name"), str)
                    for d in manifest["devices"]):
                raise ValueError("not a manifest")
            return manifest
        except (ValueError, UnicodeDecodeError):     # rebuilt: device ids anew, records from a scan
            log.error("pool index %s: manifest.json is corrupt; rebuilding it (records come from a device scan)",
                      self.root)
            self.manifest_ok = False
            self._created = {"format": 1, "pool_id": uuid.uuid4().hex, "devices": []}
            return self._created

    def write_manifest(self, manifest: dict) -> None:
        assert not self.readonly
        self._created = None
        _atomic_write(self.root / "manifest.json", json.dumps(manifest, indent=1).encode())

    # -- recovery -------------------------------------------------------------------------------------------
    def _wal_gens(self) -> list[int]:
        return sorted(int(p.name[4:]) for p in self.root.glob("wal.*") if p.name[4:].isdigit())

    def _wal_path(self, gen: int) -> Path:
        return self.root / f"wal.{gen:08d}"

    def _read_checkpoint(self) -> tuple[dict[bytes, Op], int, int] | None:
        path = self.root / "checkpoint"
        if not path.exists():
            return {}, 0, 0
        data = path.read_bytes()
        if len(data) < _CKPT.size + 8 or xxhash.xxh64_intdigest(data[:-8]) != int.from_bytes(data[-8:], "little"):
            return None
        magic, version, wal_from, next_seq, count = _CKPT.unpack_from(data)
        if magic != _CKPT_MAGIC or version != 1 or _CKPT.size + count * ENTRY_SIZE + 8 != len(data):
            return None
        ops, used = unpack_entries(data[_CKPT.size:-8])
        if used != count * ENTRY_SIZE:
            return None
        return {op.digest: op for op in ops}, wal_from, next_seq

    def recover(self) -> Recovered:
        """The table as of the last valid log entry. Readers retry if a checkpoint lands while they read."""
        for _ in range(20):
            before = self._stamp()
            rec = self._recover_once()
            if rec is not None and self._stamp() == before:
                return rec
        raise KVFlowError(f"pool index {self.root} kept changing while being read; try again")

    def _stamp(self):
        try:
            st = os.stat(self.root / "checkpoint")
            return st.st_ino, st.st_mtime_ns, st.st_size
        except FileNotFoundError:
            return None

    def _recover_once(self) -> Recovered | None:
        had_index = (self.root / "manifest.json").exists()
        ckpt = self._read_checkpoint()
        gens = self._wal_gens()
        checkpoint_ok = ckpt is not None
        missing = ""
        if ckpt is None:
            log.error("pool index %s: checkpoint does not verify; recovering from the log alone", self.root)
            ckpt = ({}, gens[0] if gens else 0, 0)
        elif had_index and not (self.root / "checkpoint").exists():
            missing = "checkpoint"       # written before the manifest at the first open: deleted since
        rows, wal_from, next_seq = ckpt
        live = [g for g in gens if g >= wal_from]
        if had_index and not missing:    # generations run wal_from, wal_from + 1, ... with no gap (each one created
            #                              before the checkpoint that names it): a gap or none at all is a lost log
            gap = next((g for g in range(wal_from, max(live, default=wal_from) + 1) if g not in live), None)
            missing = "" if gap is None else self._wal_path(gap).name
        wal_bytes, torn, skipped, from_log = 0, False, 0, set()
        for gen in live:
            try:
                data = self._wal_path(gen).read_bytes()
            except FileNotFoundError:
                return None            # a writer compacted the log under us: start over
            ops, bad, cut = unpack_log(data)
            if len(data) >= ENTRY_SIZE and _entry_at(data, 0) is None and not missing:
                missing = f"{self._wal_path(gen).name} (its first entry does not verify)"   # zeroed, not torn
            for op in ops:
                apply(rows, op)
                next_seq = max(next_seq, op.seq + 1)
                if op.op == PUT:
                    from_log.add(op.digest)
            wal_bytes += len(ops) * ENTRY_SIZE
            skipped += bad
            if cut:
                torn = True
                if gen != gens[-1]:
                    skipped += 1       # a sealed generation was fsynced whole: a cut inside one is damage
        self.gen = max([wal_from, *gens]) + 1   # the writer continues in a new generation after a checkpoint
        return Recovered(rows, next_seq, wal_bytes, torn, checkpoint_ok, skipped, self.manifest_ok,
                         frozenset(from_log), missing)

    # -- writing --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open a fresh log generation for appends (after recovery and a checkpoint); its name is made durable
        (the folder fsynced) before any entry in it can be acknowledged."""
        assert not self.readonly and self._fd < 0
        self._fd = os.open(self._wal_path(self.gen), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _fsync_dir(self.root)
        self.wal_bytes = 0

    def append(self, ops: list[Op]) -> None:
        """One write() for the whole batch: with kill -9 the log holds all of it or a prefix (never reordered)."""
        if not ops:
            return
        data = b"".join(op.pack() for op in ops)
        dels = any(op.op == DEL for op in ops)
        with self._lock:
            self.pending_dels |= dels
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.write(self._fd, view[done:])
            self.wal_bytes += len(data)

    def sync(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.fdatasync(self._fd)
                self.pending_dels = False

    def rotate(self) -> int:
        """Seal the current log (fsync) and continue in a new generation; returns the new generation. Called under
        the pool lock together with a snapshot of the table, which the following ``write_checkpoint`` records."""
        with self._lock:
            os.fdatasync(self._fd)
            self.pending_dels = False
            os.close(self._fd)
            self.gen += 1
            self._fd = -1
            self.start()
            return self.gen

    def write_checkpoint(self, rows: list[Op], next_seq: int, wal_from: int) -> None:
        """Persist a snapshot that covers every log generation before ``wal_from``, then delete those logs."""
        body = _CKPT.pack(_CKPT_MAGIC, 1, wal_from, next_seq, len(rows)) + b"".join(op.pack() for op in rows)
        _atomic_write(self.root / "checkpoint", body + xxhash.xxh64_intdigest(body).to_bytes(8, "little"))
        for gen in self._wal_gens():
            if gen < wal_from:
                self._wal_path(gen).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1
