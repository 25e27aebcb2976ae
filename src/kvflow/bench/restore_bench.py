"""`kvflow bench restore` and `kvflow demo`: every strategy, same model, same pool, same run.

Links are emulated by throttling the pool to ``rho x`` the rate at which recompute produces KV bytes at short
context (DESIGN.md §5); the unthrottled run reads a real file on this machine's disk through the passthrough
(O_DIRECT extent) device. Every restore is checked against one fresh full prefill (max |diff| reported).
Strategies are measured interleaved, ``repeats`` times; the median is reported, so drift in machine load
hits every strategy alike.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvflow.cost.model import CostModel
from kvflow.model.runner import ModelRunner
from kvflow.planner import STRATEGIES
from kvflow.pool import KVPool
from kvflow.restorer import Restorer, RestoreResult

BASELINES = ("recompute", "load", "load-layerwise", "cake")
Progress = Callable[[str], None]


def kv_diff(out: RestoreResult, ref) -> float:
    ref_kv, ref_logits = ref
    worst = (out.logits - ref_logits).abs().max().item()
    for (k, v), (rk, rv) in zip(out.kv, ref_kv):
        worst = max(worst, (k - rk).abs().max().item(), (v - rv).abs().max().item())
    return worst


def context(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, min(vocab, 32000), (n,), generator=torch.Generator().manual_seed(seed))


@dataclass
class Bench:
    """One model, its cost model, and the pools every strategy shares."""
    runner: ModelRunner
    cost: CostModel
    chunk_tokens: int = 256
    query_len: int = 32
    pools: dict = field(default_factory=dict)
    contexts: dict = field(default_factory=dict)
    refs: dict = field(default_factory=dict)
    tmp: tempfile.TemporaryDirectory | None = None

    def restorer(self, pool_name: str) -> Restorer:
        return Restorer(self.runner, self.pools[pool_name], cost=self.cost)

    def add_context(self, n: int) -> None:
        if n in self.contexts:
            return
        ctx = context(n, n, self.runner.config.vocab_size)
        query = context(self.query_len, n + 1, self.runner.config.vocab_size)
        self.contexts[n] = (ctx, query)
        self.refs[n] = self.runner.reference_prefill(torch.cat([ctx, query]))
        for name in self.pools:
            self.restorer(name).store(ctx)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        if self.tmp is not None:
            self.tmp.cleanup()


def odirect_supported(folder: str) -> bool:
    import os
    path = os.path.join(folder, ".odirect-probe")
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    os.unlink(path)
    return True


def make_bench(runner: ModelRunner, cost: CostModel, lengths, *, chunk_tokens: int = 256, query_len: int = 32,
               disk_dir: str | None = None, progress: Progress = lambda s: None) -> Bench:
    """A throttled memory pool (two devices, striped) and, with ``disk_dir``, an O_DIRECT extent file there."""
    kv = runner.kv_bytes_per_token()
    need = ((int(sum(lengths) * kv * 1.3) >> 20) + 64) << 20  # whole MiB: extent devices want aligned sizes
    bench = Bench(runner, cost, chunk_tokens, query_len)
    bench.pools["memory"] = KVPool.memory(need, devices=2, chunk_tokens=chunk_tokens)
    if disk_dir is not None:
        bench.tmp = tempfile.TemporaryDirectory(prefix="kvflow-bench-", dir=disk_dir)
        direct = odirect_supported(bench.tmp.name)
        if not direct:
            progress(f"{disk_dir} does not support O_DIRECT (tmpfs?): the disk run goes through the page cache")
        bench.pools["disk"] = KVPool.open({"chunk_tokens": chunk_tokens, "durability": "relaxed",
                                           "index_dir": str(Path(bench.tmp.name) / "index"),
                                           "devices": [{"type": "extent", "capacity": need, "direct": direct,
                                                        "path": str(Path(bench.tmp.name) / "disk.img")}]})
    for n in sorted(set(lengths)):
        progress(f"storing a {n}-token context (prefill + reference)")
        bench.add_context(n)
    return bench


def measure(bench: Bench, pool_name: str, n: int, strategies, repeats: int, progress: Progress,
            label: str) -> dict[str, dict]:
    """Median TTFT etc. of each strategy on the ``n``-token context, strategies interleaved per repeat."""
    restorer = bench.restorer(pool_name)
    ctx, query = bench.contexts[n]
    runs: dict[str, list[RestoreResult]] = {s: [] for s in strategies}
    for rep in range(repeats):
        for s in strategies:
            progress(f"{label}: {s} ({rep + 1}/{repeats})")
            runs[s].append(restorer.restore(ctx, query, s))
    rows = {}
    for s, outs in runs.items():
        mid = sorted(outs, key=lambda o: o.timings.ttft_s)[len(outs) // 2]
        t = mid.timings
        rows[s] = {
            "strategy": s, "context": n, "ttft_s": statistics.median(o.timings.ttft_s for o in outs),
            "ttft_runs": [o.timings.ttft_s for o in outs], "predicted_s": t.predicted_ttft_s,
            "lower_bound_s": t.lower_bound_s, "vs_lower_bound": statistics.median(o.timings.vs_lower_bound
                                                                                   for o in outs),
            "restore_s": t.restore_s, "compute_util": t.compute_util, "io_util": t.io_util,
            "blocked_io_s": t.blocked_io_s, "lookup_s": t.lookup_s, "plan_s": t.plan_s,
            "max_abs_diff": max(kv_diff(o, bench.refs[n]) for o in outs),
            "argmax_ok": all(o.logits.argmax().item() == bench.refs[n][1].argmax().item() for o in outs),
            "plan": mid.plan.describe(), "chose": mid.plan.notes.get("chose", s),
            "fallback_chunks": mid.fallback_chunks, "_result": mid,
        }
    return rows


def rho_bandwidth(bench: Bench, rho: float) -> float:
    return bench.cost.bandwidth_for_rho(rho, bench.chunk_tokens)


def speedups(rows: dict[str, dict]) -> dict:
    cf = rows["cacheflow"]["ttft_s"]
    others = {s: r["ttft_s"] for s, r in rows.items() if s != "cacheflow"}
    best = min(others, key=others.get)
    return {"vs": {s: t / cf for s, t in others.items()}, "best_other": best,
            "cacheflow_vs_best_other": cf / others[best]}


def public(rows: dict[str, dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows.values()]


def sweep_rho(bench: Bench, n: int, rhos, strategies, repeats: int, progress: Progress) -> list[dict]:
    """Throttled memory pool at each rho (+ "disk": the real disk, unthrottled, if the bench has one)."""
    points = []
    for rho in rhos:
        bench.pools["memory"].set_throttle(rho_bandwidth(bench, rho))
        rows = measure(bench, "memory", n, strategies, repeats, progress, f"{n} tokens, rho={rho:g}")
        points.append({"rho": rho, "pool": "memory (throttled)", "context": n, "rows": rows})
    if "disk" in bench.pools:
        rows = measure(bench, "disk", n, strategies, max(repeats, 5), progress, f"{n} tokens, real disk")
        bw = bench.pools["disk"].read_bandwidth
        points.append({"rho": bw / rho_bandwidth(bench, 1.0), "pool": "disk (unthrottled, O_DIRECT)", "context": n,
                       "rows": rows})
    return points


def sweep_length(bench: Bench, lengths, rho: float, strategies, repeats: int, progress: Progress) -> list[dict]:
    bench.pools["memory"].set_throttle(rho_bandwidth(bench, rho))
    return [{"rho": rho, "pool": "memory (throttled)", "context": n,
             "rows": measure(bench, "memory", n, strategies, repeats, progress, f"{n} tokens, rho={rho:g}")}
            for n in lengths]


def crossover(points: list[dict]) -> dict:
    """Measured: the shortest context from which token split beats layer split (and stays ahead)."""
    by_len = sorted(points, key=lambda p: p["context"])
    token_wins = [p["rows"]["token"]["ttft_s"] < p["rows"]["layer"]["ttft_s"] for p in by_len]
    measured = None
    for i in range(len(by_len)):
        if all(token_wins[i:]):
            measured = by_len[i]["context"]
            break
    picks = []
    for p, tw in zip(by_len, token_wins):
        rows = p["rows"]
        faster = "token" if tw else "layer"
        picks.append({"context": p["context"], "faster": faster, "cacheflow_chose": rows["cacheflow"]["chose"],
                      "cacheflow_s": rows["cacheflow"]["ttft_s"],
                      "faster_side_s": min(rows["token"]["ttft_s"], rows["layer"]["ttft_s"])})
    return {"measured_tokens": measured, "points": picks}


# ------------------------------------------------------------------------------------------------ batches
def batch_lengths(size: int, seed: int, lo: int = 512, hi: int = 8192, chunk: int = 256) -> list[int]:
    """Mixed context lengths, log-uniform in [lo, hi], rounded to whole chunks (documented in BENCHMARKS.md)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(size, generator=g).tolist()
    return [max(chunk, int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))) / chunk)) * chunk)
            for x in u]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q
    f = math.floor(k)
    return s[f] + (s[min(f + 1, len(s) - 1)] - s[f]) * (k - f)


def ttft_stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99), "max": max(values)}


def measure_batch(bench: Bench, lengths: list[int], rho: float, repeats: int, progress: Progress) -> dict:
    """Batch-aware cacheflow vs per-request FCFS (cake, token, cacheflow), all requests arriving together."""
    for n in lengths:
        bench.add_context(n)
    bench.pools["memory"].set_throttle(rho_bandwidth(bench, rho))
    restorer = bench.restorer("memory")
    requests = [bench.contexts[n] for n in lengths]
    modes = [("cacheflow", "batch"), ("cake", "fcfs"), ("token", "fcfs"), ("cacheflow", "fcfs")]
    runs: dict[str, list[list[float]]] = {f"{s}/{m}": [] for s, m in modes}
    worst_diff = 0.0
    for rep in range(repeats):
        for s, m in modes:
            progress(f"batch of {len(lengths)}: {s}/{m} ({rep + 1}/{repeats})")
            outs = restorer.restore_batch(requests, s, m)
            runs[f"{s}/{m}"].append([o.timings.ttft_s for o in outs])
            worst_diff = max([worst_diff] + [kv_diff(o, bench.refs[n]) for o, n in zip(outs, lengths)])
    result = {"lengths": lengths, "rho": rho, "max_abs_diff": worst_diff, "modes": {}}
    for name, reps in runs.items():
        per_rep = [ttft_stats(r) for r in reps]
        result["modes"][name] = {k: statistics.median(p[k] for p in per_rep) for k in per_rep[0]}
    fcfs = result["modes"]["cake/fcfs"]
    batch = result["modes"]["cacheflow/batch"]
    result["batch_vs_fcfs_cake"] = {k: batch[k] / fcfs[k] for k in ("mean", "p50", "p90", "p99")}
    return result


# ----------------------------------------------------------------------------------------------- output
def plot_rho(points: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = [p for p in points if p["pool"].startswith("memory")]
    strategies = list(swept[0]["rows"])
    fig, (ax, sp) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in strategies:
        ax.plot([p["rho"] for p in swept], [p["rows"][s]["ttft_s"] for p in swept], marker="o", label=s,
                lw=2.5 if s == "cacheflow" else 1.2)
    ax.plot([p["rho"] for p in swept], [p["rows"]["cacheflow"]["lower_bound_s"] for p in swept], "k--", lw=1,
            label="T* (lower bound)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rho = I/O bandwidth / recompute rate")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    for s in strategies:
        if s != "cacheflow":
            sp.plot([p["rho"] for p in swept], [p["rows"][s]["ttft_s"] / p["rows"]["cacheflow"]["ttft_s"]
                                                for p in swept], marker="o", label=f"{s} / cacheflow")
    sp.axhline(1.0, color="k", lw=0.8)
    sp.set_xscale("log", base=2)
    sp.set_xlabel("rho")
    sp.set_ylabel("TTFT ratio (>1: cacheflow faster)")
    sp.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lengths(points: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = [p["context"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in points[0]["rows"]:
        ax.plot(lens, [p["rows"][s]["ttft_s"] / p["rows"]["cacheflow"]["lower_bound_s"] for p in points],
                marker="o", label=s, lw=2.5 if s == "cacheflow" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT / T*")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_batch(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        modes = list(res["modes"])
        for j, stat in enumerate(("mean", "p50", "p99")):
            ax.bar([i + 0.27 * j for i in range(len(modes))], [res["modes"][m][stat] for m in modes], width=0.27,
                   label=stat)
        ax.set_xticks([i + 0.27 for i in range(len(modes))], modes, rotation=20, fontsize=7)
        ax.set_title(f"batch of {len(res['lengths'])}")
        ax.set_ylabel("TTFT (s)")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def jsonable(data):
    """Results without private fields (``_result``) and with non-finite floats as null."""
    if isinstance(data, dict):
        return {k: jsonable(v) for k, v in data.items() if not str(k).startswith("_")}
    if isinstance(data, (list, tuple)):
        return [jsonable(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


__all__ = ["BASELINES", "STRATEGIES", "Bench", "make_bench", "measure", "sweep_rho", "sweep_length", "crossover",
           "speedups", "measure_batch", "batch_lengths", "plot_rho", "plot_lengths", "plot_batch", "jsonable",
           "public", "rho_bandwidth"]
