"""A small cluster of hosts on this machine — network namespaces joined by veth pairs to one bridge, links shaped in
the kernel by ``tc`` — for the benchmarks and tests that must not trust kvflow's own throttle or loopback (harness
code: nothing in the product imports it). Needs root, ``ip``, ``tc`` and redis-server; ``netcluster_available()``
says why not.

    switch namespace <run>-sw: bridge br0 (10.A.B.1/24), one port per host
        ├── m0 m1 m2   Redis masters      10.A.B.11-13:6379   each in namespace <run>-<host>, its link eth0
        ├── r0 r1 r2   their replicas     10.A.B.21-23:6379   (r_i replicates m_i; cluster-node-timeout 1500 ms)
        └── ea eb      kvflow engine hosts 10.A.B.31-32
    a host's link: tbf on its eth0 (what it sends) and on its bridge port (what it receives) — rate, and with a
    kernel that has netem (CONFIG_NET_SCH_NETEM), delay and loss too; cut = the bridge port down.

    with NetCluster().start() as nc:             # or NetCluster() as a context manager; always torn down
        nc.url                                   # "redis://10.A.B.11:6379,..." — reachable from the engine hosts
        nc.shape("m0", rate=50e6)                # bytes/s (None: unshaped); delay=s, loss=fraction need netem
        nc.cut("m0"); nc.heal("m0")              # link down / back to its shape
        nc.slow("m0", 100)                       # rate / 100 (and delay x 100 with netem) until heal()
        nc.kill("m0"); nc.wait_failover("m0")    # SIGKILL its redis-server; until r0 serves its slots
        nc.restart("m0")                         # comes back empty, rejoins as a replica
        nc.call("ea", nc.python("-c", code))     # a Supervised child in host ea: its last JSON stdout line
        nc.spawn("eb", args, log_path=...)       # a Supervised child there (kvflow serve, ...)

Every run has a name unique to it (``kvc`` + 5 hex digits): its namespaces are ``<run>-*`` and its logs and state
are in ``<tmp>/kvflow-netcluster/<run>/``. ``stop()`` (also on an exception, Ctrl-C or SIGTERM inside the ``with``)
kills what runs in the run's namespaces and deletes them; ``down(run)`` does the same for a crashed run's
leftovers, ``down_stale()`` for every run whose owning process is gone — never another run's namespaces.
``python -m kvflow.bench.netcluster up|down RUN|down --stale|status`` for manual use.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.errors import KVFlowError
from kvflow.pool.redis_local import redis_available
from kvflow.supervisor import SOURCE_ROOT, Supervised, sigterm_as_interrupt

STATE = Path(tempfile.gettempdir()) / "kvflow-netcluster"
PORT = 6379


class ClusterError(KVFlowError):
    pass


def sh(*args: str, check: bool = True, timeout: float = 30) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(args)}: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


def netcluster_available() -> str | None:
    """None when this process can build a cluster (root, ip, tc, redis-server), else the reason (a skip line)."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, veth, tc)"
    missing = [b for b in ("ip", "tc") if shutil.which(b) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (iproute2)"
    return redis_available()


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay, loss); without it links are shaped by rate (tbf) only."""
    probe = f"kvcprobe{os.getpid()}"
    sh("ip", "netns", "add", probe)
    try:
        return subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                              capture_output=True).returncode == 0
    finally:
        sh("ip", "netns", "del", probe, check=False)


@dataclass(slots=True)
class Link:
    """A host link's shape: bytes/s (None: unshaped), one-way delay in seconds, loss fraction; cut: port down."""
    rate: float | None = None
    delay: float = 0.0
    loss: float = 0.0
    cut: bool = False


@dataclass(slots=True)
class Host:
    name: str          # m0, r0, ea ...
    ns: str            # <run>-<name>
    ip: str
    role: str          # "master" | "replica" | "engine" (the role it was created with)
    link: Link = field(default_factory=Link)
    shaped: Link = field(default_factory=Link)   # what shape() set: heal() returns to it


@dataclass
class NetCluster:
    masters: int = 3
    engines: tuple[str, ...] = ("ea", "eb")
    node_timeout_ms: int = 1500
    maxmemory: str | None = None
    run: str = ""
    subnet: str = ""                               # "10.A.B"
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: dict[str, Supervised] = field(default_factory=dict)
    dir: Path = Path()
    netem: bool = False
    owner: int | None = None                       # the pid whose exit makes the run stale (None: manual `up`)
    _heirs: dict[str, list[str]] = field(default_factory=dict)
    _home: int | None = None                       # fd of the namespace ``enter`` left

    # -- names ----------------------------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.run}-sw"

    @property
    def redis_hosts(self) -> list[str]:
        return [h for h, x in self.hosts.items() if x.role != "engine"]

    @property
    def url(self) -> str:
        """Seeds for a remote device: every Redis host (the client learns the slot map from any live one)."""
        return "redis://" + ",".join(f"{self.hosts[h].ip}:{PORT}" for h in self.redis_hosts)

    def ip(self, host: str) -> str:
        return self.hosts[host].ip

    # -- life -------------------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> NetCluster:
        if (why := netcluster_available()) is not None:
            raise ClusterError(why)
        rng = random.Random(os.getpid() ^ time.monotonic_ns())
        self.run = self.run or f"kvc{rng.getrandbits(20):05x}"
        self.subnet = self.subnet or f"10.{rng.randrange(200, 250)}.{rng.randrange(0, 256)}"
        self.owner = os.getpid()
        self.dir = STATE / self.run
        self.dir.mkdir(parents=True, exist_ok=True)
        names = ([(f"m{i}", "master", 11 + i) for i in range(self.masters)]
                 + [(f"r{i}", "replica", 21 + i) for i in range(self.masters)]
                 + [(e, "engine", 31 + i) for i, e in enumerate(self.engines)])
        self.hosts = {n: Host(n, f"{self.run}-{n}", f"{self.subnet}.{last}", role) for n, role, last in names}
        self._save()
        try:
            with sigterm_as_interrupt():
                self.netem = netem_available()
                self._wire()
                for h in self.redis_hosts:
                    self._spawn_redis(h)
                for h in self.redis_hosts:
                    self.procs[h].wait_ready(20)
                self._create(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wire(self) -> None:
        sw = self.switch
        sh("ip", "netns", "add", sw)
        sh("ip", "-n", sw, "link", "set", "lo", "up")
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "addr", "add", f"{self.subnet}.1/24", "dev", "br0")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for h in self.hosts.values():
            sh("ip", "netns", "add", h.ns)
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name", h.name, "netns", sw)
            sh("ip", "-n", sw, "link", "set", h.name, "master", "br0")
            sh("ip", "-n", sw, "link", "set", h.name, "up")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            sh("ip", "-n", h.ns, "link", "set", "eth0", "up")

    def _args(self, host: str) -> list[str]:
        h = self.hosts[host]
        args = ["ip", "netns", "exec", h.ns, "redis-server", "--port", str(PORT), "--bind", h.ip, "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / f"{host}.log"), "--protected-mode", "no",
                "--maxmemory-policy", "allkeys-lru", "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.dir / f"nodes-{host}.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no"]
        return args + (["--maxmemory", self.maxmemory] if self.maxmemory else [])

    def _spawn_redis(self, host: str) -> Supervised:
        self.procs[host] = Supervised(self._args(host), ready=lambda: self._ping(host), poll_s=0.05,
                                      name=f"redis-server on {host} (log: {self.dir}/{host}.log)").spawn()
        self._save()
        return self.procs[host]

    def cli(self, host: str, *args: str, timeout: float = 10) -> str:
        """``redis-cli`` against ``host``'s server, run from the switch namespace (it reaches every host)."""
        try:
            return sh("ip", "netns", "exec", self.switch, "redis-cli", "-h", self.ip(host), "-p", str(PORT), *args,
                      check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            return ""

    def _ping(self, host: str) -> bool:
        return self.cli(host, "ping", timeout=5).strip() == "PONG"

    def _create(self, timeout_s: float) -> None:
        """Masters then replicas to ``--cluster create --cluster-replicas 1``; then r_i is made m_i's replica (redis-cli
        pairs them as it likes) and we wait until the cluster is ok and every replica is in sync."""
        order = [f"m{i}" for i in range(self.masters)] + [f"r{i}" for i in range(self.masters)]
        out = sh("ip", "netns", "exec", self.switch, "redis-cli", "--cluster", "create",
                 *[f"{self.ip(h)}:{PORT}" for h in order], "--cluster-replicas", "1", "--cluster-yes", timeout=60)
        if "[OK] All 16384 slots covered" not in out:
            raise ClusterError(f"redis-cli --cluster create: {out[-400:]}")
        self.wait_ok(timeout_s)
        for i in range(self.masters):
            if self.master_of(f"r{i}") != f"m{i}":
                self.cli(f"r{i}", "cluster", "replicate", self.node_id(f"m{i}"))
        self.wait_ok(timeout_s, synced=True)

    def stop(self) -> None:
        """Kill every process of the run (ours, then anything else inside its namespaces), delete its namespaces
        (their veths go with them) and its folder. Harmless twice."""
        self.leave()
        for host in list(self.procs):
            self.procs.pop(host).kill()
        if self.run:
            down(self.run)

    def __enter__(self) -> NetCluster:
        return self if self.hosts and self.procs else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _save(self) -> None:
        state = {"run": self.run, "subnet": self.subnet, "owner": self.owner, "url": self.url if self.hosts else "",
                 "hosts": {h: {"ns": x.ns, "ip": x.ip, "role": x.role} for h, x in self.hosts.items()},
                 "pids": {h: p.pid for h, p in self.procs.items() if p.pid}}
        (self.dir / "state.json").write_text(json.dumps(state, indent=1))

    # -- the Redis cluster -----------------------------------------------------------------------------------------
    @property
    def live(self) -> list[str]:
        return [h for h in self.redis_hosts if h in self.procs and self.procs[h].alive]

    def node_id(self, host: str) -> str:
        return self.cli(host, "cluster", "myid").strip()

    def role(self, host: str) -> str:
        """"master" or "replica", as the node says now ("" when it does not answer)."""
        info = self.cli(host, "info", "replication")
        return "master" if "role:master" in info else "replica" if "role:slave" in info else ""

    def master_of(self, host: str) -> str | None:
        """The host whose replica ``host`` is now (None: it is a master or does not answer)."""
        info = dict(line.split(":", 1) for line in self.cli(host, "info", "replication").split() if ":" in line)
        if info.get("role") != "slave":
            return None
        return next((h for h, x in self.hosts.items() if x.ip == info.get("master_host")), None)

    def masters_now(self) -> list[str]:
        return [h for h in self.live if self.role(h) == "master"]

    def wait_ok(self, timeout_s: float = 30, synced: bool = False) -> None:
        """Until every live node says cluster_state:ok with all 16384 slots on live masters (and, ``synced``,
        every live replica's link to its master is up with no sync in progress)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [self.cli(h, "cluster", "info") for h in self.live]
            ok = all("cluster_state:ok" in s and "cluster_slots_ok:16384" in s for s in infos)
            if ok and synced:
                for h in self.live:
                    rep = self.cli(h, "info", "replication")
                    if "role:slave" in rep and not ("master_link_status:up" in rep
                                                    and "master_sync_in_progress:0" in rep):
                        ok = False
            if ok:
                return
            time.sleep(0.1)
        raise ClusterError(f"cluster not ok{' and in sync' if synced else ''} after {timeout_s:.0f} s "
                           f"(logs in {self.dir})")

    def replicas_of(self, master: str) -> list[str]:
        """Live hosts replicating ``master`` now."""
        return [h for h in self.live if self.master_of(h) == master]

    def wait_replicated(self, timeout_s: float = 60) -> None:
        """Until every live replica has applied its master's whole replication stream (offsets equal): what was
        written survives a master's death, and no replication traffic shares the masters' links any more."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lag = 0
            for m in self.masters_now():
                info = dict(l.split(":", 1) for l in self.cli(m, "info", "replication").split() if ":" in l)
                top = int(info.get("master_repl_offset", 0))
                offsets = [int(dict(kv.split("=") for kv in v.split(",")).get("offset", -1))
                           for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
                lag += sum(top - o for o in offsets) + (0 if offsets or not self.replicas_of(m) else 1)
            if lag == 0:
                return
            time.sleep(0.05)
        raise ClusterError(f"replicas did not catch up in {timeout_s:.0f} s")

    def kill(self, host: str) -> None:
        """SIGKILL ``host``'s redis-server (a crash); its replicas at that moment are remembered for
        ``wait_failover``."""
        self._heirs[host] = self.replicas_of(host)
        proc = self.procs.pop(host, None)
        if proc is not None:
            proc.kill()

    def wait_failover(self, host: str, timeout_s: float = 30) -> str:
        """After ``kill(host)`` of a master: until one of its replicas is master and the cluster is ok (every slot
        on a live master). Returns the host that took over."""
        deadline = time.monotonic() + timeout_s
        heirs = self._heirs.get(host, [])
        if not heirs:
            raise ClusterError(f"{host} had no live replica when it was killed: nothing can take over")
        while time.monotonic() < deadline:
            took = next((h for h in heirs if h in self.live and self.role(h) == "master"), None)
            if took is not None:
                self.wait_ok(max(1.0, deadline - time.monotonic()))
                return took
            time.sleep(0.1)
        raise ClusterError(f"no replica of {host} took over in {timeout_s:.0f} s (logs in {self.dir})")

    def restart(self, host: str, timeout_s: float = 30) -> None:
        """Start ``host``'s redis-server again: empty (nothing persisted), same node id (nodes.conf); a master that
        failed over rejoins as a replica. Returns when the cluster is ok and in sync."""
        self._spawn_redis(host).wait_ready(20)
        self.wait_ok(timeout_s, synced=True)

    def keys(self) -> int:
        """Keys over every live master."""
        return sum(int(self.cli(h, "dbsize").strip() or 0) for h in self.masters_now())

    def flush(self) -> None:
        for h in self.masters_now():
            self.cli(h, "flushall")

    # -- links ------------------------------------------------------------------------------------------------------
    def shape(self, host: str, rate: float | None = None, delay: float = 0.0, loss: float = 0.0) -> None:
        """Shape ``host``'s link both ways: ``rate`` bytes/s (None: unshaped), ``delay`` one-way seconds each way,
        ``loss`` fraction each way. Delay and loss need netem; this kernel's lack of it is one ClusterError."""
        self._apply(host, Link(rate, delay, loss))
        self.hosts[host].shaped = Link(rate, delay, loss)

    def cut(self, host: str) -> None:
        """The host's bridge port down: nothing reaches it or leaves it (connections hang, as on a pulled cable)."""
        sh("ip", "-n", self.switch, "link", "set", host, "down")
        self.hosts[host].link.cut = True

    def heal(self, host: str) -> None:
        """Back to what ``shape`` set last (port up, not slowed)."""
        if self.hosts[host].link.cut:
            sh("ip", "-n", self.switch, "link", "set", host, "up")
        s = self.hosts[host].shaped
        self._apply(host, Link(s.rate, s.delay, s.loss))

    def slow(self, host: str, factor: float) -> None:
        """``factor`` x slower until ``heal``: the rate divided by it (an unshaped link from 1 GB/s), and with netem
        the delay multiplied (from 1 ms)."""
        s = self.hosts[host].shaped
        delay = (s.delay or 1e-3) * factor if self.netem else 0.0
        self._apply(host, Link((s.rate or 1e9) / factor, delay, s.loss))

    def _apply(self, host: str, link: Link) -> None:
        if (link.delay or 0 < link.loss < 1) and not self.netem:
            raise ClusterError("link delay and partial loss need the netem qdisc, which this kernel lacks "
                               "(CONFIG_NET_SCH_NETEM); rate shaping (tbf) and cut() work")
        h = self.hosts[host]
        for ns, dev in ((h.ns, "eth0"), (self.switch, host)):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if self.netem and (link.delay or link.loss or link.rate):
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "limit", "100000",
                   *(["delay", f"{link.delay * 1e6:.0f}us"] if link.delay else []),
                   *(["loss", f"{link.loss * 100:g}%"] if link.loss else []),
                   *(["rate", f"{int(link.rate * 8)}bit"] if link.rate else []))
            elif link.rate:
                # a deep queue (0.5 s of the rate, at least 8 MiB): a drop would make TCP back off below the rate
                burst = max(int(link.rate * 0.004), 64 << 10)
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(link.rate * 8)}bit",
                   "burst", str(burst), "limit", str(max(int(link.rate * 0.5), 8 << 20)))
        h.link = Link(link.rate, link.delay, link.loss, h.link.cut)

    def tc_stats(self, host: str) -> dict:
        """Bytes sent / dropped by the qdiscs of ``host``'s link: {"out": (bytes, drops), "in": (...)}."""
        out = {}
        for side, ns, dev in (("out", self.hosts[host].ns, "eth0"), ("in", self.switch, host)):
            data = json.loads(sh("tc", "-s", "-j", "-n", ns, "qdisc", "show", "dev", dev) or "[]")
            out[side] = (sum(q.get("bytes", 0) for q in data), sum(q.get("drops", 0) for q in data))
        return out

    # -- processes on the hosts -----------------------------------------------------------------------------------
    def python(self, *args: str) -> list[str]:
        """A Python command line of this interpreter (``-c CODE`` / ``-m MODULE`` ...) for ``spawn`` / ``call``."""
        return [sys.executable, *args]

    def env(self, **extra: str) -> dict:
        """This process's environment with kvflow's source tree first on PYTHONPATH."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SOURCE_ROOT / "src"), str(SOURCE_ROOT),
                                                        env.get("PYTHONPATH", "")) if p)
        return {**env, **extra}

    def spawn(self, host: str, args: list[str], *, log_path: Path | None = None, env: dict | None = None,
              ready=None, name: str | None = None) -> Supervised:
        """``args`` as a Supervised child inside ``host``'s namespace (not waited for)."""
        return Supervised(["ip", "netns", "exec", self.hosts[host].ns, *args], log_path=log_path,
                          env=env or self.env(), ready=ready, name=name or f"{args[0]} on {host}",
                          cwd=SOURCE_ROOT).spawn()

    def call(self, host: str, args: list[str], timeout_s: float = 600, env: dict | None = None) -> dict:
        """Run ``args`` in ``host`` to its end; its last stdout line that is a JSON object (stderr goes to the log)."""
        log = self.dir / f"call-{host}-{time.monotonic_ns()}.log"
        err = log.with_suffix(".err")
        with open(err, "wb") as stderr:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].ns, *args], stdout=subprocess.PIPE,
                                    stderr=stderr, stdin=subprocess.DEVNULL, env=env or self.env(),
                                    cwd=SOURCE_ROOT, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        text = out.decode(errors="replace")
        log.write_text(text)
        if proc.returncode != 0:
            tail = err.read_text(errors="replace").strip().splitlines()[-3:]
            raise ClusterError(f"{args[0]} on {host} exited with {proc.returncode}: {' | '.join(tail)}")
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise ClusterError(f"{args[0]} on {host} printed no JSON line (log: {log})")

    def enter(self, host: str) -> None:
        """Move this process's calling thread (call it on the main thread before any thread that will use the network
        starts: threads inherit it) into ``host``'s network namespace, for a benchmark that must itself be an engine
        host. The harness's own commands name their namespaces, so they work from anywhere."""
        import ctypes

        if self._home is None:
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        _setns(f"/var/run/netns/{self.hosts[host].ns}")

    def leave(self) -> None:
        """Back to the namespace ``enter`` left (threads started meanwhile stay where they were started)."""
        if self._home is not None:
            _setns(f"/proc/self/fd/{self._home}")
            os.close(self._home)
            self._home = None

    def leftovers(self) -> dict:
        """What of this run still exists: namespaces, processes in them, its folder (all empty after stop)."""
        return leftovers(self.run)


def _setns(path: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:             # CLONE_NEWNET
            raise ClusterError(f"setns {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


# -- runs, leftovers, clean-up ----------------------------------------------------------------------------------------
def namespaces(run: str) -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines()
            if line.startswith(f"{run}-")]


def leftovers(run: str) -> dict:
    ns = namespaces(run)
    pids = [p for n in ns for p in sh("ip", "netns", "pids", n, check=False).split()
            if int(p) != os.getpid()]                       # a benchmark that entered a host of the run
    state = STATE / run / "state.json"
    if state.exists():
        for pid in json.loads(state.read_text()).get("pids", {}).values():
            try:
                os.kill(pid, 0)
                pids.append(str(pid))
            except ProcessLookupError:
                pass
    return {"namespaces": ns, "pids": sorted(set(pids)), "dir": (STATE / run).exists()}


def down(run: str) -> None:
    """Remove every trace of ``run`` (``kvc`` + 5 hex): processes recorded in its state or living in its namespaces
    (SIGKILL), its namespaces, its folder. Only names of that run are touched."""
    if not (run.startswith("kvc") and len(run) == 8 and all(c in "0123456789abcdef" for c in run[3:])):
        raise ClusterError(f"{run!r} is not a run name (kvc + 5 hex digits)")
    for _ in range(3):
        left = leftovers(run)
        for pid in left["pids"]:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in left["namespaces"]:
            sh("ip", "netns", "del", ns, check=False)
        if not left["pids"] and not left["namespaces"]:
            break
        time.sleep(0.2)
    shutil.rmtree(STATE / run, ignore_errors=True)


def runs() -> list[dict]:
    """Every run with state or namespaces on this machine: name, owner pid, whether the owner is alive."""
    names = {p.name for p in STATE.glob("kvc*")} | {n.split("-")[0] for n in sh("ip", "netns", "list",
                                                                                   check=False).split()
                                                     if n.startswith("kvc") and "-" in n}
    out = []
    for run in sorted(names):
        state = STATE / run / "state.json"
        info = json.loads(state.read_text()) if state.exists() else {"run": run, "owner": None}
        owner = info.get("owner")
        alive = owner is not None and Path(f"/proc/{owner}").exists()
        out.append({**info, "owner_alive": alive, **leftovers(run)})
    return out


def down_stale() -> list[str]:
    """``down`` every run whose owning process has exited (a crashed test or bench); manual runs (no owner) stay."""
    gone = [r["run"] for r in runs() if r.get("owner") is not None and not r["owner_alive"]]
    for run in gone:
        down(run)
    return gone


def main(argv: list[str] | None = None) -> int:
    """``up`` (prints the state JSON; the cluster stays until ``down RUN``), ``down RUN``, ``down --stale``,
    ``status``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("up", "down", "status"):
        print("usage: python -m kvflow.bench.netcluster up | down RUN | down --stale | status", file=sys.stderr)
        return 2
    try:
        if argv[0] == "up":
            nc = NetCluster().start()
            nc.owner = None
            nc._save()
            print((nc.dir / "state.json").read_text())
        elif argv[0] == "down":
            if len(argv) != 2:
                print("down: give a run name (kvc + 5 hex) or --stale", file=sys.stderr)
                return 2
            print(json.dumps(down_stale() if argv[1] == "--stale" else (down(argv[1]) or [argv[1]])))
        else:
            print(json.dumps(runs(), indent=1))
    except KVFlowError as err:
        print(str(err), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
