"""`kvflow bench restore --link tc|both`: the restore benchmark's link as a real TCP link to a Redis cluster on other
hosts, shaped in the kernel by ``tc`` — beside the in-process throttle (``--link both``), same run, same bound.

    this process (host ea of a netcluster, bench/netcluster.py)
      pool "memory": two memory devices, throttled in-process to rho x recompute rate     (the emulated link)
      pool "tc":     the cluster (3 masters + replicas), ea's link shaped by tbf to the same rate  (the real link)

At each rho both links are measured by ``restore_bench.measure`` (every strategy and one bound probe interleaved,
``repeats`` times; the links alternate which goes first), the measured bound built from the same code at the same
rate. Per link: cacheflow / measured bound, cacheflow / min(recompute, load), the repeats' spread, and the payload
rate a bulk read of the context's records reaches on that link alone (what the link really delivers: the tc link
carries TCP/IP and Redis framing inside its rate, the throttle counts payload only). After shaping, the tc pool
re-probes its device (``_shape``): the pool learns the in-process throttle's cap directly, a kernel link only by
measuring it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvflow.bench import restore_bench as rb

MiB = 1 << 20
QUICK = ("cacheflow", "recompute", "load")


@dataclass(slots=True)
class LinkRunOptions:
    model: str = "qwen2.5-0.5b@layers=4"
    context_len: int = 8192
    rhos: list[float] = field(default_factory=lambda: [1.0, 4.0])
    links: tuple[str, ...] = ("emulated", "tc")
    query_len: int = 32
    repeats: int = 3
    strategies: tuple[str, ...] = ()          # () = every strategy
    out: Path | None = None


POOL = {"emulated": "memory", "tc": "tc"}


def link_run(o: LinkRunOptions, cost_for: Callable, progress: Callable[[str], None]) -> dict:
    from kvflow.bench.netcluster import NetCluster
    from kvflow.model import load_model
    from kvflow.planner import STRATEGIES
    from kvflow.pool import KVPool
    from kvflow.report import out_dir, write_json

    folder = out_dir("bench-restore-links", o.out)
    strategies = tuple(o.strategies) or tuple(STRATEGIES)
    result: dict = {"model": o.model, "context": o.context_len, "query": o.query_len, "repeats": o.repeats,
                    "links": list(o.links), "strategies": list(strategies), "points": []}
    nc, bench = None, None
    try:
        if "tc" in o.links:
            progress("starting the namespace cluster; this process becomes engine host ea")
            nc = NetCluster().start()
            nc.enter("ea")                   # first: every thread this process starts from now on is on host ea
            result["netem"], result["cluster"] = nc.netem, nc.url
        progress(f"building {o.model}")
        runner = load_model(o.model)
        runner.check_context_len(o.context_len + o.query_len)
        cost = cost_for(runner, o.context_len)
        bench = rb.make_bench(runner, cost, [o.context_len], query_len=o.query_len, progress=progress, store=False)
        result["recompute_rate_mib_s"] = bench.recompute_rate / MiB
        if nc is not None:
            bench.pools["tc"] = KVPool.open({"chunk_tokens": 256, "probe_bytes": 4 * MiB, "devices": [
                {"type": "remote", "url": nc.url, "cluster": True, "workers": 8,
                 "timeout_s": 120,                  # a 1 MiB request on a link of rho x recompute takes seconds
                 "key_prefix": f"kvflow-bench:{uuid.uuid4().hex[:8]}:"}]})
            bench.link_hooks["tc"] = lambda rate, latency_s=0.0: _shape(nc, bench.pools["tc"], rate, latency_s)
        progress(f"storing a {o.context_len}-token context (prefill + reference)")
        bench.add_context(o.context_len)
        if nc is not None:
            nc.wait_replicated()
        n = o.context_len
        for i, rho in enumerate(o.rhos):
            point = {"rho": rho, "links": {}}
            order = list(o.links) if i % 2 == 0 else list(reversed(o.links))
            for link in order:
                pool = POOL[link]
                rate = bench.set_link(pool, rho)
                payload = _payload_rate(bench, pool, n)
                rows = rb.measure(bench, pool, n, strategies, o.repeats, progress, f"{link} link, rho={rho:g}")
                sp = rb.speedups(rows)
                cf = rows["cacheflow"]["ttft_s"]
                point["links"][link] = {
                    "link_bytes_per_s": rate, "payload_bytes_per_s": payload, "payload_over_rate": payload / rate,
                    "cacheflow_vs_measured_bound": rows["cacheflow"]["vs_measured_bound"],
                    "cacheflow_vs_min_recompute_load": cf / min(rows["recompute"]["ttft_s"], rows["load"]["ttft_s"]),
                    "repeat_spread": sp["repeat_spread"], "best_other": sp["best_other"],
                    "cacheflow_chose": rows["cacheflow"]["chose"], "bound": bench.probes[n],
                    "max_abs_diff": max(r["max_abs_diff"] for r in rows.values()),
                    "argmax_ok": all(r["argmax_ok"] for r in rows.values()), "rows": rb.public(rows)}
                if nc is not None and link == "tc":
                    point["links"][link]["tc"] = nc.tc_stats("ea")
                    point["links"][link]["probed_read_bytes_per_s"] = bench.pools["tc"].stats()["devices"][0][
                        "probed_read_bw"]
            if len(point["links"]) == 2:
                e, t = point["links"]["emulated"], point["links"]["tc"]
                spread = max(e["repeat_spread"], t["repeat_spread"])
                point["compare"] = {
                    "tc_over_emulated_bound_ratio": t["cacheflow_vs_measured_bound"] / e["cacheflow_vs_measured_bound"],
                    "tc_over_emulated_min_ratio": (t["cacheflow_vs_min_recompute_load"]
                                                   / e["cacheflow_vs_min_recompute_load"]),
                    "repeat_spread": spread,
                    "same_verdict": (e["cacheflow_vs_min_recompute_load"] <= 1) == (t["cacheflow_vs_min_recompute_load"]
                                                                                   <= 1),
                    "within_spread": all(1 / spread <= r <= spread for r in (
                        t["cacheflow_vs_measured_bound"] / e["cacheflow_vs_measured_bound"],
                        t["cacheflow_vs_min_recompute_load"] / e["cacheflow_vs_min_recompute_load"]))}
            result["points"].append(point)
    finally:
        if bench is not None:
            bench.close()
        if nc is not None:
            nc.stop()
    write_json(folder / "restore-links.json", rb.jsonable(result))
    result["folder"] = str(folder)
    return result


def _shape(nc, pool, rate: float | None, latency_s: float = 0.0) -> None:
    """Shape engine host ea's link, then let the pool measure its device again (what it probed at open was the
    unshaped link: the in-process throttle tells the pool its cap, a kernel link cannot — without this the planner
    plans for the old rate until its run-time calibration catches up)."""
    nc.shape("ea", rate=rate, delay=latency_s)
    nbytes = 4 * MiB if rate is None else int(min(4 * MiB, max(2 * MiB, rate)))   # whole 1 MiB probe chunks
    if pool.probe(0, nbytes) is None:
        raise RuntimeError("the tc pool had no room to probe its link")


def _payload_rate(bench: rb.Bench, pool_name: str, n: int, repeats: int = 3) -> float:
    """Bytes/s of one bulk read of the context's stored records through the pool on this link, alone (fastest of
    ``repeats``)."""
    restorer = bench.restorer(pool_name)
    keys = [k for row in restorer.keys(bench.contexts[n][0]) for k in row]
    pool = bench.pools[pool_name]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = pool.get_many(keys)
        best = min(best, time.perf_counter() - t0)
    nbytes = sum(v.numel() * v.element_size() for v in got.values() if v is not None)
    return nbytes / best


def rows_for_print(result: dict) -> list[dict]:
    out = []
    for p in result["points"]:
        for link, r in p["links"].items():
            out.append({"rho": p["rho"], "link": link, "rate MiB/s": r["link_bytes_per_s"] / MiB,
                        "payload MiB/s": r["payload_bytes_per_s"] / MiB,
                        "cacheflow / bound": r["cacheflow_vs_measured_bound"],
                        "cacheflow / min(rec, load)": r["cacheflow_vs_min_recompute_load"],
                        "spread": r["repeat_spread"], "chose": r["cacheflow_chose"], "max |diff|": r["max_abs_diff"]})
    return out


__all__ = ["LinkRunOptions", "link_run", "rows_for_print"]
