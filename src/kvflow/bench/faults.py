"""`kvflow bench faults`: two engines sharing a Redis cluster serve a multi-round chat while the cluster fails, one
fault at a time (issue 34, item 4).

    phase            what happens to the cluster after the first round (undone before the last round)
    none             nothing: the reference run
    kill-master      node i is SIGKILLed (a replica takes over where the cluster has one; on loopback the node
                     is restarted empty before the last round)
    cut-link         node i's link stalls completely (every byte held, as under tc loss 100%), then comes back
    slow-node        node i's replies each wait --slow-ms more (netem delay: ~100x a loopback round trip)

Round r of conversation c goes to engine (c + r) % 2, so every round after the first restores, through the cluster,
what the other engine stored. For every request: it must succeed (a record missing or unreachable is recomputed),
its greedy tokens must equal a fresh full prefill's (a third engine with no pool), and its TTFT is recorded. Each
phase builds both engines and their pools and closes them again: the threads and client connections of this
process before and after must be equal (no leak). The remote device's ``timeout_s`` bounds what a hanging node can
cost a request: P99 TTFT under each fault is reported next to the fault-free run's.

The cluster is anything with the ``FaultTarget`` methods. Here: ``LoopbackCluster`` — RedisProcs masters on
loopback, each announced (``cluster-announce-port``) behind a ``FaultProxy`` that can stall or delay its replies.
A namespace cluster with kernel-shaped links implements the same five calls with ``tc``.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from kvflow.pool.devices.throttle import TokenBucket
from kvflow.report import BenchRun, save_figure
from kvflow.stats import percentile

FAULTS = ("none", "kill-master", "cut-link", "slow-node")
Progress = Callable[[str], None]
PROXY = "faultproxy"          # thread-name prefix of the proxies: not counted as the engines' threads


class FaultTarget(Protocol):
    url: str
    ports: list[int]                     # the ports clients connect to (connections counted against them)

    def kill(self, node: int) -> None: ...
    def restore(self, node: int) -> None: ...      # undo kill (a replica took over, or restart empty)
    def cut(self, node: int) -> None: ...
    def heal(self, node: int) -> None: ...
    def slow(self, node: int, delay_s: float | None) -> None: ...   # None: back to full speed
    def settle(self) -> None: ...                  # until every slot is served and replicas are in sync


class FaultProxy:
    """A TCP relay in front of one node: passes bytes both ways; ``stalled`` holds every byte until cleared (a link
    with 100% loss, whose TCP retransmits on heal); ``delay_s`` delays every reply segment; ``rate`` (bytes/s, None:
    unlimited) passes replies through a token bucket — a slow link or store, changed live."""

    def __init__(self, target_port: int, rate: float | None = None):
        self.target = ("127.0.0.1", target_port)
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self.delay_s = 0.0
        self.rate = rate
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name=f"{PROXY}-accept", daemon=True).start()

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    @stalled.setter
    def stalled(self, value: bool) -> None:
        (self._flowing.clear if value else self._flowing.set)()

    @property
    def rate(self) -> float | None:
        return self._bucket.rate if self._bucket else None

    @rate.setter
    def rate(self, value: float | None) -> None:
        self._bucket = TokenBucket(value) if value else None

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), name=f"{PROXY}-conn", daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        self._flowing.wait()                  # a SYN into a dead link: the client's connect timeout decides
        try:
            server = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        self._socks += [client, server]
        threading.Thread(target=self._pump, args=(server, client, True), name=f"{PROXY}-pump", daemon=True).start()
        self._pump(client, server, False)

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                self._flowing.wait()
                if reply and self.delay_s:
                    time.sleep(self.delay_s)
                if reply and (bucket := self._bucket) is not None:
                    time.sleep(max(0.0, bucket.reserve(len(data)) - bucket.clock()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self._listen.close()
        for s in self._socks:
            s.close()


@dataclass
class LoopbackCluster:
    """RedisProcs masters, each announced behind its FaultProxy (clients only ever reach a node through it)."""
    masters: int = 3
    procs: object = None
    proxies: list[FaultProxy] = field(default_factory=list)

    def start(self) -> LoopbackCluster:
        from kvflow.pool.redis_local import RedisProcs
        self.procs = RedisProcs(masters=self.masters, cluster=True).start()
        self.proxies = [FaultProxy(p) for p in self.procs.ports]
        for i in range(self.masters):
            self._announce(i)
        self._wait_announced()
        return self

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p.port}" for p in self.proxies)

    @property
    def ports(self) -> list[int]:
        return [p.port for p in self.proxies]

    def _announce(self, i: int) -> None:
        self.procs._cli("config", "set", "cluster-announce-port", str(self.proxies[i].port), port=self.procs.ports[i])

    def _wait_announced(self, timeout: float = 30) -> None:
        deadline, want = time.monotonic() + timeout, {str(p) for p in self.ports}
        while time.monotonic() < deadline:
            seen = [set(self.procs._cli("cluster", "slots", port=p).stdout.split()) for p in self.procs.live]
            if all(want <= s for s in seen):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster nodes did not announce their proxies' ports")

    def kill(self, node: int) -> None:
        self.procs.kill(node)

    def restore(self, node: int) -> None:
        self.procs.restart(node)              # empty, same slots (no replica on loopback)
        self._announce(node)
        self._wait_announced()

    def cut(self, node: int) -> None:
        self.proxies[node].stalled = True

    def heal(self, node: int) -> None:
        self.proxies[node].stalled = False

    def slow(self, node: int, delay_s: float | None) -> None:
        self.proxies[node].delay_s = delay_s or 0.0

    def settle(self) -> None:
        self.procs.wait_ok()

    def stop(self) -> None:
        for p in self.proxies:
            p.close()
        if self.procs is not None:
            self.procs.stop()


@dataclass
class NetTarget:
    """The namespace cluster (``bench/netcluster.py``: 3 masters + a replica each on hosts of their own, links shaped
    by tc); this process runs its engines on host ``ea``. Node i is whichever host serves master m_i's slots now."""
    nc: object = None
    killed: dict[int, str] = field(default_factory=dict)
    cut_host: str = ""
    slow_host: str = ""

    def start(self) -> NetTarget:
        from kvflow.bench.netcluster import NetCluster
        self.nc = NetCluster().start()
        try:
            self.nc.enter("ea")               # before any pool thread starts: they inherit the namespace
        except BaseException:
            self.nc.stop()
            raise
        return self

    @property
    def url(self) -> str:
        return self.nc.url

    @property
    def ports(self) -> list[int]:
        return [6379]

    def master(self, node: int) -> str:
        """The host serving m_<node>'s slots now (m_<node>, or the replica that took over from it)."""
        host = f"m{node}"
        return host if self.nc.role(host) == "master" else self.nc.master_of(host)

    def kill(self, node: int) -> None:
        self.nc.wait_replicated()             # what was stored survives on the replica that takes over
        host = self.master(node)
        self.nc.kill(host)
        self.nc.wait_failover(host)
        self.killed[node] = host

    def restore(self, node: int) -> None:
        self.nc.restart(self.killed.pop(node))      # rejoins as the new master's replica

    def cut(self, node: int) -> None:
        self.cut_host = self.master(node)     # cut longer than cluster-node-timeout: its replica takes over
        self.nc.cut(self.cut_host)

    def heal(self, node: int) -> None:
        self.nc.heal(self.cut_host)

    def slow(self, node: int, delay_s: float | None) -> None:
        if delay_s:
            self.slow_host = self.master(node)
            self.nc.slow(self.slow_host, 100)
        else:
            self.nc.heal(self.slow_host)

    def settle(self) -> None:
        self.nc.wait_ok(synced=True)

    def stop(self) -> None:
        if self.nc is not None:
            self.nc.leave()
            self.nc.stop()


def census(ports: list[int]) -> dict:
    """This process's threads (the proxies' aside) and its TCP connections to the cluster's client ports."""
    import psutil
    conns = [c for c in psutil.Process().net_connections(kind="tcp")
             if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED]
    threads = [t.name for t in threading.enumerate() if not t.name.startswith(PROXY)]
    return {"threads": len(threads), "connections": len(conns)}


def _settle(ports: list[int], want: dict, timeout: float = 10.0) -> dict:
    """The census once it equals ``want`` (threads and sockets close a moment after close()), else after timeout."""
    deadline = time.monotonic() + timeout
    while (now := census(ports)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


@dataclass(slots=True)
class Served:
    phase: str
    round: int
    conv: int
    engine: int
    under_fault: bool
    ttft_s: float
    ok: bool
    wrong_tokens: int
    cached_tokens: int
    error: str = ""


def serve_one(engine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int, str]:
    """(TTFT, greedy tokens, cached prompt tokens, error) of one request alone on ``engine``."""
    from kvflow.engine.sampling import SamplingParams
    t0 = time.perf_counter()
    sid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, tokens, cached = None, [], 0
    while True:
        for out in engine.step():
            if out.seq_id != sid:
                continue
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += out.new_token_ids
            cached = out.cached_tokens
            if out.finished:
                return ttft or time.perf_counter() - t0, tokens, cached, out.error or ""


def _engine(runner, cost, pool_cfg: dict | None):
    from kvflow import KVPool, Restorer
    from kvflow.engine.config import EngineConfig
    from kvflow.engine.engine import LLMEngine
    cfg = EngineConfig(block_size=16, kv_budget=16 << 20, activation_reserve=64 << 20,
                       enable_prefix_caching=pool_cfg is not None)
    restorer = Restorer(runner, KVPool.open(pool_cfg), cost=cost, calibrate=False) if pool_cfg else None
    return LLMEngine(runner, cfg, restorer=restorer)


def _close(engine) -> None:
    engine.close()
    if engine.pool is not None:
        engine.pool.pool.close()


def phase(cluster: FaultTarget, fault: str, *, runner, cost, ref, convs: int, rounds: int, context: int,
          turn: int, answer: int, timeout_s: float, slow_s: float, node: int, seed: int, progress: Progress) -> dict:
    remote = {"type": "remote", "url": cluster.url, "cluster": True, "timeout_s": timeout_s, "workers": 4,
              "key_prefix": f"kvflow-faults:{seed}:"}
    pool_cfg = {"chunk_tokens": 64, "probe_bytes": "4M", "devices": [remote]}
    cluster.settle()                          # the previous phase's failover / rejoin is over
    before = census(cluster.ports)
    engines = [_engine(runner, cost, pool_cfg) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    chats = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(convs)]
    rows: list[Served] = []
    inject, undo = {"none": (lambda: None, lambda: None),
                    "kill-master": (lambda: cluster.kill(node), lambda: cluster.restore(node)),
                    "cut-link": (lambda: cluster.cut(node), lambda: cluster.heal(node)),
                    "slow-node": (lambda: cluster.slow(node, slow_s), lambda: cluster.slow(node, None))}[fault]
    faulty, serving = False, {}
    try:
        for r in range(rounds):
            if r == 1 and fault != "none":
                inject()
                faulty = True
            if r == rounds - 1 and faulty:
                undo()
                faulty = False
            progress(f"{fault}: round {r + 1}/{rounds}{' (fault on)' if faulty else ''}")
            for c in range(convs):
                e = (c + r) % 2
                prompt = chats[c] + torch.randint(0, vocab, (turn,), generator=gen).tolist()
                try:
                    ttft, tokens, cached, err = serve_one(engines[e], prompt, answer)
                except Exception as exc:      # noqa: BLE001 — a request that failed is counted, not fatal
                    ttft, tokens, cached, err = float("nan"), [], 0, f"{type(exc).__name__}: {exc}"
                want = serve_one(ref, prompt, answer)[1]
                wrong = sum(a != b for a, b in zip(tokens, want)) + abs(len(tokens) - len(want))
                rows.append(Served(fault, r, c, e, faulty, ttft, not err and len(tokens) == answer, wrong, cached,
                                   err[:200]))
                chats[c] = prompt + (tokens or want)
            for eng in engines:           # what this round stored is in the cluster before the other engine asks
                eng.pool.flush()
            if r == 0:
                serving = census(cluster.ports)
    finally:
        if faulty:
            undo()
        hits = [eng.pool.pool.stats() for eng in engines]
        for eng in engines:
            _close(eng)
    after = _settle(cluster.ports, before)
    return {"fault": fault, "rows": [dict(zip(Served.__slots__, (getattr(s, k) for k in Served.__slots__)))
                                     for s in rows],
            "before": before, "serving": serving, "after": after, "leak": after != before,
            "pool": [{k: h[k] for k in ("hits", "misses") if k in h} for h in hits]}


def summary(ph: dict) -> dict:
    rows = ph["rows"]
    ttft = [r["ttft_s"] for r in rows if r["ok"]]
    during = [r["ttft_s"] for r in rows if r["ok"] and r["under_fault"]] or ttft
    return {"fault": ph["fault"], "requests": len(rows), "succeeded": sum(r["ok"] for r in rows),
            "wrong_tokens": sum(r["wrong_tokens"] for r in rows),
            "cached_tokens": sum(r["cached_tokens"] for r in rows),
            "p50_ttft_s": percentile(ttft, 50) if ttft else None, "p99_ttft_s": percentile(ttft, 99) if ttft else None,
            "p99_ttft_during_s": percentile(during, 99) if during else None,
            "threads": f"{ph['before']['threads']} -> {ph['serving'].get('threads')} -> {ph['after']['threads']}",
            "connections": f"{ph['before']['connections']} -> {ph['serving'].get('connections')} -> "
                           f"{ph['after']['connections']}", "leak": ph["leak"]}


def run(*, faults: list[str], convs: int, rounds: int, context: int, turn: int, answer: int, timeout_s: float,
        slow_ms: float, model: str, progress: Progress, netns: bool = False, command: str | None = None) -> dict:
    from kvflow import load_model
    from kvflow.cost import cost_profile
    from kvflow.engine.config import EngineConfig
    from kvflow.engine.engine import LLMEngine

    runner = load_model(model)
    cost = cost_profile(runner)
    ref = LLMEngine(runner, EngineConfig(block_size=16, kv_budget=16 << 20, activation_reserve=64 << 20,
                                         enable_prefix_caching=False))
    if netns:
        progress("starting the namespace cluster (3 masters + replicas, engines on host ea; bench/netcluster.py)")
        cluster = NetTarget().start()
        where = "namespace cluster: 3 masters + 1 replica each on their own hosts, engines on host ea, tc links"
        slow_what = "rate / 100, delay x 100" if cluster.nc.netem else "rate / 100 (tc tbf; this kernel has no netem)"
    else:
        progress("starting a 3-master Redis cluster on loopback, each node behind a fault proxy")
        cluster = LoopbackCluster().start()
        where = "3 masters on loopback behind fault proxies (no replicas: a killed master restarts empty)"
        slow_what = f"+{slow_ms:g} ms per reply segment"
    try:
        phases = [phase(cluster, f, runner=runner, cost=cost, ref=ref, convs=convs, rounds=rounds, context=context,
                        turn=turn, answer=answer, timeout_s=timeout_s, slow_s=slow_ms / 1e3, node=1, seed=100 + i,
                        progress=progress) for i, f in enumerate(faults)]
    finally:
        cluster.stop()
    sums = [summary(p) for p in phases]
    base = next((s for s in sums if s["fault"] == "none"), None)
    for s in sums:
        s["p99_during_over_fault_free"] = (s["p99_ttft_during_s"] / base["p99_ttft_s"]
                                           if base and base["p99_ttft_s"] and s["p99_ttft_during_s"] else None)
    return {"command": command, "model": model, "cluster": where, "slow": slow_what,
            "convs": convs, "rounds": rounds, "context": context, "turn": turn, "answer": answer,
            "timeout_s": timeout_s, "slow_ms": slow_ms, "host": {"cpus": os.cpu_count(),
                                                                   "python": sys.version.split()[0]},
            "summary": sums, "phases": phases}


def bench(folder: Path, **kw) -> BenchRun:
    results = run(**kw)
    figure(results, folder / "faults.png")
    rows = [{"fault": s["fault"], "ok": f"{s['succeeded']}/{s['requests']}", "wrong tokens": s["wrong_tokens"],
             "P50 TTFT ms": (s["p50_ttft_s"] or 0) * 1e3, "P99 TTFT ms": (s["p99_ttft_s"] or 0) * 1e3,
             "P99 during fault ms": (s["p99_ttft_during_s"] or 0) * 1e3,
             "vs fault-free": s["p99_during_over_fault_free"], "threads": s["threads"],
             "connections": s["connections"]} for s in results["summary"]]
    title = (f"two engines, {results['convs']} chats x {results['rounds']} rounds per fault, remote timeout "
             f"{results['timeout_s']} s")
    return BenchRun(results, folder, [(title, rows)],
                    f"results: {folder / 'results.json'}, figure: {folder / 'faults.png'}")


def figure(results: dict, path) -> None:
    def draw(axes):
        ax = axes[0]
        for j, ph in enumerate(results["phases"]):
            ys = [r["ttft_s"] * 1e3 for r in ph["rows"] if r["ok"]]
            xs = [j + (0.3 if r["under_fault"] else -0.1) for r in ph["rows"] if r["ok"]]
            ax.scatter(xs, ys, s=8, c=["C3" if r["under_fault"] else "C0" for r in ph["rows"] if r["ok"]])
        ax.set_xticks(range(len(results["phases"])), [p["fault"] for p in results["phases"]])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT ms (red: during the fault)")
        ax.set_title(f"remote timeout {results['timeout_s']} s")
    save_figure(path, draw)
