"""`kvflow bench restore` and `kvflow demo`: every strategy, same model, same pool, same run.

Links are emulated by throttling the pool to ``rho x`` the rate at which recompute produces KV bytes (DESIGN.md §5;
not the profile, not the calibrated model). Rho's basis (``rho_basis``): "context" (default) — the KV bytes of the
context over its own recompute TTFT, measured in the same run (one recompute of that context before its points), so
rho = 1 means loading the context takes as long as recomputing it; "short" — recompute's rate at short context,
measured warm once at the start of the run (also reported beside the other). The unthrottled run reads a real
file on this machine's disk through the passthrough (O_DIRECT extent) device. Every restore is checked against
one fresh full prefill (max |diff| reported), whose KV is also what the pools store. Strategies are measured
interleaved, ``repeats`` times, with one probe of the measured bound (bench/bound.py) among them each repeat (from
``once_from`` tokens: recompute run once, one big-step probe, ``long_repeats``); medians are reported, so drift
in machine load hits every strategy and the bound alike. The headline is ``vs_measured_bound``: TTFT over the
bound built from this run's measurements; the cost model's T* is reported beside it.
"""

from __future__ import annotations

import gc
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvflow.bench.bound import (CellProbe, QueryTimes, batch_bound, batch_mean_bound, odirect_read_rate,
                                recompute_rate)
from kvflow.report import save_figure
from kvflow.pool.devices import odirect_supported
from kvflow.cost.model import CostModel
from kvflow.errors import KVFlowError
from kvflow.model.runner import ModelRunner
from kvflow.planner import STRATEGIES
from kvflow.pool import KVPool
from kvflow.restorer import Restorer, RestoreResult
from kvflow.stats import paired_ratio, percentile

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
    storage_dtype: str = "float32"   # KV records, never wider than the model (kv_record_dtype); exact on the CPU
    restorers: dict = field(default_factory=dict)
    recompute_rate: float = 0.0      # KV bytes/s of recompute at short context, measured warm at the start
    rho_basis: str = "context"       # "context": rho x the context's own recompute rate; "short": x recompute_rate
    once_from: int = 65536           # contexts this long run recompute once (its first run: rho's basis)
    long_repeats: int | None = None  # repeats at once_from and beyond (None: as many as shorter contexts)
    context_rates: dict = field(default_factory=dict)  # context key -> KV bytes/s of recomputing it (measured)
    first_recompute: dict = field(default_factory=dict)  # context key -> (result, diff, argmax ok) of that run
    stored: dict = field(default_factory=dict)      # context key -> store / reference prefill times
    links: dict = field(default_factory=dict)       # pool name -> (bytes/s, latency s) the link runs at now
    probes: dict = field(default_factory=dict)      # context key -> what its measured bound was built from
    link_hooks: dict = field(default_factory=dict)  # pool name -> set(rate, latency_s=0): a real link, not a throttle

    def basis_rate(self, key=None) -> float:
        """Rho's denominator for context ``key``: its own measured recompute rate (rho_basis "context", measured by
        ``measure_recompute``) or the short-context rate."""
        if self.rho_basis == "context" and key is not None:
            return self.measure_recompute(key)
        return self.recompute_rate

    def measure_recompute(self, key) -> float:
        """KV bytes/s of recomputing context ``key`` whole: one recompute restore, measured once per run and kept
        (checked against the reference like every restore; it is recompute's only run at ``once_from`` and
        beyond)."""
        if key not in self.context_rates:
            ctx, query = self.contexts[key]
            gc.collect()
            if self.runner.device.type != "cpu":
                # a GPU's first chunked pass pays kernel selection and allocator growth: an H200 took 1.56 s for a
                # 16K recompute that then ran in 0.26 s (docs/GPU.md). A CPU has no such first pass; at 128K one
                # more recompute there would cost minutes.
                self.restorer("memory").restore(ctx, query, "recompute")
            out = self.restorer("memory").restore(ctx, query, "recompute")
            diff, ok = kv_diff(out, self.refs[key]), out.logits.argmax().item() == self.refs[key][1].argmax().item()
            out.kv = None
            self.first_recompute[key] = (out, diff, ok)
            self.context_rates[key] = ctx.numel() * self.runner.kv_bytes_per_token() / out.timings.ttft_s
        return self.context_rates[key]

    def set_link(self, pool_name: str, rho: float | None, latency_s: float = 0.0, key=None) -> float:
        """Throttle ``pool_name`` to rho x the basis rate of context ``key`` (+ a per-read latency); None:
        unthrottled (a real disk: its rate is measured with raw O_DIRECT reads when a bound needs it). Returns
        bytes/s. A pool with a ``link_hooks`` entry has a real link instead (bench/link_bench.py: tc), set the same
        way."""
        pool = self.pools[pool_name]
        throttle = self.link_hooks.get(pool_name, pool.set_throttle)
        if rho is None:
            throttle(None)
            self.links[pool_name] = (None, 0.0)
            return float("nan")
        rate = rho * self.basis_rate(key)
        if latency_s:
            throttle(rate, latency_s=latency_s)
        else:
            throttle(rate)
        self.links[pool_name] = (rate, latency_s)
        return rate

    def link_rate(self, pool_name: str, n: int) -> float:
        """The link's physical rate for the bound: what the throttle enforces, or the raw disk measured alone."""
        rate, _ = self.links.get(pool_name, (None, 0.0))
        if rate is not None:
            return rate
        cell = self.restorer(pool_name).io_model(calibrated=False).cell_bytes
        nbytes = (n // self.chunk_tokens) * self.runner.num_layers * cell
        return odirect_read_rate(str(Path(self.tmp.name) / "disk.img"), nbytes)

    def restorer(self, pool_name: str) -> Restorer:
        """One restorer per pool for the whole run, so its run-time calibration carries from point to point."""
        if pool_name not in self.restorers:
            self.restorers[pool_name] = Restorer(self.runner, self.pools[pool_name], cost=self.cost,
                                                 storage_dtype=self.storage_dtype)
        return self.restorers[pool_name]

    def add_context(self, n: int, key=None, seed: int | None = None) -> None:
        """Store an ``n``-token context (random tokens from ``seed``) under ``key`` (default: n) in every pool and
        keep the reference prefill. A pool that cannot keep all of it would turn loads into recomputes: error."""
        key = n if key is None else key
        if key in self.contexts:
            return
        seed = n if seed is None else seed
        ctx = context(n, seed, self.runner.config.vocab_size)
        query = context(self.query_len, seed + 1, self.runner.config.vocab_size)
        self.contexts[key] = (ctx, query)
        t0 = time.perf_counter()
        self.refs[key] = self.runner.reference_prefill(torch.cat([ctx, query]))
        self.stored[key] = {"reference_s": time.perf_counter() - t0, "store_s": {}, "store_put_over_prefill": {}}
        for name in self.pools:      # the reference's KV is stored: one full prefill per context, not one per pool
            restorer = self.restorer(name)
            st = restorer.store(ctx, kv=self.refs[key][0])
            self.stored[key]["store_s"][name] = st.seconds
            self.stored[key]["store_put_over_prefill"][name] = ((st.seconds - st.prefill_s)
                                                                / self.stored[key]["reference_s"])
            held = self.pools[name].longest_prefix(ctx, self.runner.fingerprint, restorer.groups)
            if held < n // self.chunk_tokens * self.chunk_tokens:
                raise KVFlowError(f"benchmark pool {name!r} holds {held} of {n} tokens: too small for the contexts")

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        if self.tmp is not None:
            self.tmp.cleanup()


def make_bench(runner: ModelRunner, cost: CostModel, lengths, *, chunk_tokens: int = 256, query_len: int = 32,
               disk_dir: str | None = None, progress: Progress = lambda s: None, store: bool = True,
               storage_dtype: str = "float32", rho_basis: str = "context", once_from: int = 65536,
               long_repeats: int | None = None) -> Bench:
    """A throttled memory pool (two devices, striped) and, with ``disk_dir``, an O_DIRECT extent file there, sized
    for contexts of ``lengths`` (stored now unless ``store`` is false)."""
    kv = runner.kv_bytes_per_token()
    need = ((int(sum(lengths) * kv * 1.3) >> 20) + 64) << 20  # whole MiB: extent devices want aligned sizes
    if rho_basis not in ("context", "short"):
        raise KVFlowError(f"unknown rho basis {rho_basis!r}: use context or short")
    bench = Bench(runner, cost, chunk_tokens, query_len, storage_dtype=storage_dtype, rho_basis=rho_basis,
                  once_from=once_from, long_repeats=long_repeats)
    progress("measuring the recompute rate (rho's denominator)")
    bench.recompute_rate = recompute_rate(runner, chunk_tokens)
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
    for n in sorted(set(lengths)) if store else ():
        progress(f"storing a {n}-token context (its reference prefill, stored in every pool)")
        bench.add_context(n)
    return bench


PROBE = "(bound probe)"


def measure(bench: Bench, pool_name: str, n: int, strategies, repeats: int, progress: Progress,
            label: str) -> dict[str, dict]:
    """Median TTFT etc. of each strategy on the ``n``-token context, and the measured bound. Strategies and one
    bound probe are interleaved and their order rotates every repeat (nothing always runs first or last); the heap
    is collected before each restore; each result is checked against the reference and its KV dropped at once, so
    memory stays flat."""
    restorer = bench.restorer(pool_name)
    ctx, query = bench.contexts[n]
    ref_argmax = bench.refs[n][1].argmax().item()
    runs: dict[str, list[tuple[RestoreResult, float, bool]]] = {s: [] for s in strategies}
    once = n >= bench.once_from and "recompute" in runs      # recompute (no link) runs once, first, at length
    if once:
        bench.measure_recompute(n)
        runs["recompute"].append(bench.first_recompute[n])
    probe = CellProbe(bench.chunk_tokens, bench.runner.num_layers)
    order = [s for s in strategies if not (once and s == "recompute")] + [PROBE]
    ids = torch.cat([ctx, query])
    step = restorer.planner_config.max_step
    long = n >= bench.once_from          # each pass is minutes: one probe, big steps only (bound.CellProbe.probe)
    if long and bench.long_repeats is not None:
        repeats = bench.long_repeats
    for rep in range(repeats):
        for s in order[rep % len(order):] + order[:rep % len(order)]:
            if s == PROBE and long and probe.chunks:
                continue
            progress(f"{label}: {'measuring the bound' if s == PROBE else s} ({rep + 1}/{repeats})")
            gc.collect()
            if s == PROBE:
                probe.probe(bench.runner, ids, n // bench.chunk_tokens, step, single=not long)
                continue
            out = restorer.restore(ctx, query, s)
            diff, ok = kv_diff(out, bench.refs[n]), out.logits.argmax().item() == ref_argmax
            out.kv = None
            runs[s].append((out, diff, ok))
    link = bench.link_rate(pool_name, n)
    cell = restorer.io_model(calibrated=False).cell_bytes
    bound = probe.bound(link, cell)
    rows = {}
    for s, outs in runs.items():
        mid = sorted(outs, key=lambda o: o[0].timings.ttft_s)[len(outs) // 2][0]
        t = mid.timings
        ttft = statistics.median(o.timings.ttft_s for o, _, _ in outs)
        rows[s] = {
            "strategy": s, "context": n, "ttft_s": ttft,
            "ttft_runs": [o.timings.ttft_s for o, _, _ in outs], "predicted_s": t.predicted_ttft_s,
            "measured_bound_s": bound, "vs_measured_bound": ttft / bound,
            "model_bound_s": t.lower_bound_s,
            "vs_model_bound": statistics.median(o.timings.vs_lower_bound for o, _, _ in outs),
            "restore_s": t.restore_s, "compute_util": t.compute_util, "io_util": t.io_util,
            "blocked_io_s": t.blocked_io_s, "lookup_s": t.lookup_s, "plan_s": t.plan_s,
            "max_abs_diff": max(d for _, d, _ in outs), "argmax_ok": all(ok for _, _, ok in outs),
            "plan": mid.plan.describe(), "chose": mid.plan.notes.get("chose", s),
            "plan_runs": [o.plan.describe() for o, _, _ in outs],      # cacheflow's choice may differ per repeat
            "band": mid.plan.notes.get("band"),
            "runs": len(outs), "io_busy_s": t.io_util * t.restore_s, "compute_busy_s": t.compute_util * t.restore_s,
            "fallback_chunks": mid.fallback_chunks, "_result": mid,
        }
    bench.probes[n] = {"link_bytes_per_s": link, "cell_bytes": cell, "measured_bound_s": bound,
                       "context_recompute_rate_mib_s": bench.context_rates.get(n, float("nan")) / 2**20,
                       "short_recompute_rate_mib_s": bench.recompute_rate / 2**20, **bench.stored.get(n, {}),
                       **probe.summary()}
    return rows


PAIRED = ("cake", "token")


def speedups(rows: dict[str, dict]) -> dict:
    """cacheflow against each other strategy, and how far this point can resolve a difference: ``repeat_spread`` is
    the median, over strategies, of max / min of one strategy's repeats (the same plan run again); when cacheflow
    chose the best other's plan (``same_plan_as_best``) their ratio is that noise plus cacheflow's planning time.
    ``paired``: cacheflow's TTFT over cake's and token's as the paired ratio of interleaved repeats with its 95%
    interval (stats.paired_ratio; < 1: cacheflow faster)."""
    if "cacheflow" not in rows or len(rows) < 2:
        return {"vs": {}, "paired": {}}
    cf = rows["cacheflow"]["ttft_s"]
    others = {s: r["ttft_s"] for s, r in rows.items() if s != "cacheflow"}
    best = min(others, key=others.get)
    spreads = [max(r["ttft_runs"]) / min(r["ttft_runs"]) for r in rows.values() if min(r["ttft_runs"]) > 0]
    paired = {}
    for s in PAIRED:
        if s in rows and len(rows[s]["ttft_runs"]) == len(rows["cacheflow"]["ttft_runs"]):
            pr = paired_ratio(rows["cacheflow"]["ttft_runs"], rows[s]["ttft_runs"])
            paired[s] = {"ratio": pr.ratio, "lo": pr.lo, "hi": pr.hi, "pairs": pr.pairs}
    return {"vs": {s: t / cf for s, t in others.items()}, "best_other": best, "paired": paired,
            "cacheflow_vs_best_other": cf / others[best],
            "same_plan_as_best": rows["cacheflow"]["chose"] == best,
            "repeat_spread": statistics.median(spreads) if spreads else float("nan")}


def public(rows: dict[str, dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows.values()]


def sweep_rho(bench: Bench, n: int, rhos, strategies, repeats: int, progress: Progress,
              latencies=()) -> list[dict]:
    """Throttled memory pool at each rho, then at rho = 1 with each per-read latency in ``latencies`` (seconds: a
    link's request latency, which many small reads pay), then "disk": the real disk, unthrottled, if the bench
    has one."""
    points = []
    for rho, latency in [(r, 0.0) for r in rhos] + [(1.0, lat) for lat in latencies]:
        rate = bench.set_link("memory", rho, latency, key=n)
        label = f"{n} tokens, rho={rho:g}" + (f", {latency * 1e6:.0f} us/read" if latency else "")
        rows = measure(bench, "memory", n, strategies, repeats, progress, label)
        points.append({"rho": rho, "latency_s": latency, "link_bytes_per_s": rate,
                       "pool": "memory (throttled)" + (f" + {latency * 1e6:.0f} us per read" if latency else ""),
                       "context": n, "rows": rows, "bound": bench.probes[n]})
    if "disk" in bench.pools:
        # a real disk varies far more run to run than a throttle: more repeats
        bench.set_link("disk", None)
        rows = measure(bench, "disk", n, strategies, max(3 * repeats, 7), progress, f"{n} tokens, real disk")
        link = bench.probes[n]["link_bytes_per_s"]
        points.append({"rho": link / bench.basis_rate(n), "latency_s": 0.0, "link_bytes_per_s": link,
                       "pool": "disk (unthrottled, O_DIRECT)", "context": n, "rows": rows, "bound": bench.probes[n]})
    return points


def sweep_length(bench: Bench, lengths, rho: float, strategies, repeats: int, progress: Progress) -> list[dict]:
    points = []
    for n in lengths:
        rate = bench.set_link("memory", rho, key=n)
        rows = measure(bench, "memory", n, strategies, repeats, progress, f"{n} tokens, rho={rho:g}")
        points.append({"rho": rho, "latency_s": 0.0, "link_bytes_per_s": rate, "pool": "memory (throttled)",
                       "context": n, "rows": rows, "bound": bench.probes[n]})
    return points


def crossover(points: list[dict]) -> dict:
    """Measured: the shortest context from which token split beats layer split (and stays ahead)."""
    by_len = sorted(points, key=lambda p: p["context"])
    if not {"token", "layer", "cacheflow"} <= set(by_len[0]["rows"]) if by_len else True:
        return {"measured_tokens": None, "points": [], "note": "token, layer and cacheflow were not all run"}
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
def batch_lengths(size: int, seed: int, lo: int = 512, hi: int | None = None, chunk: int = 256) -> list[int]:
    """Mixed context lengths, log-uniform in [lo, hi], rounded to whole chunks (documented in BENCHMARKS.md). ``hi``
    defaults to 8192 for up to 8 requests and 4096 beyond (a batch of 32 whose percentiles mean something, in
    minutes on this machine)."""
    hi = hi or (8192 if size <= 8 else 4096)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(size, generator=g).tolist()
    return [max(chunk, int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))) / chunk)) * chunk)
            for x in u]


def ttft_stats(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


BATCH_MODES = (("cacheflow", "batch"), ("cacheflow", "sjf"), ("cacheflow", "fcfs"), ("cake", "fcfs"))


def measure_batch(bench: Bench, lengths: list[int], rho: float, repeats: int, progress: Progress) -> dict:
    """Batch-aware cacheflow vs per-request cacheflow in shortest-job-first order (the reordering alone), in arrival
    order, and FCFS cake; all requests arriving together, every request its own context. One probe of the measured
    whole-batch bound runs among the modes each repeat: the longest context's cells (a cell costs the same at the
    same position whatever its tokens) and every request's query, measured alone."""
    keys = [("batch", len(lengths), i) for i in range(len(lengths))]
    for i, (n, key) in enumerate(zip(lengths, keys)):
        progress(f"storing request {i + 1}/{len(lengths)} of the batch ({n} tokens)")
        bench.add_context(n, key, seed=1000 * len(lengths) + i)
    rate = bench.set_link("memory", rho)
    restorer = bench.restorer("memory")
    requests = [bench.contexts[key] for key in keys]
    C = bench.chunk_tokens
    longest = max(range(len(requests)), key=lambda r: lengths[r])
    probe = CellProbe(C, bench.runner.num_layers)
    queries = [probe.own if r == longest else QueryTimes() for r in range(len(requests))]
    others = [(queries[r], torch.cat(requests[r])[n // C * C:], n // C * C)
              for r, n in enumerate(lengths) if r != longest]
    modes = list(BATCH_MODES) + [(PROBE, "")]
    runs: dict[str, list[list[float]]] = {f"{s}/{m}": [] for s, m in BATCH_MODES}
    worst_diff, model_bounds = 0.0, []
    step = restorer.planner_config.max_step
    for rep in range(repeats):
        for s, m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            progress(f"batch of {len(lengths)}: {'measuring the bound' if s == PROBE else f'{s}/{m}'} "
                     f"({rep + 1}/{repeats})")
            gc.collect()
            if s == PROBE:
                probe.probe(bench.runner, torch.cat(requests[longest]), lengths[longest] // C, step, others)
                continue
            outs = restorer.restore_batch(requests, s, m)
            runs[f"{s}/{m}"].append([o.timings.ttft_s for o in outs])
            if m == "batch":
                model_bounds.append(outs[0].plan.lower_bound_s)
            worst_diff = max([worst_diff] + [kv_diff(o, bench.refs[key]) for o, key in zip(outs, keys)])
            for o in outs:
                o.kv = None
    cell = restorer.io_model(calibrated=False).cell_bytes
    bound = batch_bound(probe, [(n // C, q) for n, q in zip(lengths, queries)], rate, cell)
    mean_bound = batch_mean_bound(probe, [(n // C, q) for n, q in zip(lengths, queries)], rate, cell)
    result = {"lengths": lengths, "rho": rho, "link_bytes_per_s": rate, "max_abs_diff": worst_diff, "modes": {},
              "note": "P99 of a batch of 8 or fewer is its maximum" if len(lengths) <= 8 else ""}
    for name, reps in runs.items():
        per_rep = [ttft_stats(r) for r in reps]
        result["modes"][name] = {k: statistics.median(p[k] for p in per_rep) for k in per_rep[0]}
    batch, sjf = result["modes"]["cacheflow/batch"], result["modes"]["cacheflow/sjf"]
    fcfs = result["modes"]["cake/fcfs"]
    stats = ("mean", "p50", "p90", "p99", "max")
    result["batch_vs_sjf"] = {k: batch[k] / sjf[k] for k in stats}
    result["batch_vs_fcfs_cake"] = {k: batch[k] / fcfs[k] for k in stats}
    # no schedule finishes the whole batch before the measured bound: its ratio to SJF's last TTFT is the most any
    # scheduler could gain on the tail over shortest-first per-request restoration here
    result["measured_bound_s"] = bound
    # and no schedule's mean is below the mean bound: SJF's distance from it is the most any scheduler can gain
    # over reordering on the mean here
    result["measured_mean_bound_s"] = mean_bound
    result["sjf_mean_vs_mean_bound"] = sjf["mean"] / mean_bound
    result["batch_mean_vs_mean_bound"] = batch["mean"] / mean_bound
    result["measured_bound_vs_sjf_max"] = bound / sjf["max"]
    result["batch_max_vs_measured_bound"] = batch["max"] / bound
    result["model_bound_s"] = statistics.median(model_bounds)
    return result


# ----------------------------------------------------------------------------------------------- output
def plot_rho(points: list[dict], path: Path, title: str) -> None:
    """TTFT of every strategy vs rho (with T*), and each strategy's TTFT over cacheflow's."""
    swept = [p for p in points if p["pool"].startswith("memory") and not p.get("latency_s")]
    rhos = [p["rho"] for p in swept]
    strategies = list(swept[0]["rows"])

    def draw(axes):
        ax, sp = axes
        for s in strategies:
            ax.plot(rhos, [p["rows"][s]["ttft_s"] for p in swept], marker="o", label=s,
                    lw=2.5 if s == "cacheflow" else 1.2)
            if s != "cacheflow":
                sp.plot(rhos, [p["rows"][s]["ttft_s"] / p["rows"]["cacheflow"]["ttft_s"] for p in swept],
                        marker="o", label=f"{s} / cacheflow")
        ax.plot(rhos, [p["rows"]["cacheflow"]["measured_bound_s"] for p in swept], "k--", lw=1,
                label="measured bound")
        ax.plot(rhos, [p["rows"]["cacheflow"]["model_bound_s"] for p in swept], "k:", lw=1, label="model T*")
        ax.set(xscale="log", yscale="log", xlabel="rho = I/O bandwidth / recompute rate", ylabel="TTFT (s)",
               title=title)
        sp.axhline(1.0, color="k", lw=0.8)
        sp.set(xscale="log", xlabel="rho", ylabel="TTFT ratio (>1: cacheflow faster)")
        ax.set_xscale("log", base=2)
        sp.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        sp.legend(fontsize=7)

    save_figure(path, draw, panels=2, size=(6.0, 4.5))


def plot_lengths(points: list[dict], path: Path, title: str) -> None:
    """TTFT of every strategy vs context length (log-log) with the measured bound dashed, and TTFT / bound."""
    lens = [p["context"] for p in points]
    names = list(dict.fromkeys(s for p in points for s in p["rows"]))     # a strategy left out at a length: a gap

    def at(s: str, field: str) -> list[float]:
        return [p["rows"][s][field] if s in p["rows"] else math.nan for p in points]

    def draw(axes):
        ax, rel = axes
        for s in names:
            lw = 2.5 if s == "cacheflow" else 1.2
            ax.plot(lens, at(s, "ttft_s"), marker="o", label=s, lw=lw)
            rel.plot(lens, at(s, "vs_measured_bound"), marker="o", label=s, lw=lw)
        ax.plot(lens, [p["bound"]["measured_bound_s"] for p in points], "k--", lw=1, label="measured bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="context tokens", ylabel="TTFT (s)", title=title)
        rel.set_xscale("log", base=2)
        rel.axhline(1.0, color="k", ls="--", lw=0.8)
        rel.set(xlabel="context tokens", ylabel="TTFT / measured bound")
        ax.legend(fontsize=7)
        rel.legend(fontsize=7)

    save_figure(path, draw, panels=2, size=(6.0, 4.5))


def plot_batch(results: list[dict], path: Path, title: str) -> None:
    """Mean / P50 / P90 / P99 TTFT of each scheduler (and the measured whole-batch bound), one panel per batch."""
    def draw(axes):
        for ax, res in zip(axes, results):
            modes = list(res["modes"])
            for j, stat in enumerate(("mean", "p50", "p90", "p99")):
                ax.bar([i + 0.2 * j for i in range(len(modes))], [res["modes"][m][stat] for m in modes],
                       width=0.2, label=stat)
            ax.axhline(res["measured_bound_s"], color="k", ls="--", lw=1, label="measured bound (whole batch)")
            ax.set_xticks([i + 0.3 for i in range(len(modes))], modes, rotation=20, fontsize=7)
            ax.set(title=f"batch of {len(res['lengths'])}", ylabel="TTFT (s)")
            ax.legend(fontsize=7, loc="upper left")
        axes[0].figure.suptitle(title, fontsize=10)

    save_figure(path, draw, panels=len(results), size=(4.5, 4.2))


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
           "public"]


# ------------------------------------------------------------------------------------------ planning at length
def planning_at_length(runner: ModelRunner, cost: CostModel, lengths, *, rho: float = 1.0, query_len: int = 32,
                       chunk_tokens: int = 256, batch: tuple[int, int] = (8, 32768), repeats: int = 3) -> dict:
    """Planning time of every strategy against the TTFT it plans, from the cost model alone (no compute, no pool):
    the link at rho x the KV bytes/s of recomputing each context as the model predicts it (rho's "context" basis);
    and the batch scheduler on ``batch`` = (requests, tokens each). Times are the fastest of ``repeats``."""
    from kvflow.chunks.record import HEADER_SIZE
    from kvflow.planner import IOModel, Planner, Request
    from kvflow.planner.batch import plan_batch

    L, C = runner.num_layers, chunk_tokens
    cell = C * runner.shape.kv_bytes_per_token_layer("float32") + HEADER_SIZE

    def planner_for(n: int) -> Planner:
        free = Planner(cost, IOModel(float("inf"), cell), L, C)
        recompute = free.plan("recompute", Request(n, query_len, n // C)).predicted.ttft_s
        return Planner(cost, IOModel(rho * n * runner.kv_bytes_per_token() / recompute, cell), L, C)

    def timed(fn):
        best, out = float("inf"), None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
        return best, out

    points = []
    for n in lengths:
        planner, req = planner_for(n), Request(n, query_len, n // C)
        rows = []
        for s in STRATEGIES:
            plan_s, plan = timed(lambda: planner.plan(s, req))
            rows.append({"strategy": s, "plan_s": plan_s, "predicted_ttft_s": plan.predicted.ttft_s,
                         "share_of_ttft": plan_s / plan.predicted.ttft_s, "plan": plan.describe()})
        points.append({"context": n, "cells": (n // C) * L, "rows": rows})
    size, n = batch
    planner = planner_for(n)
    reqs = [Request(n, query_len, n // C) for _ in range(size)]
    plan_s, bp = timed(lambda: plan_batch(planner, reqs))
    return {"rho": rho, "lengths": points,
            "batch": {"requests": size, "context": n, "plan_s": plan_s, "first_ttft_s": min(bp.predicted_ttft),
                      "mean_ttft_s": statistics.mean(bp.predicted_ttft),
                      "share_of_first_ttft": plan_s / min(bp.predicted_ttft)}}


# --------------------------------------------------------------------------------------------- bounded memory
def memory_point(model: str, n: int, pool_dir: str, phase: str, strategy: str = "cacheflow", rho: float = 1.0,
                 query_len: int = 32, chunk_tokens: int = 256, exact: bool = True) -> dict:
    """One phase of the peak-RSS measurement of a restore of an ``n``-token context (``memory_points`` runs each
    in a fresh child, so a peak is that phase's own): "store" prefills the context into an O_DIRECT extent file
    under ``pool_dir`` (the pool is not resident); "restore" opens that pool, notes its RSS (interpreter, torch,
    weights, index), restores once with the link at rho x the KV bytes/s the cost model predicts for recomputing
    the context, and reads VmHWM when the restore returns. Exactness is checked after the peak is read: the
    reference prefill's own KV is not counted."""
    from kvflow.cli.restore_cmds import ensure_cost
    from kvflow.model import load_model
    from kvflow.stats import proc_status_bytes, rss_bytes

    runner = load_model(model)
    runner.check_context_len(n + query_len)
    cost = ensure_cost(runner, n + query_len)
    need = ((int(n * runner.kv_bytes_per_token() * 1.3) >> 20) + 64) << 20
    pool = KVPool.open({"chunk_tokens": chunk_tokens, "durability": "relaxed",
                        "index_dir": str(Path(pool_dir) / "index"),
                        "devices": [{"type": "extent", "capacity": need, "direct": odirect_supported(pool_dir),
                                     "path": str(Path(pool_dir) / "disk.img")}]})
    try:
        restorer = Restorer(runner, pool, cost=cost)
        ctx = context(n, n, runner.config.vocab_size)
        query = context(query_len, n + 1, runner.config.vocab_size)
        if phase == "store":
            t0 = time.perf_counter()
            stored = restorer.store(ctx)
            return {"store_s": time.perf_counter() - t0, "bytes": stored.bytes_written,
                    "store_put_over_prefill": (stored.seconds - stored.prefill_s) / max(stored.prefill_s, 1e-9)}
        recompute = restorer.planner().plan("recompute", restorer.lookup(ctx, query_len)[0]).predicted.ttft_s
        pool.set_throttle(rho * n * runner.kv_bytes_per_token() / recompute)
        weights = runner.num_parameters * runner.dtype.itemsize
        kv = (n + query_len) * runner.kv_bytes_per_token()
        gc.collect()
        base = rss_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                      # VmHWM := VmRSS now
        out = restorer.restore(ctx, query, strategy)
        peak = proc_status_bytes("VmHWM:")
        result = {"model": model, "context": n, "strategy": strategy, "plan": out.plan.describe(),
                  "ttft_s": out.timings.ttft_s, "rss_before_restore": base, "peak_rss": peak, "kv_bytes": kv,
                  "weights_bytes": weights,
                  # what the restore added, over the KV it must hold; and the whole process over KV + weights
                  # (the interpreter, torch and the index: rss_before_restore - weights)
                  "restore_growth_over_kv": (peak - base) / kv,
                  "peak_over_kv_weights": (peak - base + weights) / (kv + weights),
                  "peak_raw_over_kv_plus_before": peak / (kv + base)}
        if exact:
            ref_kv, ref_logits = runner.reference_prefill(torch.cat([ctx, query]))
            worst = (out.logits - ref_logits).abs().max().item()
            for (k, v), (rk, rv) in zip(out.kv, ref_kv):
                worst = max(worst, (k - rk).abs().max().item(), (v - rv).abs().max().item())
            result["max_abs_diff"] = worst
            result["argmax_ok"] = out.logits.argmax().item() == ref_logits.argmax().item()
        return result
    finally:
        pool.close()


def memory_points(model: str, lengths, strategy: str = "cacheflow", progress: Progress = lambda s: None,
                  disk_dir: str | None = None, exact_below: int = 65536) -> list[dict]:
    """Peak RSS of one restore at each length: the context stored by one child, restored by a fresh one; checked
    against a reference prefill below ``exact_below`` tokens (beyond, that prefill alone is minutes; the restore
    bench checks every restore it times at those lengths)."""
    import json
    import os
    import subprocess
    import sys

    def child(n: int, tmp: str, phase: str) -> dict:
        code = ("import json; from kvflow.bench.restore_bench import memory_point; "
                f"print(json.dumps(memory_point({model!r}, {n}, {tmp!r}, {phase!r}, {strategy!r}, "
                f"exact={n < exact_below})))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
        if done.returncode != 0:
            raise KVFlowError(f"memory point {n} ({phase}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    points = []
    for n in lengths:
        with tempfile.TemporaryDirectory(prefix="kvflow-mem-", dir=disk_dir) as tmp:
            progress(f"memory: storing a {n}-token context (child process)")
            stored = child(n, tmp, "store")
            progress(f"memory: peak RSS of a {n}-token {strategy} restore (fresh child process)")
            points.append({**child(n, tmp, "restore"), "store_s": stored["store_s"],
                           "store_put_over_prefill": stored["store_put_over_prefill"]})
    return points
