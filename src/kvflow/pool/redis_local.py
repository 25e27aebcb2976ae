"""Local Redis servers for the remote tier (``kvflow bench shared``, the remote-tier tests): a cluster of masters, or
one server, on free loopback ports in a temporary directory — each server a Supervised process (its own group,
kvflow/supervisor.py), always killed and the directory removed.

    with RedisProcs(masters=3) as rp:          # cluster mode; RedisProcs(masters=1, cluster=False): one server
        rp.url                                 # "redis://127.0.0.1:P1,127.0.0.1:P2,..." for a remote device
        rp.kill(1); rp.restart(1)              # a node dies; comes back empty (no persistence) with its slots
    RedisProcs(user="kvflow", password="pw")   # an ACL user limited to keys under user_prefix (admin: another pw)
    RedisProcs(tls=True)                       # a TLS port per node (url: rediss://, rp.ca), a throwaway CA in dir
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from kvflow.errors import KVFlowError
from kvflow.supervisor import Supervised


def redis_available() -> str | None:
    """None when redis-server and redis-cli are on PATH, else why not (the reason a test is skipped)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return None if not missing else (f"{' and '.join(missing)} not installed (the Makefile installs Debian's "
                                     f"redis-server: apt-get install -y redis-server)")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, bus: bool) -> list[int]:
    """``n`` loopback ports that are free now (and, for cluster nodes, their bus port + 10000 too)."""
    out: list[int] = []
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while len(out) < n:
        p = rng.randrange(20000, 45000)
        if p not in out and _free(p) and (not bus or _free(p + 10000)):
            out.append(p)
    return out


@dataclass
class RedisProcs:
    masters: int = 3
    cluster: bool = True
    password: str | None = None
    maxmemory: str | None = None            # e.g. "64mb": the store evicts (allkeys-lru) beyond it
    user: str | None = None                 # an ACL user with ``password``, its keys limited to user_prefix
    user_prefix: str = "kvflow:"
    tls: bool = False                       # each node also serves TLS (tls-cluster yes) on tls_ports[i]
    tls_ports: list[int] = field(default_factory=list)
    admin_password: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False)   # the default user's, with user
    ports: list[int] = field(default_factory=list)
    procs: dict[int, Supervised] = field(default_factory=dict)
    dir: str = ""

    @property
    def url(self) -> str:
        if self.tls:
            return "rediss://" + ",".join(f"127.0.0.1:{p}" for p in self.tls_ports)
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @property
    def ca(self) -> str:
        """The throwaway CA that signed the servers' certificate (tls=True): a client's ssl_ca_certs."""
        return os.path.join(self.dir, "ca.pem")

    @property
    def _admin(self) -> str | None:
        """The default user's password: ``password`` itself, or one of its own beside an ACL user."""
        return self.admin_password if self.user else self.password

    def start(self) -> RedisProcs:
        if (why := redis_available()) is not None:
            raise RuntimeError(why)
        self.dir = tempfile.mkdtemp(prefix="kvflow-redis-")
        try:
            if self.tls:
                make_certs(self.dir)
            for attempt in range(3):    # a port taken between the check and the bind: pick others
                self.ports = free_ports(self.masters, self.cluster)
                self.tls_ports = free_ports(self.masters, False) if self.tls else []
                for i in range(self.masters):
                    self._spawn(i)
                try:
                    for p in self.ports:
                        self.procs[p].wait_ready(20)
                    break
                except KVFlowError:
                    self._kill_all()
            else:
                raise RuntimeError(f"redis-server did not start; logs in {self.dir}")
            if self.cluster:
                self._create_cluster()
        except BaseException:
            self.stop()
            raise
        return self

    def _args(self, port: int) -> list[str]:
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--dir", self.dir, "--logfile", os.path.join(self.dir, f"{port}.log"),
                "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self._admin:
            args += ["--requirepass", self._admin, "--masterauth", self._admin]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(self.dir, f"nodes-{port}.conf"),
                     "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]
        if self.tls:
            d = self.dir
            args += ["--tls-port", str(self.tls_ports[self.ports.index(port)]), "--tls-cert-file", f"{d}/server.pem",
                     "--tls-key-file", f"{d}/server.key", "--tls-ca-cert-file", f"{d}/ca.pem",
                     "--tls-auth-clients", "no", "--tls-replication", "yes"]
            if self.cluster:    # the bus speaks TLS; it stays on port + 10000; admin commands use the plain port
                args += ["--tls-cluster", "yes", "--cluster-port", str(port + 10000)]
        return args

    def _spawn(self, i: int) -> Supervised:
        port = self.ports[i]
        self.procs[port] = Supervised(self._args(port), ready=lambda: self._ping(port) and self._acl(port),
                                      poll_s=0.05,
                                      name=f"redis-server on port {port} (log: {self.dir}/{port}.log)").spawn()
        return self.procs[port]

    def _ping(self, port: int) -> bool:
        try:
            return self._cli("ping", port=port, timeout=5).stdout.strip() == "PONG"
        except subprocess.TimeoutExpired:
            return False

    def _acl(self, port: int) -> bool:
        """The ACL user on node ``port`` (ACLs are per node and not persisted: set again on every start)."""
        if not self.user:
            return True
        rules = ["reset", "on", f">{self.password}", f"~{self.user_prefix}*", "+@all", "-@dangerous",
                 "+cluster|slots", "+cluster|shards", "+cluster|nodes", "+info"]
        return self._cli("acl", "setuser", self.user, *rules, port=port, timeout=5).stdout.strip() == "OK"

    def _cli(self, *args: str, port: int | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        cmd = ["redis-cli", "-h", "127.0.0.1"] + (["-p", str(port)] if port else [])
        if self._admin:
            cmd += ["-a", self._admin, "--no-auth-warning"]
        return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)

    def _create_cluster(self) -> None:
        done = self._cli("--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports], "--cluster-replicas", "0",
                         "--cluster-yes", timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-500:]} {done.stderr[-500:]}")
        self.wait_ok()

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says cluster_state:ok and knows every other live node."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self._cli("cluster", "info", port=p, timeout=5).stdout for p in self.live]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the redis cluster did not reach cluster_state:ok in {timeout:.0f} s ({self.dir})")

    @property
    def live(self) -> list[int]:
        return [p for p in self.ports if self.procs.get(p) is not None and self.procs[p].alive]

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its process group)."""
        proc = self.procs.pop(self.ports[i], None)
        if proc is not None:
            proc.kill()

    def restart(self, i: int) -> None:
        """Start node ``i`` again on its port: empty (nothing is persisted), same node id and slots (nodes.conf)."""
        self._spawn(i).wait_ready(20)
        if self.cluster:
            self.wait_ok()

    def keys(self) -> int:
        """Keys stored over every live node."""
        return sum(int(self._cli("dbsize", port=p).stdout.strip() or 0) for p in self.live)

    def _kill_all(self) -> None:
        for port in list(self.procs):
            self.procs.pop(port).kill()

    def stop(self) -> None:
        self._kill_all()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisProcs:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()



def make_certs(folder: str) -> None:
    """A throwaway CA (ca.pem) and a server certificate it signed (server.pem, server.key) for 127.0.0.1 and
    localhost, in ``folder``: TLS for local test stores only."""
    def ssl(*args: str) -> None:
        done = subprocess.run(["openssl", *args], cwd=folder, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {done.stderr[-300:]}")
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvflow test CA",
        "-keyout", "ca.key", "-out", "ca.pem")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    with open(os.path.join(folder, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.pem")
