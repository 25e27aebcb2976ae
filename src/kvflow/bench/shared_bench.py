"""`kvflow bench shared`: the shared KV tier on a Redis cluster, every figure a ratio from one run.

1. aggregate    — one pool of host memory + an extent file on the real disk + the cluster (``remote``), all three
                  probed by the organizer and striped by p_i (``remote_placement: stripe``): read bandwidth of the
                  whole striped context over the sum of each device reading its own share alone. Twice: at the
                  devices' own speed (this machine's regime: on a small shared CPU every device competes for the
                  same cores) and with each device capped (``--caps``, MB/s: emulated links the machine can feed
                  all at once — the regime of a host whose devices do not share a bottleneck).
2. second engine — process A (a subprocess) stores an N-token context on the cluster; this process — empty local
                  devices, no index of A's — finds it (``longest_prefix`` over the store) and restores it: TTFT of
                  cacheflow and load vs recompute, with the remote device at the store's real loopback speed,
                  throttled to a 10 Gbps link (1.25 GB/s), and throttled to rho = 1 (the link moves the context's
                  KV in the time recompute takes, measured just before). Exactness is checked on every restore.

3. hosts        — (``--only hosts``; root) the same on separate hosts: a cluster of network namespaces
                  (``bench/netcluster.py``: 3 masters + 3 replicas, engine hosts ea and eb, links shaped by ``tc``).
                  Engine A (host ea, a process) stores a context; engine B (host eb, a process) restores it over its
                  own link shaped to ``--link-rate``: TTFT of cacheflow / load vs recompute, exactness checked. Then
                  aggregate reads: engine A stores records on all three masters, each master's link is shaped to
                  ``--host-rate``, and engine B reads an equal share from 1, 2 and 3 of them: rate over n x one host.

Without ``--url`` the bench starts a 3-master cluster on loopback in a temporary directory (``pool/redis_local.py``)
and always tears it down; with ``--url`` it uses that store (its keys under a fresh prefix, deleted after).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from kvflow.report import BenchRun, save_figure
from kvflow.pool.devices import odirect_supported
from kvflow.bench.pool_bench import synthetic_context, timed_get
from kvflow.pool import KVPool
from kvflow.stats import median_of

MiB = 1 << 20
LINK_10G = 1.25e9
Progress = Callable[[str], None]


def _remote(url: str, cluster: bool, prefix: str, **extra) -> dict:
    return {"type": "remote", "url": url, "cluster": cluster, "key_prefix": prefix, "workers": 8, **extra}


def _clear(url: str, cluster: bool, prefix: str) -> None:
    """Delete this run's keys (every node)."""
    from kvflow.extras import require
    redis = require("redis")
    from redis.cluster import ClusterNode, RedisCluster

    hosts = [h.rsplit(":", 1) for h in url.partition("://")[2].rpartition("@")[2].split(",")]
    client = (RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, p in hosts]) if cluster
              else redis.Redis(host=hosts[0][0], port=int(hosts[0][1])))
    try:
        nodes = client.get_primaries() if cluster else [None]
        for node in nodes:
            conn = client.get_redis_connection(node) if cluster else client
            pipe = conn.pipeline(transaction=False)
            for key in conn.scan_iter(match=prefix + "*", count=1000):
                pipe.unlink(key)          # one key a command: keys of a node span many hash slots
            pipe.execute()
    finally:
        client.close()


# -- 1. aggregate read bandwidth -----------------------------------------------------------------------------------
def aggregate(url: str, cluster: bool, disk_dir: str, data_bytes: int, record_bytes: int, caps: list[float] | None,
              probe_bytes: int, repeats: int, progress: Progress) -> dict:
    prefix = f"kvflow-bench:{uuid.uuid4().hex[:8]}:"
    _, keys, data = synthetic_context(data_bytes // record_bytes * 256, record_bytes, seed=7)
    moved = sum(t.numel() * 4 for t in data.values())
    cap = int(moved * 1.3) // MiB * MiB + 128 * MiB
    names = ("memory", "extent", "remote")
    throttles = caps or [None, None, None]
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-shared-", dir=disk_dir) as tmp:
        direct = odirect_supported(tmp)
        devices = [{"type": "memory", "capacity": cap},
                   {"type": "extent", "path": os.path.join(tmp, "disk.img"), "capacity": cap, "direct": direct},
                   _remote(url, cluster, prefix)]
        for dev, t in zip(devices, throttles):
            if t is not None:
                dev["throttle"] = int(t)
        cfg = {"index_dir": os.path.join(tmp, "index"), "durability": "relaxed", "chunk_tokens": 256,
               "probe_bytes": probe_bytes, "devices": devices}
        label = "capped" if caps else "own speed"
        progress(f"aggregate ({label}): memory + extent + cluster, probing")
        try:
            with KVPool.open(cfg) as pool:
                st = pool.stats()["devices"]
                probed, p = [d["probed_read_bw"] for d in st], [d["p"] for d in st]
                pool.put_many(data)
                timed_get(pool, keys)                                   # warm: connections, page mappings
                progress(f"aggregate ({label}): striped read")
                t_all = median_of(lambda: timed_get(pool, keys), repeats)
                dev_of = {d: dev for d, dev, *_ in pool.entries()}
                share, alone = [], []
                for i, name in enumerate(names):
                    mine = [k for k in keys if dev_of[k.digest] == i]
                    share.append(sum(data[k].numel() * 4 for k in mine) / moved)
                    progress(f"aggregate ({label}): {name} alone")
                    alone.append(sum(data[k].numel() * 4 for k in mine) / median_of(lambda: timed_get(pool, mine),
                                                                                     repeats) if mine else 0.0)
        finally:
            _clear(url, cluster, prefix)
    out = {"caps": caps, "bytes": moved, "records": len(keys), "record_bytes": record_bytes, "o_direct": direct,
           "devices": list(names), "probed_read_bw": probed, "p": p, "share": share, "alone_bw": alone,
           "sum_alone": sum(alone), "read_bw": moved / t_all}
    out["ratio_to_sum"] = out["read_bw"] / out["sum_alone"]
    return out


# -- 2. a second engine restores what the first stored -------------------------------------------------------------
FIRST = textwrap.dedent("""
    import json, sys, torch
    from kvflow import KVPool, Restorer, load_model
    from kvflow.cost import cost_profile
    cfg, model, n, seed = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    runner = load_model(model)
    ctx = torch.randint(0, runner.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    with KVPool.open(cfg) as pool:
        res = Restorer(runner, pool, cost=cost_profile(runner)).store(ctx)
        print(json.dumps({"records": pool.stats()["put_records"], "bytes": pool.stats()["put_bytes"]}))
""")


def second_engine(url: str, cluster: bool, model: str, tokens: int, query_len: int, repeats: int,
                  progress: Progress) -> dict:
    from kvflow import Restorer, load_model
    from kvflow.cost import cost_profile

    prefix = f"kvflow-bench:{uuid.uuid4().hex[:8]}:"
    seed = 1234
    first_cfg = {"chunk_tokens": 256, "probe_bytes": 16 * MiB, "devices": [_remote(url, cluster, prefix)]}
    progress(f"second engine: process A stores a {tokens}-token context of {model} on the cluster")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", FIRST, json.dumps(first_cfg), model, str(tokens), str(seed)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the first engine failed: {done.stderr.strip().splitlines()[-1:]}")
    stored = json.loads(done.stdout.strip().splitlines()[-1])
    store_s = time.perf_counter() - t0
    runner = load_model(model)
    cost = cost_profile(runner)
    ctx = torch.randint(0, runner.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    query = torch.randint(0, runner.config.vocab_size, (query_len,), generator=torch.Generator().manual_seed(seed + 1))
    ref = runner.reference_prefill(torch.cat([ctx, query]))
    links = {}
    try:
        for link in ("loopback", "10gbps", "rho=1"):
            # rho = 1: the link moves KV as fast as recompute makes it (measured on loopback just before) —
            # the regime DESIGN.md §5 puts an 8B model on an H100 with a 10 Gbps link in
            throttle = (None if link == "loopback" else LINK_10G if link == "10gbps"
                        else stored["bytes"] / links["loopback"]["rows"]["recompute"]["ttft_s"])
            remote = _remote(url, cluster, prefix, **({"throttle": int(throttle)} if throttle else {}))
            cfg = {"chunk_tokens": 256, "probe_bytes": 16 * MiB, "remote_placement": "copy",
                   "devices": [{"type": "memory", "capacity": max(64 * MiB, 2 * stored["bytes"])}, remote]}
            with KVPool.open(cfg) as pool:    # a fresh process-local pool: empty memory, no index of A's
                restorer = Restorer(runner, pool, cost=cost)
                req, _ = restorer.lookup(ctx, query_len)
                rows = restore_rows(restorer, ctx, query, ref, repeats, lambda s: progress(f"second engine ({link}): {s}"))
                st = pool.stats()
                links[link] = {"throttle": throttle, "found_chunks": req.stored_chunks,
                               "context_chunks": tokens // 256, "remote_read_bw": st["devices"][1]["read_bw"],
                               "remote_hits": st["devices"][1]["reads"], "misses": st["misses"], "rows": rows,
                               "recompute_over_cacheflow": rows["recompute"]["ttft_s"] / rows["cacheflow"]["ttft_s"],
                               "recompute_over_load": rows["recompute"]["ttft_s"] / rows["load"]["ttft_s"]}
    finally:
        _clear(url, cluster, prefix)
    return {"model": model, "tokens": tokens, "query": query_len, "stored": stored, "first_store_s": store_s,
            "links": links}


def restore_rows(restorer, ctx, query, ref, repeats: int, progress: Progress) -> dict:
    """TTFT (median of ``repeats``) of cacheflow, load and recompute, each restore checked against ``ref``."""
    from kvflow.bench.restore_bench import kv_diff

    rows = {}
    for strategy in ("cacheflow", "load", "recompute"):
        progress(strategy)
        outs = [restorer.restore(ctx, query, strategy) for _ in range(max(1, repeats))]
        rows[strategy] = {"ttft_s": statistics.median(o.timings.ttft_s for o in outs),
                          "ttft_runs": [o.timings.ttft_s for o in outs],
                          "max_abs_diff": max(kv_diff(o, ref) for o in outs),
                          "argmax_ok": all(bool(o.logits.argmax() == ref[1].argmax()) for o in outs),
                          "lookup_s": statistics.median(o.timings.lookup_s for o in outs)}
    return rows


# -- 3. separate hosts: a cluster of network namespaces, links shaped by tc ------------------------------------------
def engine_a(url: str, prefix: str, model: str | None = None, tokens: int = 0, seed: int = 0, records_bytes: int = 0,
             record_bytes: int = 0) -> dict:
    """Engine A (run in its host): store a ``tokens``-token context of ``model``, or ``records_bytes`` of synthetic
    records, on the cluster."""
    if model is not None:
        from kvflow import Restorer, load_model
        from kvflow.cost import cost_profile

        runner = load_model(model)
        ctx = torch.randint(0, runner.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
        with KVPool.open(_pool_cfg(url, prefix)) as pool:
            Restorer(runner, pool, cost=cost_profile(runner)).store(ctx)
            return {"records": pool.stats()["put_records"], "bytes": pool.stats()["put_bytes"]}
    _, keys, data = synthetic_context(records_bytes // record_bytes * 256, record_bytes, seed=seed)
    with KVPool.open(_pool_cfg(url, prefix)) as pool:
        pool.put_many(data)
        return {"records": pool.stats()["put_records"], "bytes": pool.stats()["put_bytes"]}


def engine_b(url: str, prefix: str, model: str, tokens: int, seed: int, query_len: int, repeats: int) -> dict:
    """Engine B (run in its host): find and restore engine A's context with each strategy, from the cluster only."""
    from kvflow import Restorer, load_model
    from kvflow.cost import cost_profile

    runner = load_model(model)
    ctx = torch.randint(0, runner.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    query = torch.randint(0, runner.config.vocab_size, (query_len,), generator=torch.Generator().manual_seed(seed + 1))
    ref = runner.reference_prefill(torch.cat([ctx, query]))
    with KVPool.open(_pool_cfg(url, prefix)) as pool:     # the cluster only: every restore reads over the link
        restorer = Restorer(runner, pool, cost=cost_profile(runner))
        found = restorer.lookup(ctx, query_len)[0].stored_chunks
        rows = restore_rows(restorer, ctx, query, ref, repeats, lambda s: None)
        st = pool.stats()
    return {"found_chunks": found, "rows": rows, "remote_read_bw": st["devices"][0]["read_bw"],
            "misses": st["misses"]}


def engine_b_reads(url: str, prefix: str, seed: int, records_bytes: int, record_bytes: int, hosts: list[str],
                   repeats: int) -> dict:
    """Engine B (run in its host): read an equal number of engine A's synthetic records from each of the first n of
    ``hosts`` (master IPs), n = 1 .. len(hosts), through the pool; bytes/s of each (median of ``repeats``)."""
    _, keys, _ = synthetic_context(records_bytes // record_bytes * 256, record_bytes, seed=seed)
    with KVPool.open(_pool_cfg(url, prefix)) as pool:
        store = next(s.device.store for s in pool.slots if s.cfg.type == "remote")
        client = store.client()
        on: dict[str, list] = {h: [] for h in hosts}
        for k in keys:
            node = client.get_node_from_key(store.key(k.hex.encode()))
            on.setdefault(node.host, []).append(k)
        per = min(len(on[h]) for h in hosts)
        timed_get(pool, [k for h in hosts for k in on[h][:per]])                     # warm: connections
        rates, moved = [], []
        for n in range(1, len(hosts) + 1):
            mine = [k for h in hosts[:n] for k in on[h][:per]]
            nbytes = per * n * record_bytes
            rates.append(nbytes / median_of(lambda: timed_get(pool, mine), repeats))
            moved.append(nbytes)
    return {"records_per_host": per, "bytes": moved, "read_bw": rates}


def _pool_cfg(url: str, prefix: str) -> dict:
    return {"chunk_tokens": 256, "probe_bytes": 4 * MiB, "devices": [_remote(url, True, prefix)]}


IN_HOST = "import json, sys; from kvflow.bench import shared_bench as b; print(json.dumps(getattr(b, sys.argv[1])(**json.loads(sys.argv[2]))))"


def hosts(model: str, tokens: int, query_len: int, link_rate: float, host_rate: float, records_bytes: int,
          repeats: int, progress: Progress) -> dict:
    """Section 3 (see the module docstring): one cluster of namespaces, always torn down."""
    from kvflow.bench.netcluster import NetCluster

    progress("starting the namespace cluster (3 masters + 3 replicas, engine hosts ea and eb)")
    with NetCluster() as nc:
        env = nc.env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

        def call(host: str, fn: str, **kw) -> dict:
            progress(f"{fn} on host {host}")
            return nc.call(host, nc.python("-c", IN_HOST, fn, json.dumps(kw)), timeout_s=3600, env=env)

        prefix, seed = f"kvflow-bench:{uuid.uuid4().hex[:8]}:", 4321
        stored = call("ea", "engine_a", url=nc.url, prefix=prefix, model=model, tokens=tokens, seed=seed)
        nc.wait_replicated()
        nc.shape("eb", rate=link_rate)
        rtt = call("eb", "ping_rtt", url=nc.url)
        b = call("eb", "engine_b", url=nc.url, prefix=prefix, model=model, tokens=tokens, seed=seed,
                 query_len=query_len, repeats=repeats)
        rows = b["rows"]
        sharing = {"model": model, "tokens": tokens, "stored": stored, "link_bytes_per_s": link_rate,
                   "link_rtt_s": rtt["rtt_s"], "link_delay_note": None if nc.netem else
                   "no netem in this kernel: the link adds no delay; its RTT is the measured one",
                   **b, "ttft_over_recompute": {s: rows[s]["ttft_s"] / rows["recompute"]["ttft_s"] for s in rows}}
        nc.heal("eb")
        nc.shape("eb", rate=None)
        nc.flush()

        prefix = f"kvflow-bench:{uuid.uuid4().hex[:8]}:"
        masters = [nc.ip(h) for h in ("m0", "m1", "m2")]
        call("ea", "engine_a", url=nc.url, prefix=prefix, seed=seed, records_bytes=records_bytes,
             record_bytes=512 * 1024)
        nc.wait_replicated()
        for h in ("m0", "m1", "m2"):
            nc.shape(h, rate=host_rate)
        reads = call("eb", "engine_b_reads", url=nc.url, prefix=prefix, seed=seed, records_bytes=records_bytes,
                     record_bytes=512 * 1024, hosts=masters, repeats=repeats)
        one = reads["read_bw"][0]
        reads.update(host_rate=host_rate, hosts=masters,
                     scaling=[bw / (n * one) for n, bw in enumerate(reads["read_bw"], start=1)],
                     tc={h: nc.tc_stats(h) for h in ("m0", "m1", "m2")})
    return {"sharing": sharing, "aggregate": reads, "netem": nc.netem}


def ping_rtt(url: str, n: int = 50) -> dict:
    """Median round trip of a Redis PING to each seed (run in a host)."""
    import redis

    times = []
    for item in url.partition("://")[2].split(","):
        host, _, port = item.rpartition(":")
        c = redis.Redis(host=host, port=int(port))
        c.ping()
        for _ in range(n):
            t0 = time.perf_counter()
            c.ping()
            times.append(time.perf_counter() - t0)
        c.close()
    return {"rtt_s": statistics.median(times)}


# -- the run ---------------------------------------------------------------------------------------------------
def run(*, url: str | None, cluster: bool, quick: bool, disk_dir: str | None, model: str, tokens: int | None,
        caps: list[float], sections: set[str], progress: Progress, command: str | None = None,
        link_rate: float = LINK_10G, host_rate: float = 15e6) -> dict:
    from kvflow.pool.redis_local import RedisProcs

    disk_dir = disk_dir or os.environ.get("KVFLOW_BENCH_DISK") or "/var/tmp"
    repeats = 1 if quick else 3
    data = (64 if quick else 256) * MiB
    procs = None
    if sections == {"hosts"}:
        out = {"command": command, "quick": quick, "store": "namespace cluster (bench/netcluster.py)",
               "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "load": os.getloadavg()}}
        out["hosts"] = hosts(model, tokens or (2048 if quick else 8192), 16, link_rate, host_rate,
                             (24 if quick else 96) * MiB, repeats, progress)
        return out
    if url is None:
        progress("starting a 3-master Redis cluster on loopback")
        procs = RedisProcs(masters=3, cluster=True).start()
        url, cluster = procs.url, True
    try:
        out: dict = {"command": command, "quick": quick, "store": "local 3-master cluster" if procs else "given",
                     "cluster": cluster, "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        if "aggregate" in sections:
            out["aggregate"] = [aggregate(url, cluster, disk_dir, data, 512 * 1024, c, (16 if quick else 64) * MiB,
                                          repeats, progress) for c in (None, caps)]
        if "engine" in sections:
            out["second_engine"] = second_engine(url, cluster, model, tokens or (2048 if quick else 8192), 16,
                                                 repeats, progress)
        return out
    finally:
        if procs is not None:
            procs.stop()


def bench(folder: Path, **kw) -> BenchRun:
    """``run(**kw)`` and its figure in ``folder``: ``kvflow bench shared``."""
    results = run(**kw)
    figure(results, folder / "shared.png")
    return BenchRun(results, folder, tables(results),
                    f"results: {folder / 'results.json'}, figure: {folder / 'shared.png'}")


def tables(results: dict) -> list[tuple[str, list[dict]]]:
    out = []
    for agg in results.get("aggregate", []):
        label = "capped " + "/".join(f"{c / 1e6:.0f}" for c in agg["caps"]) + " MB/s" if agg["caps"] else "own speed"
        rows = [{"device": n, "probed MB/s": b / 1e6, "p": p, "share": s, "alone MB/s": a / 1e6}
                for n, b, p, s, a in zip(agg["devices"], agg["probed_read_bw"], agg["p"], agg["share"],
                                         agg["alone_bw"])]
        rows.append({"device": "striped (all three)", "alone MB/s": agg["read_bw"] / 1e6,
                     "share": agg["ratio_to_sum"]})
        out.append((f"aggregate read bandwidth, {label}: striped / sum alone = {agg['ratio_to_sum']:.2f}", rows))
    if (se := results.get("second_engine")) is not None:
        rows = []
        for link, r in se["links"].items():
            for s, row in r["rows"].items():
                rows.append({"link": link, "strategy": s, "ttft ms": row["ttft_s"] * 1e3,
                             "vs recompute": r["rows"]["recompute"]["ttft_s"] / row["ttft_s"],
                             "max |diff|": row["max_abs_diff"], "found chunks": r["found_chunks"]})
        out.append((f"second engine: {se['tokens']}-token context of {se['model']} stored by another process", rows))
    if (h := results.get("hosts")) is not None:
        sh = h["sharing"]
        out.append((f"engine B (host eb) restores engine A's (host ea) {sh['tokens']}-token context of {sh['model']}; "
                    f"B's link {sh['link_bytes_per_s'] / 1e6:.0f} MB/s (tc), RTT {sh['link_rtt_s'] * 1e3:.2f} ms",
                    [{"strategy": s, "ttft ms": r["ttft_s"] * 1e3, "/ recompute": sh["ttft_over_recompute"][s],
                      "max |diff|": r["max_abs_diff"], "found chunks": sh["found_chunks"]}
                     for s, r in sh["rows"].items()]))
        ag = h["aggregate"]
        out.append((f"aggregate reads, each storage host's link {ag['host_rate'] / 1e6:.0f} MB/s (tc)",
                    [{"storage hosts": n, "MB/s": bw / 1e6, "/ (n x one host)": sc}
                     for n, (bw, sc) in enumerate(zip(ag["read_bw"], ag["scaling"]), start=1)]))
    return out


def figure(results: dict, path) -> None:
    if "hosts" in results:
        return _hosts_figure(results["hosts"], path)
    aggs, se = results.get("aggregate", []), results.get("second_engine")

    def draw(axes):
        ax = axes[0]
        for j, agg in enumerate(aggs):
            xs = [j * 5 + i for i in range(4)]
            ax.bar(xs[:3], [a / 1e6 for a in agg["alone_bw"]], color="0.7")
            ax.bar(xs[3], agg["sum_alone"] / 1e6, color="0.85", label="sum alone" if j == 0 else None)
            ax.bar(xs[3], agg["read_bw"] / 1e6, width=0.5, color="C0", label="striped" if j == 0 else None)
        ax.set_xticks([j * 5 + 1.5 for j in range(len(aggs))],
                      ["own speed" if not a["caps"] else "capped" for a in aggs])
        ax.set_ylabel("MB/s")
        ax.set_title("memory + disk + cluster")
        ax.legend()
        if se is not None and len(axes) > 1:
            ax = axes[1]
            for j, (link, r) in enumerate(se["links"].items()):
                ax.bar([j * 4 + i for i in range(3)], [r["rows"][s]["ttft_s"] * 1e3 for s in
                                                         ("cacheflow", "load", "recompute")],
                       color=["C0", "C1", "C3"])
            ax.set_xticks([j * 4 + 1 for j in range(len(se["links"]))], list(se["links"]))
            ax.set_ylabel("TTFT ms (cacheflow, load, recompute)")
            ax.set_title("second engine")

    save_figure(path, draw, panels=2)


def _hosts_figure(h: dict, path) -> None:
    sh, ag = h["sharing"], h["aggregate"]

    def draw(axes):
        ax = axes[0]
        names = list(sh["rows"])
        ax.bar(names, [sh["rows"][s]["ttft_s"] * 1e3 for s in names], color=["C0", "C1", "C3"])
        ax.set(ylabel="TTFT ms", title="engine B restores engine A's context")
        ax = axes[1]
        n = list(range(1, len(ag["read_bw"]) + 1))
        ax.plot(n, [bw / 1e6 for bw in ag["read_bw"]], "o-", label="measured")
        ax.plot(n, [k * ag["read_bw"][0] / 1e6 for k in n], "k--", label="n x one host")
        ax.set(xlabel="storage hosts", ylabel="MB/s", title="aggregate reads")
        ax.legend()

    save_figure(path, draw, panels=2)
