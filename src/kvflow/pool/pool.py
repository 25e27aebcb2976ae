"""KVPool: one logical KV store over every memory module and SSD of the host (DESIGN.md §2.2).

    put_many({key: tensor})                               get_many([key, ...]) -> {key: tensor | None}
          │ lock: seq numbers, placement (striper),             │ lock: look up + pin rows, touch LRU
          │       extents (evict LRU if full), log DELs         │
          ▼                                                     ▼
    ┌─ dev 0 workers ─┐ ┌─ dev 1 workers ─┐ ...     every device reads its share in parallel; each record is
    │ encode + write  │ │ encode + write  │         verified (header, checksum, key, seq) — a bad one is a miss,
    └─────────────────┘ └─────────────────┘         counted, logged and dropped, never served
          │ (strict: fdatasync devices)                         │
          ▼                                                     ▼
      lock: insert rows, append PUTs to the log           lock: unpin (free extents of rows removed meanwhile)
      (strict: fdatasync log) -> return

Rows of persistent devices go to the write-ahead log (``journal.py``). This file is the façade; the parts live apart:
``state.py`` (what they share), ``recovery.py`` (table + allocators from checkpoint + log), ``fsck.py`` (verify every
record), ``eviction.py`` (LRU eviction, drop, release), ``organizer.py`` (probe -> p_i), ``striping.py`` (placement).
Anonymous memory devices are volatile and never logged.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Iterable, Mapping

import torch

from kvflow.chunks.keys import ChunkKey, layer_tail, prefix_hashes, record_digest
from kvflow.chunks.record import DTYPE_CODES, HEADER_SIZE, decode, encode_into, parse_header, record_size
from kvflow.errors import ConfigError, KVFlowError, RecordError, StoreError
from kvflow.pool import eviction, keyed
from kvflow.pool.allocator import ExtentAllocator, round_up
from kvflow.pool.config import PoolConfig
from kvflow.pool.devices import Throttled, open_tier
from kvflow.pool.devices.base import padded
from kvflow.pool.devices.throttle import MAX_LATENCY_S, check_latency
from kvflow.pool.fsck import fsck
from kvflow.pool.index import Entry, LookupTable
from kvflow.pool.journal import PUT, Journal, Op
from kvflow.pool.organizer import PROBE_CHUNK, Bandwidth, effective, probe, ratios
from kvflow.pool.recovery import recover
from kvflow.pool.state import PoolState, Slot
from kvflow.pool.striping import make_placement
from kvflow.threads import single_threaded, single_threaded_run

log = logging.getLogger("kvflow.pool")

_UNHEALTHY_AFTER = 3       # consecutive I/O errors before a device is taken out of service
_REPROBE_S = 30.0          # a device out of service is tried again this long after it left
_RETRIES = 2               # a transient I/O error is retried this many times before it counts
_FULL = {errno.ENOSPC, errno.EDQUOT}   # a full disk: this put fails there, the device stays in service
_TRANSIENT = {errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT}
_NODE_DOWN = errno.EHOSTDOWN   # one node of a keyed store is suspect (devices/remote.py): the store stays in service
_DEFAULT_BW = 1e9          # assumed when a device was never probed (read-only open of an unprobed pool)


def _retry(fn, *args):
    """``fn(*args)``, again after a transient OSError (up to _RETRIES times, short backoff)."""
    for attempt in range(_RETRIES + 1):
        try:
            return fn(*args)
        except OSError as err:
            if err.errno not in _TRANSIENT or attempt == _RETRIES:
                raise
            time.sleep(0.002 * (attempt + 1))


def _check_key(key) -> None:
    if not isinstance(key, ChunkKey):
        raise TypeError(f"pool keys are ChunkKey values, not {type(key).__name__} ({key!r:.40}); make them with "
                        f"kvflow.chunks.keys.chunk_keys(token_ids, fingerprint, chunk_tokens, layer_groups)")


class KVPool:
    """Use ``KVPool.open(config_or_path)`` or ``KVPool.memory(...)``. Thread-safe; a context manager."""

    def __init__(self, cfg: PoolConfig, readonly: bool = False):
        self.cfg = cfg
        self.readonly = readonly
        self.chunk_tokens = cfg.chunk_tokens
        self.dtype = cfg.dtype
        self._state = PoolState(cfg, readonly, Journal(cfg.index_dir, readonly) if cfg.index_dir else None)
        self._ckpt_lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._inflight = 0                 # put_many / get_many / fsck / probe calls running: close() waits for them
        self._idle = threading.Condition()
        self.synced_at = 0.0               # time.time() at which the last completed sync pass began: every put
        #                                    acknowledged before it is on stable storage (relaxed; strict: every put)
        self._sync_passes, self._sync_pass_max_s = 0, 0.0
        self._manifest: dict = {"devices": []}
        self._placement = None
        self._down: dict[int, float] = {}        # device -> when it left service (re-probed after _REPROBE_S)
        try:
            self._open()
        except BaseException:
            self._teardown()
            raise
        self._stop = threading.Event()
        self._bg = None
        if self._state.journal is not None and not readonly:
            self._bg = threading.Thread(target=single_threaded_run(self._background), name="kvpool-checkpoint",
                                        daemon=True)
            self._bg.start()

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def open(cls, config_or_path: PoolConfig | dict | str | os.PathLike, *, readonly: bool = False) -> KVPool:
        """A pool from a PoolConfig, a mapping or a YAML/TOML file (``pool:`` section). With ``readonly`` another
        process can read a pool a writer holds open: the index is loaded from disk now (``refresh()`` reloads)."""
        return cls(PoolConfig.load(config_or_path), readonly=readonly)

    @classmethod
    def memory(cls, capacity: int | str = "1G", *, devices: int = 1, bandwidth: float | None = None,
               chunk_tokens: int = 256, **options) -> KVPool:
        """An in-process pool of ``devices`` anonymous memory devices sharing ``capacity``; ``bandwidth`` (bytes/s)
        caps the whole pool, split over the devices by p_i. ``options`` are further PoolConfig fields."""
        cfg = PoolConfig.load({"devices": [{"type": "memory", "capacity": capacity}] * devices,
                               "chunk_tokens": chunk_tokens, **options})
        for dev in cfg.devices:
            dev.capacity //= devices
        cfg.validate()
        pool = cls(cfg)
        if bandwidth is not None:
            pool.set_throttle(bandwidth)
        return pool

    def _open(self) -> None:
        st, cfg = self._state, self.cfg
        manifest = st.journal.read_manifest() if st.journal else {"devices": []}
        self._check_index_is_ours(manifest)
        known = {d["name"]: d for d in manifest["devices"]}
        next_id = max((d["id"] for d in manifest["devices"]), default=-1) + 1
        for dcfg in cfg.devices:
            try:
                device, store = open_tier(dcfg, readonly=self.readonly)
            except OSError as err:
                raise ConfigError(f"device {dcfg.name}: {err.strerror or err}") from None
            if dcfg.persistent:
                if dcfg.name not in known:
                    known[dcfg.name] = {"id": next_id, "name": dcfg.name}
                    next_id += 1
                ident = known[dcfg.name]["id"]
            else:
                ident = None
            m = known.get(dcfg.name, {}) if dcfg.persistent else {}
            bw = Bandwidth(float(dcfg.bandwidth or m.get("read_bw") or 0),
                           float(dcfg.bandwidth or m.get("write_bw") or 0))
            io = ThreadPoolExecutor(dcfg.workers, thread_name_prefix=f"kvpool-dev{len(st.slots)}",
                                    initializer=single_threaded)
            st.slots.append(Slot(Throttled(device, dcfg.throttle, dcfg.latency_s), dcfg, ident,
                                 ExtentAllocator(device.capacity, device.align), io, bw, cap=dcfg.throttle,
                                 store=store))
            if store is not None and not store.reachable:   # a store down at open: the pool starts without it
                with st.lock:
                    self._leave_service(len(st.slots) - 1)
        st.table = LookupTable(len(st.slots))
        if st.journal is not None:
            recover(st)
            if not self.readonly:
                manifest["devices"] = sorted(known.values(), key=lambda d: d["id"])
                self._manifest = manifest
                try:
                    self.checkpoint(rotate=False)
                except OSError as err:   # a full disk must not lock the pool out: the old checkpoint + log hold all
                    log.warning("pool index %s: cannot write a checkpoint at open (%s); continuing on the log",
                                cfg.index_dir, err.strerror or err)
                st.journal.start()
        self._probe_missing()
        if st.journal is not None and not self.readonly:
            try:
                st.journal.write_manifest(self._manifest)
            except OSError as err:
                log.warning("pool index %s: cannot rewrite the manifest (%s)", cfg.index_dir, err.strerror or err)
        self._placement = make_placement(cfg.placement,
                                         keyed.weights(st, [s.read_bw if s.healthy else 0.0 for s in st.slots]))

    def _check_index_is_ours(self, manifest: dict) -> None:
        """An index folder belongs to one pool: the persistent devices its manifest records. A config that leaves
        any of them out (another pool pointed at the same index_dir) would drop their rows: refused."""
        ours = {d.name for d in self.cfg.devices if d.persistent}
        theirs = [d["name"] for d in manifest["devices"] if d["name"] not in ours]
        if theirs:
            raise ConfigError(f"pool.index_dir {self.cfg.index_dir} is the index of a pool with device "
                              f"{theirs[0].partition(':')[2] or theirs[0]}, which this config does not name; give "
                              f"each pool its own index_dir (a pool's devices can be added to, never left out)")

    def _probe_missing(self) -> None:
        shared: dict[str, Bandwidth] = {}
        for i, s in enumerate(self._state.slots):
            if s.bw.read > 0 or not s.healthy:     # a device down at open is probed once it answers (_revive)
                continue
            key = s.cfg.name if s.cfg.persistent else f"{s.cfg.type}:anonymous"
            if key not in shared:
                shared[key] = self._probe_store_safe(i) if not self.readonly else None
            if s.healthy:
                s.bw = shared[key] or Bandwidth(_DEFAULT_BW, _DEFAULT_BW)

    def _probe_store_safe(self, dev: int) -> Bandwidth | None:
        """probe(dev), where a shared store that answered at open but fails its probe (a node timing out on a busy
        network) leaves service as if it had been down at open: its records are misses until _revive finds it
        answering and probes it then. A local device's probe error still raises: that device is broken."""
        s = self._state.slots[dev]
        try:
            return self.probe(dev)
        except OSError as err:
            if s.store is None:
                raise
            with self._state.lock:
                self._leave_service(dev)
            log.warning("pool: store %s did not answer its bandwidth probe (%s); its records are misses until it "
                        "answers (tried again every %.0f s)", s.device.name, err.strerror or err, _REPROBE_S)
            return None

    def probe(self, dev: int, nbytes: int | None = None) -> Bandwidth | None:
        """Measure one device's bandwidth on free space (unthrottled); records it (and in the manifest). None when
        the device has no room to probe."""
        assert not self.readonly, "probing writes to the device"
        st = self._state
        s = st.slots[dev]
        nbytes = min(nbytes or self.cfg.probe_bytes, s.alloc.free_bytes // 4)
        if s.cfg.type == "memory" and not s.cfg.persistent:
            nbytes = min(nbytes, 64 << 20)
        with st.lock:
            offsets = [off for _ in range(nbytes // PROBE_CHUNK) if (off := s.alloc.alloc(PROBE_CHUNK)) is not None]
        if not offsets:
            return None
        try:
            bw = probe(s.device.inner, offsets, s.io, read_passes=3 if s.cfg.type == "memory" else 1,
                       min_read_s=self.cfg.probe_seconds)
        finally:
            with st.lock:
                for off in offsets:
                    s.alloc.free(off)
                    s.device.discard(off)
        s.bw = bw if s.cfg.bandwidth is None else Bandwidth(float(s.cfg.bandwidth), float(s.cfg.bandwidth))
        if s.id is not None and st.journal is not None:
            for d in self._manifest["devices"]:
                if d["id"] == s.id:
                    d.update(read_bw=bw.read, write_bw=bw.write, probed_at=time.time())
            st.journal.write_manifest(self._manifest)
        if self._placement is not None:
            self._reweigh()
        return bw

    # -- the API the rest of kvflow calls -------------------------------------------------------------------
    @contextmanager
    def _running(self):
        """One public call in flight: close() refuses new ones and waits for these before it closes devices."""
        with self._idle:
            if self._closing:
                raise KVFlowError("this pool is closed")
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def put_many(self, items: Mapping[ChunkKey, torch.Tensor], dtype: torch.dtype | None = None) -> int:
        """Store records (in the given order, which striping follows); keys already stored are kept as they are.
        Returns the number of records written. A full pool evicts least recently used records; a record that
        fits nowhere (every candidate pinned by readers) is skipped, never an error. A write or sync that fails:
        strict mode raises StoreError (naming the device and the cause; the records that were stored stay stored),
        relaxed mode returns the smaller count and counts the rest in ``put_errors``. Tensors on a device are
        copied to the host first (records are host bytes). A full disk (ENOSPC) fails this put's records on that
        device, never the device: its records are still served and later puts may evict."""
        with self._running():
            return self._put_many(items, dtype)

    def _put_many(self, items: Mapping[ChunkKey, torch.Tensor], dtype: torch.dtype | None) -> int:
        if self.readonly:
            raise KVFlowError("this pool is open read-only")
        items = {k: t.cpu() if isinstance(t, torch.Tensor) and t.device.type != "cpu" else t for k, t in items.items()}
        st = self._state
        dtype = dtype or self.dtype
        if dtype not in DTYPE_CODES:
            raise RecordError(f"unsupported storage dtype {dtype} (float32, bfloat16, float16)")
        for key, tensor in items.items():
            _check_key(key)
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"put_many: the value of record {key.hex} is a {type(tensor).__name__}, "
                                f"not a torch.Tensor")
            if tensor.dim() > 6:
                raise RecordError(f"record {key.hex}: a tensor of {tensor.dim()} dims (records hold at most 6)")
            if (length := record_size(tensor.shape, dtype)) > (largest := max(s.alloc.capacity for s in st.slots)):
                raise RecordError(f"record {key.hex} of {length:,} bytes is larger than every device of this pool "
                                  f"(largest: {largest:,} bytes)")
        if self._down:
            self._revive()
        plan, dels = [], []
        with st.lock:
            self._check_open()
            for key, tensor in items.items():
                cur = st.table.get(key.digest)
                if cur is not None and st.slots[cur.dev].healthy:
                    st.table.touch(key.digest, cur)
                    st.counters["put_skipped"] += 1
                    continue
                length = record_size(tensor.shape, dtype)
                where = self._place(length, dels, lane=key.layers[0])
                if where is None:
                    st.counters["put_dropped"] += 1
                    continue
                plan.append((key, tensor, *where, length, st.next_seq))
                st.next_seq += 1
            eviction.log_and_discard(st, dels)          # before any freed extent is overwritten below
        if self.cfg.durability == "strict" and st.journal is not None and st.journal.pending_dels:
            st.journal.sync()          # strict: a DEL is durable before its extent is rewritten
        futures = [(p, st.slots[p[2]].io.submit(self._write_one, *p, dtype)) for p in plan]
        done, failed, unexpected, causes = [], [], None, {}
        for p, fut in futures:
            try:
                done.append((p, fut.result()))
            except OSError as err:
                failed.append(p)
                causes.setdefault(p[2], err)
                self._io_error(p[2], err, "write")
            except Exception as err:     # a bug: free its extent like a failed write, then raise it
                failed.append(p)
                unexpected = err
        if self.cfg.durability == "strict":
            for i in {p[2] for p, _ in done}:
                try:
                    st.slots[i].device.sync()
                except OSError as err:   # not durable: these records are not acknowledged (their extents freed)
                    causes.setdefault(i, err)
                    self._io_error(i, err, "sync")
                    failed += [p for p, _ in done if p[2] == i]
                    done = [(p, c) for p, c in done if p[2] != i]
        with st.lock:
            ops = []
            for (key, _t, dev, off, length, seq), checksum in done:
                entry = Entry(dev, off, length, seq, checksum)
                old = st.table.insert(key.digest, entry)
                if old is not None:
                    eviction.release(st, old)
                if (ident := st.slots[dev].id) is not None:
                    ops.append(Op(PUT, ident, key.digest, off, length, seq, checksum))
                c = st.slots[dev].counters
                c["writes"] += 1
                c["write_bytes"] += length
            for _key, _t, dev, off, _length, _seq in failed:
                st.slots[dev].alloc.free(off)
                st.slots[dev].device.discard(off)
            try:
                eviction.log_and_discard(st, ops)
            except OSError as err:       # e.g. ENOSPC on the log's disk: stored but not logged, so not durable
                raise StoreError(f"pool index {self.cfg.index_dir}: cannot append to the log "
                                 f"({err.strerror or err}); {len(done)} records of this put are served now but "
                                 f"will not survive a restart", 0, len(done) + len(failed)) from None
            st.counters["put_records"] += len(done)
            st.counters["put_bytes"] += sum(p[4] for p, _ in done)
            st.counters["put_errors"] += len(failed)
        if self.cfg.durability == "strict" and st.journal is not None and ops:
            try:
                st.journal.sync()
            except OSError as err:
                raise StoreError(f"pool index {self.cfg.index_dir}: the log could not be made durable "
                                 f"({err.strerror or err}); {len(done)} records of this put may be lost on a crash",
                                 0, len(done) + len(failed)) from None
        keyed.copy(st, [(p[0], p[1], p[5]) for p, _ in done], dtype, self._io_error)   # remote_placement: copy
        if unexpected is not None:
            raise unexpected
        if causes and self.cfg.durability == "strict":
            dev, err = next(iter(causes.items()))
            raise StoreError(f"device {st.slots[dev].device.name}: {len(failed)} of {len(plan)} records could not "
                             f"be stored ({err.strerror or err}); the other {len(done)} are stored",
                             len(done), len(failed))
        return len(done)

    def get_many(self, keys: Iterable[ChunkKey], staging=None) -> dict[ChunkKey, torch.Tensor | None]:
        """Verified records (storage dtype, stored shape, tensors own their memory); None for a miss. All devices
        are read in parallel. A record failing any check is a miss: counted, logged, dropped from the index.
        With ``staging`` (executor/transfer.py: ``take(n)`` / ``give(t)``) records are read into its reused buffers
        — pinned ones on CUDA — and each record's tensor is a view of one; the caller gives it back once copied
        (a miss's buffer is given back here)."""
        st = self._state
        keys = list(keys)
        for key in keys:
            _check_key(key)
        out: dict[ChunkKey, torch.Tensor | None] = dict.fromkeys(keys)
        if self._down:
            self._revive()
        plan, unknown = [], []
        with st.lock:
            self._check_open()
            for key in dict.fromkeys(keys):
                entry = st.table.get(key.digest)
                if entry is None or not st.slots[entry.dev].healthy:
                    unknown.append(key)
                    continue
                entry.pins += 1
                st.table.touch(key.digest, entry)
                plan.append((key, entry))
        futures = [(key, entry, st.slots[entry.dev].io.submit(self._read_one, key, entry, staging))
                   for key, entry in plan]
        bad = []
        try:
            out.update(keyed.fetch(st, unknown, self._io_error))   # keys this index does not know: the keyed stores
            for key, entry, fut in futures:
                try:
                    out[key] = fut.result()
                except RecordError as err:
                    bad.append((key, entry, err))
                except OSError as err:
                    self._io_error(entry.dev, err, "read")
        finally:
            wait([f for *_, f in futures])      # no extent is unpinned while a worker may still read it
            self._finish_reads(plan, bad, out)
        return out

    def contains(self, keys: Iterable[ChunkKey]) -> list[bool]:
        st = self._state
        keys = list(keys)
        for key in keys:
            _check_key(key)
        with st.lock:
            local = [(e := st.table.get(k.digest)) is not None and st.slots[e.dev].healthy for k in keys]
        return keyed.contains(st, keys, local, self._io_error)    # what the index does not know: asked of the stores

    def longest_prefix(self, token_ids, fingerprint: str, layer_groups: list[tuple[int, int]] | None = None,
                       kind: str = "kv") -> int:
        """Tokens in the longest stored prefix of ``token_ids``: a multiple of chunk_tokens such that every chunk in
        it has a record for every one of ``layer_groups`` (required: the restorer passes the groups it loads)."""
        if not layer_groups:
            raise ValueError("longest_prefix needs the layer groups every chunk must have")
        t0 = time.perf_counter()
        st = self._state
        if self._down:                   # a lookup re-probes too: a restore that finds nothing never reads
            self._revive()
        n, table, slots = 0, st.table, st.slots
        # Hot path (512 chunks x dozens of groups at 128K tokens): record digests without building ChunkKeys.
        tails = [layer_tail(g, kind) for g in layer_groups]
        hashes = prefix_hashes(token_ids, fingerprint, self.chunk_tokens)
        for i, h in enumerate(hashes):   # dict reads: no lock
            for tail in tails:
                e = table.get(record_digest(h, tail))
                if e is None or not slots[e.dev].healthy:
                    break
            else:
                n = i + 1
                continue
            break
        n = keyed.extend_prefix(st, hashes, tails, n, self._io_error)   # beyond the index: binary search in the stores
        with st.lock:
            st.counters["lookup_s"] += time.perf_counter() - t0
            st.counters["lookup_calls"] += 1
        return n * self.chunk_tokens

    @property
    def slots(self) -> tuple[Slot, ...]:
        """The devices as the pool sees them (device behind its throttle, allocator, b_i, health) — for benches,
        fsck tools and tests; change them only through the pool's methods."""
        return tuple(self._state.slots)

    @property
    def parallelism(self) -> int:
        """Devices that serve reads: a read of fewer records than this leaves bandwidth unused."""
        return max(1, sum(1 for s in self._state.slots if s.healthy))

    @property
    def read_bandwidth(self) -> float:
        """Bytes/s the organizer believes the whole pool reads at: sum of b_i over healthy devices, caps applied."""
        return sum(s.read_bw for s in self._state.slots if s.healthy)

    @property
    def read_latency(self) -> float:
        """Seconds every read pays on top of its bytes (the slowest healthy device's; 0 without a throttle). Reads
        in flight together pay it side by side, so a load of r reads on d devices costs about this once per
        ceil(r / (d x workers)) — what the planner's I/O model charges per read step."""
        return max((s.device.latency for s in self._state.slots if s.healthy), default=0.0)

    def set_throttle(self, bytes_per_s: float | None, latency_s: float = 0.0) -> None:
        """Emulate a link: cap the whole pool at ``bytes_per_s``, split over devices by p_i (unchanged, so stored
        data stays evenly striped), and make every read pay ``latency_s`` more than its device's configured
        ``latency_s``. None removes the cap (devices keep any ``throttle`` from their config)."""
        if bytes_per_s is not None and not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
            raise ValueError(f"set_throttle: bytes_per_s must be a positive number or None, got {bytes_per_s!r}")
        latency_s = check_latency(latency_s, "set_throttle: latency_s")
        st = self._state
        with st.lock:
            base = [effective(s.bw.read, s.cfg.throttle) if s.healthy else 0.0 for s in st.slots]
            for s, p in zip(st.slots, ratios(base)):
                s.cap = s.cfg.throttle if bytes_per_s is None else (max(bytes_per_s * p, 1.0) if p else None)
                s.device.set_rate(s.cap)
                s.device.set_latency(min(s.cfg.latency_s + latency_s, MAX_LATENCY_S))

    def stats(self) -> dict:
        st = self._state
        with st.lock:
            p = ratios([s.read_bw if s.healthy else 0.0 for s in st.slots])
            devs = [{**s.device.describe(), "capacity": s.alloc.capacity, "used": s.alloc.used_bytes,
                     "free": s.alloc.free_bytes, "records": st.table.count(i), "read_bw": s.read_bw,
                     "probed_read_bw": s.bw.read, "probed_write_bw": s.bw.write, "throttle": s.cap, "latency_s": s.device.latency, "p": p[i],
                     "healthy": s.healthy, **s.counters} for i, s in enumerate(st.slots)]
            return {"records": len(st.table), "capacity": sum(d["capacity"] for d in devs),
                    "used": sum(d["used"] for d in devs), "read_bandwidth": self.read_bandwidth,
                    "read_latency": self.read_latency,
                    "durability": self.cfg.durability, "placement": self.cfg.placement, "readonly": self.readonly,
                    "next_seq": st.next_seq, "synced_at": self.synced_at, "sync_passes": self._sync_passes,
                    "sync_pass_max_s": self._sync_pass_max_s, **st.counters, "devices": devs}

    def entries(self) -> list[tuple[bytes, int, int, int, int]]:
        """(digest, device, offset, length, seq) of every row — for fsck and tests."""
        with self._state.lock:
            return [(d, e.dev, e.offset, e.length, e.seq) for d, e in self._state.table.items()]

    def fsck(self, repair: bool = True, scan: bool = False) -> dict:
        """Read and verify every record (header, checksum, key digest, sequence). Bad ones are reported and, with
        ``repair`` on a writable pool, dropped. Also checks that no two rows share an extent; with ``scan`` counts
        the intact records on the devices that the index does not name (``unindexed``)."""
        with self._running():
            return fsck(self._state, repair, scan)

    def rebuild(self) -> dict:
        """Rebuild the index from the devices' own record headers (each record verified, newest sequence per key
        wins) and checkpoint it — ``kvflow pool fsck --rebuild``. Returns {devices, found, bad, records}."""
        st = self._state
        if st.journal is None:
            raise KVFlowError("this pool has no index_dir: its index is not kept, nothing to rebuild")
        with st.lock:
            report = recover(st, rebuild=True)
        self.checkpoint()
        return {"devices": report.devices, "found": report.found, "bad": report.bad, "records": len(st.table)}

    def refresh(self) -> None:
        """Read-only pools: reload the index from disk to see what the writer stored since open."""
        st = self._state
        assert self.readonly and st.journal is not None
        with st.lock:
            recover(st)

    def checkpoint(self, rotate: bool = True) -> None:
        """Make everything stored so far durable and compact the log into a new checkpoint."""
        st = self._state
        if st.journal is None or self.readonly:
            return
        with self._ckpt_lock:
            t0 = time.time()
            with st.lock:
                rows = [Op(PUT, st.slots[e.dev].id, d, e.offset, e.length, e.seq, e.checksum)
                        for d, e in st.table.items() if st.slots[e.dev].id is not None]
                next_seq = st.next_seq
                wal_from = st.journal.rotate() if rotate else st.journal.gen
            for s in st.slots:
                s.device.sync()   # the data of every row is durable before the snapshot that names it
            st.journal.write_checkpoint(rows, next_seq, wal_from)
            self._synced(t0)

    def _sync_pass(self) -> None:
        """Relaxed mode's periodic pass: every device, then the log. Whatever a put acknowledged before the pass
        began is durable when it ends (relaxed recovery verifies the records the log names since the checkpoint,
        so a log entry that reached the disk before its record is harmless)."""
        st = self._state
        with self._ckpt_lock:
            t0 = time.time()
            for s in st.slots:
                s.device.sync()
            st.journal.sync()
            self._synced(t0)

    def _synced(self, started: float) -> None:
        self.synced_at = max(self.synced_at, started)
        self._sync_passes += 1
        self._sync_pass_max_s = max(self._sync_pass_max_s, time.time() - started)

    def close(self) -> None:
        with self._idle:
            if self._closing:
                return
            self._closing = True                  # new calls are refused; those in flight finish first
            self._idle.wait_for(lambda: self._inflight == 0)
        if self._closed:
            return
        if self._bg is not None:
            self._stop.set()
            self._bg.join()
        if self._state.journal is not None and not self.readonly:
            try:
                self.checkpoint()
            except OSError as err:      # the log (synced by the rotation) still holds everything
                log.warning("pool index %s: no checkpoint at close (%s); the next open replays the log",
                            self.cfg.index_dir, err.strerror or err)
        with self._state.lock:
            self._closed = True
        self._teardown()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVPool({len(self._state.slots)} devices, {len(self._state.table)} records, {self.cfg.durability})"

    # -- internals (callers hold the state lock where noted) ------------------------------------------------
    def _teardown(self) -> None:
        for s in self._state.slots:
            s.io.shutdown(wait=True)
            s.device.close()
        if self._state.journal is not None:
            self._state.journal.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVFlowError("this pool is closed")

    def _finish_reads(self, plan, bad, out) -> None:
        """Unpin what get_many pinned (even if it raised), drop the bad records, count."""
        st = self._state
        with st.lock:
            for key, entry in plan:
                entry.pins -= 1
                eviction.release(st, entry)
                if out[key] is not None:
                    c = st.slots[entry.dev].counters
                    c["reads"] += 1
                    c["read_bytes"] += entry.length
            dels = []
            for key, entry, err in bad:   # a reader beside a writer sees records it evicted: routine, not alarming
                log.log(logging.INFO if self.readonly else logging.WARNING, "pool: dropping record %s on %s: %s",
                        key.hex, st.slots[entry.dev].device.name, err)
                st.slots[entry.dev].counters["corrupt"] += 1
                st.counters["corrupt"] += 1
                eviction.drop(st, key.digest, entry, dels)
            eviction.log_and_discard(st, dels)
            hits = sum(v is not None for v in out.values())
            st.counters["hits"] += hits
            st.counters["misses"] += len(out) - hits

    def _place(self, length: int, dels: list, lane: int = 0) -> tuple[int, int] | None:
        """Lock held. Device and offset for a new record, in the striper's order: the first device below its high
        watermark with room, else the first with room at all (capacity-aware spill), and only when the record fits
        nowhere, the first device where evicting least recently used records makes room — just those it needs."""
        st = self._state
        order = self._placement.order(length, lane)
        below = [i for i in order if st.slots[i].alloc.used_bytes + round_up(length, st.slots[i].alloc.align)
                 <= self.cfg.high_watermark * st.slots[i].alloc.capacity]
        for i in below + order:
            if (off := st.slots[i].alloc.alloc(length)) is not None:
                self._placement.charge(i, length, lane)
                return i, off
        for i in order:
            if eviction.evict(st, i, length, dels) and (off := st.slots[i].alloc.alloc(length)) is not None:
                self._placement.charge(i, length, lane)
                return i, off
        return None

    def _io_error(self, dev: int, err: Exception, what: str) -> None:
        st = self._state
        s = st.slots[dev]
        if getattr(err, "errno", None) in _FULL:      # a full disk fails writes, not the device: reads go on
            with st.lock:
                s.counters["errors"] += 1
                s.counters["full"] += 1
            log.warning("pool: %s on %s: no space left; the records of this put there are not stored (the device "
                        "stays in service)", what, s.device.name)
            return
        if getattr(err, "errno", None) == _NODE_DOWN:   # its records there are misses; the store logged the node once
            with st.lock:
                s.counters["errors"] += 1
            return
        with st.lock:
            s.counters["errors"] += 1
            s.errors_in_row += 1
            if s.healthy and s.errors_in_row >= _UNHEALTHY_AFTER:
                self._leave_service(dev)
                log.error("pool: device %s failed %d %ss in a row (%s); its records are misses now",
                          s.device.name, s.errors_in_row, what, err)
            else:
                log.warning("pool: %s error on %s: %s", what, s.device.name, err)

    def _revive(self) -> None:
        """Devices out of service for _REPROBE_S get one small read; one that answers is back in service (a
        transient fault must not make its records misses for the rest of the process)."""
        now = time.monotonic()
        for dev, since in list(self._down.items()):
            if now - since < _REPROBE_S:
                continue
            s = self._state.slots[dev]
            try:
                s.device.inner.read(0, s.device.align)
            except RecordError:
                pass                     # answered (with no record there): the device itself works
            except OSError as err:
                self._down[dev] = now
                log.info("pool: device %s still fails (%s); next try in %.0f s", s.device.name, err, _REPROBE_S)
                continue
            with self._state.lock:
                s.healthy, s.errors_in_row = True, 0
                self._down.pop(dev, None)
                self._reweigh()
            log.warning("pool: device %s answers again; back in service", s.device.name)
            if s.bw.read == 0:      # down since the pool opened: never measured (a probe reweighs by what it found)
                bw = None if self.readonly else self._probe_store_safe(dev)
                if s.healthy and bw is None:
                    s.bw = Bandwidth(_DEFAULT_BW, _DEFAULT_BW)
                    self._reweigh()

    def _leave_service(self, dev: int) -> None:
        """Device ``dev`` out of service (the caller holds the state lock): its records are misses, the striper
        gives it no more, and _revive tries it again after _REPROBE_S. The one way a device leaves: down at open, a
        store failing its probe, or _UNHEALTHY_AFTER I/O errors in a row."""
        self._state.slots[dev].healthy = False
        self._down[dev] = time.monotonic()
        if self._placement is not None:
            self._reweigh()

    def _reweigh(self) -> None:
        weights = keyed.weights(self._state, [s.read_bw if s.healthy else 0.0 for s in self._state.slots])
        if any(weights):
            self._placement.set_weights(weights)

    def _write_one(self, key: ChunkKey, tensor: torch.Tensor, dev: int, offset: int, length: int, seq: int,
                   dtype: torch.dtype) -> int:
        """Worker thread. Encode straight into the device's staging buffer (one cast/copy + checksum), write it."""
        slot = self._state.slots[dev]
        buf = slot.device.staging(offset, length)
        encode_into(buf.numpy(), key, tensor.detach(), seq, dtype)
        if buf.numel() > length:
            buf[length:].zero_()
        _retry(slot.device.commit, offset, buf)
        slot.errors_in_row = 0
        return parse_header(buf[:HEADER_SIZE].numpy()).checksum

    def _read_one(self, key: ChunkKey, entry: Entry, staging=None) -> torch.Tensor:
        """Worker thread. One read into a page-aligned buffer (fresh, or the caller's staging buffer; GIL released),
        then verify against the key."""
        slot = self._state.slots[entry.dev]
        out = staging.take(padded(entry.length)) if staging is not None else None
        try:
            data = _retry(slot.device.read, entry.offset, entry.length, out)
            header, tensor = decode(data.numpy(), expect=key)
            if header.seq != entry.seq and slot.store is None:   # a keyed store holds any engine's sequence
                raise RecordError(f"record sequence {header.seq} differs from the index ({entry.seq}): stale extent")
        except BaseException:
            if out is not None:
                staging.give(out)
            raise
        if out is not None and data.data_ptr() != out.data_ptr():    # the device read into a buffer of its own
            staging.give(out)
        slot.errors_in_row = 0
        return tensor

    def _background(self) -> None:
        """Passes start at a fixed rate, one ``checkpoint_interval_s`` after the previous one *started* (right
        after it ended when it took longer), so in relaxed mode what a crash can lose is bounded by the interval
        plus one pass, not the interval plus two."""
        st, interval = self._state, self.cfg.checkpoint_interval_s
        next_at = time.monotonic() + interval
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = time.monotonic() + interval
            try:
                if st.journal.wal_bytes > max(self.cfg.wal_compact_bytes, 64 * len(st.table)):
                    self.checkpoint()
                elif self.cfg.durability == "relaxed":
                    self._sync_pass()
            except OSError as err:   # a failing disk must not kill the pool; the next put/get reports it
                log.error("pool index %s: background sync failed (%s); retried in %.3g s", self.cfg.index_dir,
                          err.strerror or err, interval)
            except Exception:        # a bug: its traceback
                log.exception("pool: background checkpoint failed")
