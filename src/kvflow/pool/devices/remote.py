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

``RemoteStore`` is a keyed store (``keyed.py``): batched, per-node pipelined GET / EXISTS / SET by name, nodes in
parallel. The pool asks it for what its own index does not know through ``kvflow.pool.keyed``, and places records
on it through its striped view (``KeyedDevice``, what ``RemoteStore.open`` returns).

Eviction is the store's (``maxmemory-policy allkeys-lru``): a record it evicted, or lost with a node restarted
empty, is a miss and the restorer recomputes it. A node that fails makes its records misses.

A node that hangs (a cut link, a frozen process) costs one wait, not one per round: the first request to it that
times out (``timeout_s``) makes it *suspect*; from then on no request is sent to it — its records are misses at
once, in the rounds of the same restore and of every later one — while a background thread asks it again every
``SUSPECT_REPROBE_S`` (a PING; on a cluster first a refresh of the slot map, which finds a replica that took over).
When it answers it is in service again. No request ever waits on the cluster client's own retries or map refresh:
rounds go straight to the node clients, and ``ping`` PINGs one node that is not suspect. The store unreachable
at start is one ConfigError (``required: false``: the pool starts without it, a warning, until the pool's re-probe
finds it answering). Credentials come from the device config, ``pool.remote_username`` / ``remote_password`` /
``remote_password_file`` (``KVFLOW_POOL_REMOTE_PASSWORD[_FILE]``) or the URL, and are never logged; a wrong one, or
a TLS handshake that fails, is one ConfigError too.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from concurrent.futures import Executor, Future
from urllib.parse import unquote, urlsplit

from kvflow.config import check
from kvflow.errors import ConfigError
from kvflow.pool.devices.keyed import Answer, KeyedDevice

log = logging.getLogger("kvflow.pool")

BATCH = 32                   # keys per pipelined request: several requests per node run side by side
SUSPECT_REPROBE_S = 1.0      # a suspect node is asked again this often, in the background (never by a request)
TLS_KEYS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_cert_reqs",
            "ssl_check_hostname", "ssl_ciphers", "ssl_min_version")


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


def _is_tls(err: BaseException) -> bool:
    import ssl

    return isinstance(err, ssl.SSLError) or "SSL" in str(err)


def _tls_reason(err: BaseException) -> str:
    text = str(err)
    return text[text.find("[SSL"):][:160] if "[SSL" in text else text[:160]


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


class _Skipped(Exception):
    """A request not sent: its node is suspect (its keys are misses)."""


class RemoteStore:
    """A Redis / Valkey store (a cluster or one server) as a ``KeyedStore``: ``name`` is stored under
    ``key_prefix + name``; every batched call is one pipelined round, its per-node requests side by side."""
    needs_path = False
    needs_capacity = False

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

    @classmethod
    def open(cls, cfg, readonly: bool = False) -> KeyedDevice:
        """The store behind the device view the striper places on (``KeyedDevice.store`` is the store)."""
        return KeyedDevice(cls(cfg), f"scratch:{uuid.uuid4().hex}:".encode(), readonly)

    def __init__(self, cfg):
        self.cfg = cfg
        self.name = cfg.name
        self.tls, self.seeds, user, password = _parse_url(cfg.url)
        self._auth = {"username": cfg.username or user, "password": cfg.password or password}
        self._prefix = cfg.key_prefix.encode()
        self._probe_key = self._prefix + f"scratch:{uuid.uuid4().hex}".encode()
        self._lock = threading.Lock()
        self._client = None
        self.rounds = 0
        self.timed_out_rounds = 0                # rounds (and pings) in which a request waited out timeout_s
        self.skipped = 0                         # requests not sent: their node was suspect
        self._suspect: dict[str, float] = {}     # node name -> when it last failed to answer within timeout_s
        self._refresh = False                    # a MOVED reply: the slot map is refreshed in the background
        self._prober: threading.Thread | None = None
        self._node_clients: dict[str, object] = {}   # every node client a round used: closed at close (a map
        #                                              refresh drops a failed node's client with its idle connections)
        self._closed = threading.Event()
        self.reachable = True
        self.unreachable = ""
        try:
            self.client()
        except OSError as err:                   # unreachable at start: the pool starts without it, re-probes later
            if cfg.required:
                raise ConfigError(f"{err.strerror}: the store does not answer at start (check the address, and "
                                  f"rediss:// for a TLS port; required: false starts without it)") from None
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
        # one retry for a stale pooled connection (a node restarted); none after a timeout: a node that hangs costs
        # a request one timeout_s per round, not two
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        opts = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s, retry=retry,
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
            if _is_tls(err) or (cause is not None and _is_tls(cause)):
                raise ConfigError(f"{self.name}: the TLS handshake failed ({_tls_reason(err)}); check the device's "
                                  f"tls (ssl_ca_certs) and that the URL names the store's TLS ports") from None
            if _is_auth(err) or (cause is not None and _is_auth(cause)):
                user = self._auth["username"]
                raise ConfigError(f"{self.name}: the store refused the credentials"
                                  f"{f' of ACL user {user!r}' if user else ''} (wrong password or user); set the "
                                  f"device's password/username, or KVFLOW_POOL_REMOTE_PASSWORD[_FILE]") from None
            raise _os_error(err, self.name) from None

    def _call(self, fn, *args, **kw):
        import redis

        try:
            return fn(self.client(), *args, **kw)
        except (redis.RedisError, redis.exceptions.RedisClusterException) as err:
            raise _os_error(err, self.name) from None

    # -- the keyed-store interface --------------------------------------------------------------------------
    def key(self, name: bytes) -> bytes:
        """The store key of ``name``: ``key_prefix + name``."""
        return self._prefix + name

    def get(self, names: list[bytes], io: Executor | None = None) -> Answer:
        answer = self._round("get", names, None, io)
        answer.values = [v if isinstance(v, bytes) else None for v in answer.values]
        return answer

    def contains(self, names: list[bytes], io: Executor | None = None) -> Answer:
        answer = self._round("exists", names, None, io)
        answer.values = [v is not None and not isinstance(v, Exception) and v > 0 for v in answer.values]
        return answer

    def put(self, names: list[bytes], records: list, io: Executor | None = None) -> Answer:
        answer = self._round("set", names, records, io)
        answer.values = [v is True for v in answer.values]
        return answer

    def delete(self, names: list[bytes]) -> None:
        keys = [self.key(n) for n in names]
        self._call(lambda c: [c.unlink(k) for k in keys])

    def ping(self) -> None:
        """The store answers: one PING to a node that is not suspect (straight to it: no cluster retry or map
        refresh); ETIMEDOUT at once when every node is suspect (the background re-probe brings them back)."""
        import redis

        try:
            client = self.client()
            nodes = ([(n.name, client.get_redis_connection(n)) for n in client.get_primaries()] if self.cfg.cluster
                     else [(self._node_name, client)])
        except (redis.RedisError, redis.exceptions.RedisClusterException) as err:
            raise _os_error(err, self.name) from None
        live = [(name, conn) for name, conn in nodes if name not in self._suspect]
        if not live:
            raise OSError(errno.ETIMEDOUT, f"{self.name}: every node is suspect (asked again in the background)")
        name, conn = live[0]
        try:
            conn.ping()
        except redis.RedisError as err:
            if isinstance(err, (redis.TimeoutError, redis.ConnectionError)):
                if isinstance(err, redis.TimeoutError):
                    self._count_wait()
                self._suspect_node(name)
            raise _os_error(err, self.name) from None

    @property
    def suspect(self) -> list[str]:
        """Nodes that did not answer within timeout_s and have not answered since."""
        return sorted(self._suspect)

    def close(self) -> None:
        self._closed.set()
        prober = self._prober
        if prober is not None:     # a probe in flight ends within its socket timeouts (a map refresh: one per node)
            nodes = len(self._client.get_nodes()) if self.cfg.cluster and self._client is not None else 1
            prober.join(self.cfg.timeout_s * (2 * nodes + 4))
        for client in [self._client, *self._node_clients.values()]:
            if client is not None:
                try:
                    client.close()
                except Exception:   # closing a half-dead connection pool must not fail the pool's close
                    pass

    def describe(self) -> dict:
        return {"cluster": self.cfg.cluster, "tls": bool(self.tls or self.cfg.tls), "reachable": self.reachable,
                "suspect_nodes": len(self._suspect), "timed_out_rounds": self.timed_out_rounds,
                "skipped_requests": self.skipped}

    # -- suspect nodes --------------------------------------------------------------------------------------
    @property
    def _node_name(self) -> str:
        """The one server's node name (a cluster's nodes are named by the client)."""
        return f"{self.seeds[0][0]}:{self.seeds[0][1]}"

    def _count_wait(self) -> None:
        with self._lock:
            self.timed_out_rounds += 1

    def _suspect_node(self, name: str) -> None:
        with self._lock:
            new = name not in self._suspect
            self._suspect[name] = time.monotonic()
            self._start_prober()
        if new:
            log.warning("pool: %s: node %s does not answer (timeout_s %.3g s); its records are misses until it "
                        "answers again (asked every %.3g s in the background)", self.name, name, self.cfg.timeout_s,
                        SUSPECT_REPROBE_S)

    def _start_prober(self) -> None:
        """Lock held. The background re-probe, unless it runs (it ends once nothing is suspect)."""
        if self._prober is None and not self._closed.is_set():
            self._prober = threading.Thread(target=self._reprobe, name="kvflow-reprobe", daemon=True)
            self._prober.start()

    def _reprobe(self) -> None:
        import redis

        while not self._closed.wait(SUSPECT_REPROBE_S):
            with self._lock:
                names, refresh, self._refresh = list(self._suspect), self._refresh, False
                if not names and not refresh:
                    self._prober = None
                    return
            client = self._client
            if client is None:
                continue
            if self.cfg.cluster:             # the slot map: a replica may have taken over a suspect node's slots
                try:
                    client.nodes_manager.initialize(last_failed_node_name=names[0] if names else None)
                except (redis.RedisError, redis.exceptions.RedisClusterException):
                    pass
            for name in names:
                if self._closed.is_set():     # close() waits for this thread, then closes every connection
                    return
                try:
                    if self.cfg.cluster:
                        node = client.get_node(node_name=name)
                        if node is not None:   # None: it left the map (its slots went to a replica)
                            client.get_redis_connection(node).ping()
                    else:
                        client.ping()
                except (redis.RedisError, redis.exceptions.RedisClusterException):
                    continue
                with self._lock:
                    self._suspect.pop(name, None)
                log.warning("pool: %s: node %s answers again; back in service", self.name, name)

    # -- batched, pipelined access --------------------------------------------------------------------------
    def _round(self, op: str, names: list[bytes], values: list | None, io: Executor | None) -> Answer:
        """One pipelined round: every node's requests in parallel on ``io`` (inline without one). A value per
        name: the command's reply, None where its node failed or is suspect (an exception object where the
        command failed). A suspect node's requests are not sent; they count as failed only when every node of the
        store is suspect (the store itself hangs)."""
        import redis

        keys = [self.key(n) for n in names]
        try:
            plan = self._batches(keys)
        except OSError as err:
            return Answer([None] * len(keys), 1, 1, err)
        self.rounds += 1
        run = io.submit if io is not None else _now
        futures: list[tuple[list[int], Future]] = [
            (idx, run(self._send, node, conn, op, [keys[j] for j in idx],
                      None if values is None else [values[j] for j in idx], self.cfg.ttl_s))
            for node, conn, idx in plan]
        out: list = [None] * len(keys)
        failed, skipped, waited, first = 0, 0, False, None
        for idx, fut in futures:
            try:
                for j, r in zip(idx, fut.result()):
                    out[j] = r
            except _Skipped:
                skipped += 1
            except Exception as err:   # a node down or timing out: its keys are misses, the other nodes still serve
                failed, first = failed + 1, first or err
                waited = waited or isinstance(err, redis.TimeoutError)
        if waited:
            self._count_wait()
        if any(isinstance(r, (redis.exceptions.MovedError, redis.exceptions.AskError)) for r in out):
            with self._lock:               # the slot map is stale (a failover): refreshed in the background
                self._refresh = True
                self._start_prober()
        first = first or next((r for r in out if isinstance(r, Exception)), None)   # else a command's own error
        error = None if first is None else _os_error(first, self.name)
        if skipped:
            with self._lock:
                self.skipped += skipped
            hung = self._all_suspect()        # the store itself hangs: a failed round; else one node: misses
            error = error or OSError(errno.ETIMEDOUT if hung else errno.EHOSTDOWN,
                                     f"{self.name}: {skipped} requests to suspect nodes not sent")
            if hung:
                failed += skipped
        return Answer(out, len(futures), failed, error)

    def _send(self, node: str, conn, op: str, keys: list[bytes], values: list | None, ttl: int) -> list:
        """One request, unless its node is suspect (checked when it starts: a request queued behind the one that
        timed out is not sent). A timeout, or a connection refused after the one retry, makes the node suspect (a
        killed master: the background map refresh then finds the replica that took over its slots)."""
        import redis

        if node in self._suspect:
            raise _Skipped(node)
        try:
            return self._pipelined(conn, op, keys, values, ttl)
        except (redis.TimeoutError, redis.ConnectionError):   # hangs, or refuses even a fresh connection: down
            self._suspect_node(node)
            raise

    def _all_suspect(self) -> bool:
        if not self.cfg.cluster:
            return bool(self._suspect)
        try:
            return all(n.name in self._suspect for n in self.client().get_primaries())
        except Exception:      # no client / no map: nothing answers
            return True

    def _batches(self, keys: list[bytes]) -> list[tuple[str, object, list[int]]]:
        """(node name, node client, indices into ``keys``) per pipelined request: keys grouped by the node serving
        their hash slot (one server: one group), at most BATCH keys a request."""
        import redis

        try:
            client = self.client()
            groups: dict[object, list[int]] = {}
            if self.cfg.cluster:
                for i, key in enumerate(keys):
                    node = client.get_node_from_key(key)
                    groups.setdefault(node.name, []).append(i)
                nodes = {n.name: n for n in client.get_nodes()}
                pairs = [(name, client.get_redis_connection(nodes[name]), idx) for name, idx in groups.items()]
                self._node_clients.update((name, conn) for name, conn, _ in pairs)
            else:
                pairs = [(self._node_name, client, list(range(len(keys))))]
        except (redis.RedisError, redis.exceptions.RedisClusterException) as err:
            raise _os_error(err, self.name) from None
        return [(name, conn, idx[j:j + BATCH]) for name, conn, idx in pairs for j in range(0, len(idx), BATCH)]

    @staticmethod
    def _pipelined(conn, op: str, keys: list[bytes], values: list | None = None, ttl: int = 0) -> list:
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


def _now(fn, *args) -> Future:
    """``fn(*args)`` on the calling thread, as a finished Future."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args))
    except Exception as err:
        fut.set_exception(err)
    return fut
