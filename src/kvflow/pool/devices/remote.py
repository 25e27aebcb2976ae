"""``remote``: a Redis / Valkey store — a cluster or one server — shared by every engine and host (DESIGN.md §4,
scale-out). Records are stored unchanged (the same self-describing, checksummed bytes as on every device, verified
on every read) under a content address: ``key_prefix + hex(record key digest)``. The digest is the prefix-chained
xxh3 of the token ids, model fingerprint, chunk size, kind and layer range (``kvflow.chunks.keys``) — identical in
every process, after restarts and on every host, so an engine finds a context another engine stored without that
engine's index.

    engine A                               Redis cluster (16384 hash slots over the masters)
      put_many ──(stripe: p_i share | copy: all)──► SET kvflow:<digest> <record>   node of slot(key)
    engine B                                   │
      longest_prefix ──(binary search, EXISTS pipelined per node)──┤
      get_many ──(GET pipelined per node, nodes in parallel)──────►│ verify(record, key) ──► tensor | miss

Two halves: ``RemoteDevice`` — the pool's device interface (offsets from the pool's allocator map to the store key
of what was put there; probe and scratch data get keys of their own) plus batched, per-node pipelined GET / EXISTS /
SET by digest — and the pool's view of the store (``fetch`` / ``contains`` / ``extend_prefix`` / ``copy`` /
``weights``), which ``KVPool`` calls for keys its own index does not know.

Eviction is the store's (``maxmemory-policy allkeys-lru``): a record it evicted, or lost with a node restarted
empty, is a miss and the restorer recomputes it. A node that fails makes its records misses; the store unreachable
at start leaves the pool without it (a warning) until the pool's re-probe finds it answering. Credentials come from
the device config, ``pool.remote_username`` / ``remote_password`` (``KVFLOW_POOL_REMOTE_PASSWORD``) or the URL, and
are never logged; a wrong one is one ConfigError.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterable
from urllib.parse import unquote, urlsplit

import numpy as np
import torch

from kvflow.chunks.keys import ChunkKey, record_digest
from kvflow.chunks.record import HEADER_SIZE, decode, encode_into, parse_header, record_size
from kvflow.config import check
from kvflow.errors import ConfigError, RecordError
from kvflow.pool.devices.base import ALIGN, Device, aligned_empty, check_writable, into

if TYPE_CHECKING:
    from kvflow.pool.state import PoolState, Slot

log = logging.getLogger("kvflow.pool")

DEFAULT_CAPACITY = 1 << 40   # what the pool's allocator accounts for remotely; the store's maxmemory decides really
BATCH = 32                   # keys per pipelined request: several requests per node run side by side
TLS_KEYS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_cert_reqs",
            "ssl_check_hostname", "ssl_ciphers", "ssl_min_version")

OnError = Callable[[int, Exception, str], None]


def _parse_url(url: str) -> tuple[bool, list[tuple[str, int]], str | None, str | None]:
    """(tls, [(host, port)], user, password) of ``redis[s]://[user[:password]@]host:port[,host:port...]``."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.netloc:
        raise ConfigError(f"expected redis://host:port[,host:port] or rediss://..., got {_redact(url)!r}")
    creds, _, hosts = parts.netloc.rpartition("@")
    user, _, password = creds.partition(":")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{item.strip()!r} in {_redact(url)!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return parts.scheme == "rediss", nodes, unquote(user) or None, unquote(password) or None


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rpartition("@")[2]


def _is_auth(err: BaseException) -> bool:
    import redis

    text = str(err).upper()
    return isinstance(err, (redis.AuthenticationError, redis.exceptions.NoPermissionError)) or any(
        s in text for s in ("WRONGPASS", "NOAUTH", "INVALID USERNAME-PASSWORD", "AUTHENTICATION REQUIRED",
                            "INVALID PASSWORD"))


def _os_error(err: BaseException, name: str) -> OSError:
    """A store failure as the OSError the pool counts against the device (a timeout is transient: retried)."""
    import redis

    if isinstance(err, redis.TimeoutError):
        code = errno.ETIMEDOUT
    elif _is_auth(err):
        code = errno.EACCES
    elif isinstance(err, redis.exceptions.OutOfMemoryError):
        code = errno.ENOSPC
    else:
        code = errno.ECONNREFUSED
    return OSError(code, f"{name}: {type(err).__name__}: {str(err)[:200]}")


class RemoteDevice(Device):
    kind = "net"
    needs_path = False
    needs_capacity = False
    content_addressed = True   # a record lives under its key digest: no extent is reused, no sequence to compare

    @staticmethod
    def check_config(cfg, where: str) -> None:
        check(bool(cfg.url), f"{where}.url: required for a remote device (redis://host:port[,host:port])")
        try:
            _parse_url(cfg.url)
        except ConfigError as err:
            raise ConfigError(f"{where}.url: {err}") from None
        check(cfg.timeout_s > 0, f"{where}.timeout_s: must be positive seconds")
        check(cfg.ttl_s >= 0, f"{where}.ttl_s: must be 0 (no expiry) or positive seconds")
        check(bool(cfg.key_prefix), f"{where}.key_prefix: must not be empty")
        unknown = sorted(set(cfg.tls or {}) - set(TLS_KEYS))
        check(not unknown, f"{where}.tls: unknown key {unknown[0] if unknown else ''!r} (known: {', '.join(TLS_KEYS)})")

    def __init__(self, cfg, readonly: bool = False):
        super().__init__(cfg, readonly)
        self.persistent = False                  # the store keeps records; this process's index of them does not
        self.capacity = (cfg.capacity or DEFAULT_CAPACITY) // ALIGN * ALIGN
        self.tls, self.seeds, user, password = _parse_url(cfg.url)
        self._auth = {"username": cfg.username or user, "password": cfg.password or password}
        self._prefix = cfg.key_prefix.encode()
        self._scratch = self._prefix + f"scratch:{uuid.uuid4().hex}:".encode()   # probe data of this process
        self._keys: dict[int, bytes] = {}       # offset -> store key of what this process put there
        self._lock = threading.Lock()
        self._client = None
        self.rounds = 0                          # pipelined rounds (all nodes in parallel) — tests count them
        self.reachable = True
        self.unreachable = ""                    # why it did not answer at start (``kvflow pool init`` refuses then)
        try:
            self.client()
        except OSError as err:                   # unreachable at start: the pool starts without it, re-probes later
            self.reachable = False
            self.unreachable = err.strerror or str(err)
            log.warning("pool: remote store %s unreachable (%s); starting without it, re-probing later",
                        self.name, err.strerror)

    # -- connection -----------------------------------------------------------------------------------------
    def client(self):
        """The (lazily connected) redis-py client: RedisCluster or Redis, each with its own connection pool."""
        with self._lock:
            if self._client is None:
                self._client = self._connect()
                self.reachable = True
            return self._client

    def _connect(self):
        from kvflow.extras import require
        redis = require("redis")
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        cfg = self.cfg
        opts = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s, retry=Retry(NoBackoff(), 1),
                    max_connections=max(8, 4 * cfg.workers), **self._auth)
        if self.tls or cfg.tls:
            opts.update(ssl=True, **(cfg.tls or {}))
        try:
            if cfg.cluster:
                client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.seeds],
                                      require_full_coverage=False, cluster_error_retry_attempts=1, **opts)
            else:
                client = redis.Redis(host=self.seeds[0][0], port=self.seeds[0][1], **opts)
            client.ping()
            return client
        except (redis.RedisError, redis.exceptions.RedisClusterException) as err:   # the latter: not a RedisError
            if "cluster mode is not enabled" in str(err).lower():
                raise ConfigError(f"{self.name}: this store is one server, not a cluster (cluster mode is not "
                                  f"enabled on it); set cluster: false on this device") from None
            cause = err.__cause__ or err.__context__
            if _is_auth(err) or (cause is not None and _is_auth(cause)):
                user = self._auth["username"]
                raise ConfigError(f"{self.name}: the store refused the credentials"
                                  f"{f' of ACL user {user!r}' if user else ''} (wrong password or user); set the "
                                  f"device's password/username or KVFLOW_POOL_REMOTE_PASSWORD") from None
            raise _os_error(err, self.name) from None

    def _call(self, fn, *args, **kw):
        import redis

        try:
            return fn(self.client(), *args, **kw)
        except (redis.RedisError, redis.exceptions.RedisClusterException) as err:
            raise _os_error(err, self.name) from None

    # -- the device interface (the pool's striped path) -----------------------------------------------------
    def store_key(self, digest: bytes) -> bytes:
        return self._prefix + digest.hex().encode()

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        check_writable(self)
        arr = buf.numpy()
        try:
            header = parse_header(arr[:HEADER_SIZE])
            key, n = self.store_key(header.digest), header.total_size
        except RecordError:                      # not a record (the bandwidth probe): a scratch key of this process
            key, n = self._scratch + str(offset).encode(), buf.numel()
        self._call(lambda c: c.set(key, memoryview(arr)[:n], ex=self.cfg.ttl_s or None))
        self._keys[offset] = key

    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        key = self._keys.get(offset)
        if key is None:
            self._call(lambda c: c.exists(self._scratch))     # the store answers (the pool's re-probe asks this)
            raise RecordError(f"{self.name}: nothing stored at {offset} by this process")
        data = self._call(lambda c: c.get(key))
        if data is None:
            raise RecordError("not in the store (evicted, expired or its node restarted empty): a miss")
        return _owned(data, out)[:length]

    def discard(self, offset: int) -> None:
        key = self._keys.pop(offset, None)
        if key is not None and key.startswith(self._scratch):   # shared records stay: eviction is the store's
            try:
                self._call(lambda c: c.unlink(key))
            except OSError:
                pass

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:   # closing a half-dead connection pool must not fail the pool's close
                pass

    def describe(self) -> dict:
        return {**super().describe(), "cluster": self.cfg.cluster, "tls": bool(self.tls or self.cfg.tls),
                "reachable": self.reachable}

    # -- batched, pipelined access by digest ----------------------------------------------------------------
    def batches(self, keys: list[bytes]) -> list[tuple[object, list[int]]]:
        """(node client, indices into ``keys``) per pipelined request: keys grouped by the node serving their hash
        slot (one server: one group), at most BATCH keys a request."""
        client = self.client()
        groups: dict[object, list[int]] = {}
        if self.cfg.cluster:
            for i, key in enumerate(keys):
                node = client.get_node_from_key(key)
                groups.setdefault(node.name, []).append(i)
            nodes = {n.name: n for n in client.get_nodes()}
            pairs = [(client.get_redis_connection(nodes[name]), idx) for name, idx in groups.items()]
        else:
            pairs = [(client, list(range(len(keys))))]
        return [(conn, idx[j:j + BATCH]) for conn, idx in pairs for j in range(0, len(idx), BATCH)]

    @staticmethod
    def pipelined(conn, op: str, keys: list[bytes], values: list | None = None, ttl: int = 0) -> list:
        """One round trip to one node: GET / EXISTS / SET of every key. Raises redis errors."""
        pipe = conn.pipeline(transaction=False)
        for i, key in enumerate(keys):
            if op == "get":
                pipe.get(key)
            elif op == "exists":
                pipe.exists(key)
            else:
                pipe.set(key, values[i], ex=ttl or None)
        return pipe.execute(raise_on_error=False)


def _owned(data: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
    out = into(out if out is not None and out.numel() >= len(data) else None, len(data))
    out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out


# -- the pool's view of the store ---------------------------------------------------------------------------------
def _remote(st: PoolState) -> list[int]:
    return [i for i, s in enumerate(st.slots) if s.healthy and getattr(s.device.inner, "content_addressed", False)]


def _round(st: PoolState, i: int, op: str, keys: list[bytes], on_error: OnError, values: list | None = None,
           nbytes: Callable[[list], int] | None = None) -> list | None:
    """One pipelined round on remote slot ``i``: every node's requests in parallel on the slot's I/O workers.
    Returns one result per key (None where its node failed; an exception object where the command did), or None
    when no node answered (counted against the device: three such rounds in a row take it out of service)."""
    s: Slot = st.slots[i]
    dev: RemoteDevice = s.device.inner
    try:
        plan = dev.batches(keys)
    except OSError as err:
        on_error(i, err, op)
        return None
    dev.rounds += 1
    t0 = time.monotonic()
    futures: list[tuple[list[int], Future]] = [
        (idx, s.io.submit(dev.pipelined, conn, op, [keys[j] for j in idx],
                          None if values is None else [values[j] for j in idx], dev.cfg.ttl_s))
        for conn, idx in plan]
    out: list = [None] * len(keys)
    failed, first = 0, None
    for idx, fut in futures:
        try:
            for j, r in zip(idx, fut.result()):
                out[j] = r
        except Exception as err:   # a node down or timing out: its keys are misses, the other nodes still serve
            failed, first = failed + 1, first or err
    if first is not None:
        err = _os_error(first, dev.name)
        if failed == len(futures):
            on_error(i, err, op)
            return None
        with st.lock:
            s.counters["errors"] += 1
        log.warning("pool: %d of %d requests to %s failed (%s); their records are misses", failed, len(futures),
                    dev.name, err.strerror)
    s.errors_in_row = 0
    if nbytes is not None:
        _pay(s, nbytes(out), t0)
    return out


def _pay(s: Slot, nbytes: int, t0: float) -> None:
    """Keyed transfers pay the slot's throttle like its striped reads do (an emulated link caps both)."""
    dev = s.device
    bucket, latency = getattr(dev, "_read", None), getattr(dev, "latency", 0.0)
    if bucket is None and not latency:
        return
    deadline = (bucket.reserve(nbytes, burst=not latency) if bucket is not None else t0) + latency
    if (delay := deadline - dev.clock()) > 0:
        dev.sleep(delay)


def _present(st: PoolState, digests: list[bytes], on_error: OnError) -> set[bytes]:
    """The digests some healthy remote device holds (one pipelined EXISTS round per remote device)."""
    found: set[bytes] = set()
    for i in _remote(st):
        want = [d for d in digests if d not in found]
        if not want:
            break
        dev = st.slots[i].device.inner
        got = _round(st, i, "exists", [dev.store_key(d) for d in want], on_error)
        if got is not None:
            found.update(d for d, r in zip(want, got) if r is not None and not isinstance(r, Exception) and r > 0)
    return found


def contains(st: PoolState, keys: list[ChunkKey], local: list[bool], on_error: OnError) -> list[bool]:
    """``local`` (what the pool's index knows) or'ed with what the store holds, asked in one pipelined round."""
    unknown = [k.digest for k, ok in zip(keys, local) if not ok]
    if not unknown or not _remote(st):
        return local
    have = _present(st, unknown, on_error)
    return [ok or k.digest in have for k, ok in zip(keys, local)]


def extend_prefix(st: PoolState, hashes: list[bytes], tails: list[bytes], n: int, on_error: OnError) -> int:
    """Chunks of the longest prefix stored locally or in the store, given that the first ``n`` are known locally.
    One pipelined round asks for the first unknown chunk and the last one together (nothing there / the whole
    context there: done), then a binary search over the chunk chain, one round per probe (a chunk is there when
    every layer group's record is): O(log chunks) round trips, never one per chunk. It assumes the stored chunks
    of a context are a prefix; a hole the store evicted below the answer is a miss on read and is recomputed — the
    answer is a hint, the read is the check."""
    if n >= len(hashes) or not _remote(st):
        return n
    table, slots = st.table, st.slots

    def there(chunks: list[int]) -> list[bool]:
        need = {}
        for i in chunks:
            for tail in tails:
                d = record_digest(hashes[i], tail)
                e = table.get(d)
                if e is None or not slots[e.dev].healthy:
                    need.setdefault(i, []).append(d)
        have = _present(st, [d for ds in need.values() for d in ds], on_error) if need else set()
        return [all(d in have for d in need.get(i, ())) for i in chunks]

    last = len(hashes) - 1
    first_ok, last_ok = there([n, last]) if last > n else there([n]) * 2
    if not first_ok:
        return n
    if last_ok:
        return len(hashes)
    lo, hi = n + 1, last                 # chunks [0, lo) there, the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if there([mid - 1])[0]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fetch(st: PoolState, keys: list[ChunkKey], on_error: OnError) -> dict[ChunkKey, torch.Tensor]:
    """Records of ``keys`` (which the pool's index does not know) from the store, verified like any read; a
    record absent, evicted, on a failed node or failing verification is left out (a miss)."""
    out: dict[ChunkKey, torch.Tensor] = {}
    for i in _remote(st) if keys else ():
        want = [k for k in keys if k not in out]
        if not want:
            break
        s, dev = st.slots[i], st.slots[i].device.inner
        got = _round(st, i, "get", [dev.store_key(k.digest) for k in want], on_error,
                     nbytes=lambda rs: sum(len(r) for r in rs if isinstance(r, bytes)))
        if got is None:
            continue
        bad, moved, found = [], 0, 0
        for key, data in zip(want, got):
            if not isinstance(data, bytes):
                continue
            try:
                out[key] = decode(_owned(data).numpy(), expect=key)[1]
                moved, found = moved + len(data), found + 1
            except RecordError as err:
                bad.append(key)
                log.warning("pool: dropping record %s from %s: %s", key.hex, dev.name, err)
        if bad:     # a record that fails verification is deleted, so no engine reads it again
            try:
                dev._call(lambda c: [c.unlink(dev.store_key(k.digest)) for k in bad])
            except OSError:
                pass
        with st.lock:
            s.counters["reads"] += found
            s.counters["read_bytes"] += moved
            s.counters["corrupt"] += len(bad)
            st.counters["corrupt"] += len(bad)
    return out


def copy(st: PoolState, items: Iterable[tuple[ChunkKey, torch.Tensor, int]], dtype: torch.dtype,
         on_error: OnError) -> int:
    """``remote_placement: copy``: every record the pool stored locally is also written to the store (pipelined
    SETs, encoded on the slot's workers). Best effort — a copy that fails is counted (``put_errors``) and logged,
    the local record stays. Returns records copied."""
    if st.cfg.remote_placement != "copy" or st.readonly:
        return 0
    remote = {i for i, s in enumerate(st.slots) if getattr(s.device.inner, "content_addressed", False)}
    items = [it for it in items if (e := st.table.get(it[0].digest)) is None or e.dev not in remote]
    if not items:               # a pool of nothing but the store stripes to it: no second copy
        return 0
    copied = 0
    for i in _remote(st):
        s, dev = st.slots[i], st.slots[i].device.inner

        def encoded(item) -> memoryview:
            key, tensor, seq = item
            buf = aligned_empty(record_size(tensor.shape, dtype))
            encode_into(buf.numpy(), key, tensor.detach(), seq, dtype)
            return memoryview(buf.numpy())

        values = list(s.io.map(encoded, items))
        got = _round(st, i, "set", [dev.store_key(k.digest) for k, _, _ in items], on_error, values=values)
        ok = 0 if got is None else sum(r is True for r in got)
        with st.lock:
            s.counters["writes"] += ok
            s.counters["write_bytes"] += sum(len(v) for v, r in zip(values, got or ()) if r is True)
            st.counters["put_errors"] += len(items) - ok
        copied = max(copied, ok)
    return copied


def weights(st: PoolState, bandwidths: list[float]) -> list[float]:
    """The striper's weights: b_i, except that with ``remote_placement: copy`` remote devices take no stripes while
    a local device can (they get a copy of everything instead). Never all zero: a pool of nothing but a store that
    is down still places (and fails those writes) rather than refusing to open."""
    remote = [getattr(s.device.inner, "content_addressed", False) for s in st.slots]
    if st.cfg.remote_placement == "copy" and any(b > 0 for b, r in zip(bandwidths, remote) if not r):
        bandwidths = [0.0 if r else b for b, r in zip(bandwidths, remote)]
    return bandwidths if any(b > 0 for b in bandwidths) else [1.0] * len(bandwidths)
