"""``kvflow bench restore`` end to end: build the model, get its cost profile, sweep rho (or links in Gbit/s) and
context length with every strategy — or, with batch sizes, the batch schedulers — write the JSON and PNGs, and the
headline ratios.

    run = restore_run(RestoreRunOptions(context_len=8192, rhos=[0.5, 1, 2]), cost_for=ensure_cost)
    print_restore_run(run)                              # run.folder holds restore.json and the PNGs
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rich.table import Table

from kvflow.bench import restore_bench as rb
from kvflow.bench.restore_demo import strategy_table
from kvflow.demo.job import console, status


@dataclass(slots=True)
class RestoreRunOptions:
    """What ``kvflow bench restore`` takes, parsed (the option help in cli/restore_cmds.py says what each means);
    ``batch_sizes`` non-empty runs the batch benchmark instead of the sweeps."""
    model: str = "qwen2.5-0.5b@layers=4"
    context_len: int = 8192
    rhos: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0, 8.0])
    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192])
    query_len: int = 32
    repeats: int = 3
    latencies: list[float] = field(default_factory=lambda: [0.0001, 0.001])
    disk: bool = True
    gbps: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    out: Path | None = None
    strategies: list[str] = field(default_factory=list)   # empty: every strategy
    rho_basis: str = "context"       # rho x the context's own recompute rate, or x the short-context rate ("short")
    once_from: int = 65536           # contexts this long run recompute once, one big-step bound probe
    long_repeats: int | None = None  # repeats of the other strategies there (None: ``repeats``)
    planning: bool = False           # only time the planners at ``lengths`` (+ a batch of 8 x 32K): no compute
    memory: bool = False             # only the peak RSS of one cacheflow restore at each of ``lengths``


@dataclass(slots=True)
class RestoreRun:
    """A finished run: ``results`` as written to ``folder/restore.json`` (``restore-batch.json`` for batches)
    before private fields are dropped; ``to_json()`` is what ``--json`` prints."""
    options: RestoreRunOptions
    folder: Path
    results: dict

    @property
    def batches(self) -> bool:
        return "batches" in self.results

    def to_json(self) -> dict:
        return rb.jsonable(self.results)


def restore_run(o: RestoreRunOptions, cost_for: Callable) -> RestoreRun:
    """Run ``o``; ``cost_for(runner, max_position)`` gives the cost model."""
    from kvflow.model import load_model
    from kvflow.report import out_dir, write_json

    folder = out_dir("bench-restore", o.out)
    status(f"building {o.model}")
    runner = load_model(o.model)
    longest = max([o.context_len, *o.lengths] + ([8192] if o.batch_sizes else []) + ([32768] if o.planning else []))
    runner.check_context_len(longest + o.query_len)     # before any profile or allocation
    cost = cost_for(runner, longest)
    result: dict = {"model": o.model, "chunk_tokens": 256, "query": o.query_len, "repeats": o.repeats,
                    "threads": cost.threads, "profiled_recompute_rate_mib_s": cost.short_context_rate() / 2**20}
    if o.memory:
        result["memory"] = rb.memory_points(o.model, o.lengths, progress=status, disk_dir=str(folder),
                                            exact_below=o.once_from)
        write_json(folder / "memory.json", rb.jsonable(result))
    elif o.planning:
        result["planning"] = rb.planning_at_length(runner, cost, o.lengths, query_len=o.query_len)
        write_json(folder / "planning.json", rb.jsonable(result))
    elif o.batch_sizes:
        _batches(o, runner, cost, result, folder)
        write_json(folder / "restore-batch.json", rb.jsonable(result))
    else:
        _sweeps(o, runner, cost, result, folder)
        write_json(folder / "restore.json", rb.jsonable(result))
    return RestoreRun(o, folder, result)


def _batches(o: RestoreRunOptions, runner, cost, result: dict, folder: Path) -> None:
    batches = [rb.batch_lengths(size, seed=size) for size in o.batch_sizes]
    bench = rb.make_bench(runner, cost, [n for lengths in batches for n in lengths], query_len=o.query_len,
                          progress=status, store=False)
    try:
        result["recompute_rate_mib_s"] = bench.recompute_rate / 2**20
        result["batches"] = [rb.measure_batch(bench, lengths, 1.0, o.repeats, status) for lengths in batches]
    finally:
        bench.close()
    rb.plot_batch(result["batches"], folder / "batch.png", f"{o.model}, rho=1: batch-aware vs SJF vs FCFS")


def _sweeps(o: RestoreRunOptions, runner, cost, result: dict, folder: Path) -> None:
    from kvflow.executor import plot_timeline
    from kvflow.planner import STRATEGIES

    rho_list, n = list(o.rhos), o.context_len
    strategies = tuple(o.strategies) or STRATEGIES
    bench = rb.make_bench(runner, cost, [n, *o.lengths], query_len=o.query_len,
                          disk_dir=str(folder) if o.disk else None, progress=status, rho_basis=o.rho_basis,
                          once_from=o.once_from, long_repeats=o.long_repeats)
    try:
        result["recompute_rate_mib_s"] = bench.recompute_rate / 2**20
        result["rho_basis"], result["strategies"], result["recompute_once_from"] = (o.rho_basis, list(strategies),
                                                                                    o.once_from)
        if o.gbps:               # the same sweep, its points named by link rate: rho follows from this run's rate
            rho_list = [g * 1e9 / 8 / bench.basis_rate(n) for g in o.gbps]
            result["gbps"] = o.gbps
            status("links " + ", ".join(f"{g:g} Gbps = rho {r:.3g}" for g, r in zip(o.gbps, rho_list)))
        result["rho_sweep"] = rb.sweep_rho(bench, n, rho_list, strategies, o.repeats, status, o.latencies)
        # the rho = 1 point of the sweep is the length sweep's point at context_len: measured once
        reuse = next((p for p in result["rho_sweep"] if p["rho"] == 1.0 and not p["latency_s"]
                      and p["pool"].startswith("memory")), None) if n in o.lengths else None
        short = [m for m in o.lengths if m != n or reuse is None]
        result["length_sweep"] = sorted(rb.sweep_length(bench, sorted(short), 1.0, strategies, o.repeats, status)
                                        + ([reuse] if reuse is not None else []), key=lambda p: p["context"])
        result["context_recompute_rate_mib_s"] = {k: v / 2**20 for k, v in bench.context_rates.items()}
        bench.set_link("memory", 1.0, key=n)
        predicted_crossover = bench.restorer("memory").planner().crossover_length(o.query_len)
    finally:
        bench.close()
    points = list({id(p): p for p in result["rho_sweep"] + result["length_sweep"]}.values())  # one may be in both
    for point in points:
        point["speedups"] = rb.speedups(point["rows"])
    result["crossover"] = rb.crossover(result["length_sweep"])
    result["crossover"]["predicted_tokens"] = predicted_crossover
    one = next(p for p in result["rho_sweep"] if p["rho"] == 1.0) if 1.0 in rho_list else result["rho_sweep"][0]
    basis = "its own recompute" if o.rho_basis == "context" else "short-context recompute"
    rb.plot_rho(result["rho_sweep"], folder / "rho-sweep.png", f"{o.model}, {n} tokens (rho vs {basis})")
    rb.plot_lengths(result["length_sweep"], folder / "length-sweep.png", f"{o.model}, rho=1 (vs {basis})")
    result["lead_by_length"] = _lead_by_length(result["length_sweep"])
    if "cacheflow" in one["rows"]:
        cf = one["rows"]["cacheflow"]
        plot_timeline(cf["_result"].timeline, folder / "timeline.png",
                      f"cacheflow, {n} tokens, rho={one['rho']:g}: {cf['plan']}", 256)
        result["acceptance"] = _acceptance(result, one)
    for point in points:
        point["rows"] = rb.public(point["rows"])


def _lead_by_length(points: list[dict]) -> dict:
    """cacheflow's paired ratio to cake and to token at each length (< 1: cacheflow faster), and whether its lead
    grows with length (each ratio no larger than the one before, by the point estimate) — where it does not, the
    length table says so."""
    out = {}
    for s in rb.PAIRED:
        at = [(p["context"], p["speedups"]["paired"].get(s)) for p in points]
        at = [(n, r) for n, r in at if r is not None]
        if not at:
            continue
        ratios = [r["ratio"] for _, r in at]
        out[s] = {"points": [{"context": n, **r} for n, r in at],
                  "grows": all(b <= a for a, b in zip(ratios, ratios[1:]))}
    return out


def _acceptance(result: dict, one: dict) -> dict:
    rows = one["rows"]
    cf = rows["cacheflow"]["ttft_s"]
    worst_at = max(result["rho_sweep"], key=lambda p: p["speedups"].get("cacheflow_vs_best_other", 0.0))
    cross = result["crossover"]["points"]
    nan = {"ttft_s": float("nan")}
    paired = {f"rho1_cacheflow_vs_{s}_paired": f"{p['ratio']:.3f} " + (f"[{p['lo']:.3f}, {p['hi']:.3f}] "
                                                                        f"({p['pairs']} pairs)" if p["pairs"] > 1
                                                                        else "(1 pair: no interval)")
              for s, p in one["speedups"]["paired"].items()}
    return {
        "headline_rho": one["rho"],      # the rho1_* figures' point: rho = 1 when swept, else the first swept rho
        "rho_basis": result["rho_basis"],
        "rho1_cacheflow_vs_min_recompute_load": cf / min(rows.get("recompute", nan)["ttft_s"],
                                                         rows.get("load", nan)["ttft_s"]),
        "rho1_cacheflow_vs_cake": cf / rows.get("cake", nan)["ttft_s"],
        **paired,
        "rho1_cacheflow_vs_measured_bound": rows["cacheflow"]["vs_measured_bound"],
        "rho1_cacheflow_vs_model_bound": rows["cacheflow"]["vs_model_bound"],
        "rho1_cacheflow_vs_best_other": one["speedups"]["cacheflow_vs_best_other"],
        "rho1_compute_util": rows["cacheflow"]["compute_util"],
        "rho1_io_util": rows["cacheflow"]["io_util"],
        "rho1_prefix_lookup_share_of_ttft": rows["cacheflow"]["lookup_s"] / cf,
        "rho1_planning_share_of_ttft": rows["cacheflow"]["plan_s"] / cf,
        "worst_cacheflow_vs_best_other_over_sweep": worst_at["speedups"].get("cacheflow_vs_best_other"),
        "worst_point": f"{worst_at['pool']}, rho={worst_at['rho']:.3g}",
        "worst_point_same_plan_as_best": worst_at["speedups"].get("same_plan_as_best"),
        "median_repeat_spread_over_sweep": statistics.median(p["speedups"].get("repeat_spread", float("nan"))
                                                             for p in result["rho_sweep"]),
        "crossover_tokens": result["crossover"]["measured_tokens"],
        "cacheflow_vs_faster_side_at_each_length": [p["cacheflow_s"] / p["faster_side_s"] for p in cross],
        "max_abs_diff": max(r["max_abs_diff"] for p in result["rho_sweep"] + result["length_sweep"]
                            for r in p["rows"].values()),
    }


def print_restore_run(run: RestoreRun) -> None:
    """The tables of a finished run and where its files are."""
    res = run.results
    if "memory" in res:
        _print_memory(res["memory"])
        console.print(f"JSON in {run.folder}")
        return
    if "planning" in res:
        _print_planning(res["planning"])
        console.print(f"JSON in {run.folder}")
        return
    if run.batches:
        for batch in res["batches"]:
            _print_batch(batch)
        console.print(f"JSON + PNG in {run.folder}")
        return
    for point in res["rho_sweep"]:
        console.print(strategy_table(f"{run.options.model}, {point['context']} tokens, {point['pool']}, "
                                     f"rho={point['rho']:.3g} (link {point['link_bytes_per_s'] / 2**20:,.1f} MiB/s)",
                                     {r["strategy"]: r for r in point["rows"]}))
    _print_lengths(res)
    if "acceptance" in res:
        _print_acceptance(res["acceptance"])
    console.print(f"JSON + PNG (rho-sweep, length-sweep, timeline) in {run.folder}")


def _print_lengths(result: dict) -> None:
    once = result["recompute_once_from"]
    basis = "each context's" if result["rho_basis"] == "context" else "short-context"
    table = Table(title=f"context length sweep at rho=1, rho vs {basis} recompute (TTFT s; recompute one run "
                        f"at >= {once} tokens)")
    points = result["length_sweep"]
    strategies = [r["strategy"] for r in points[0]["rows"]]
    table.add_column("context", justify="right")
    for s in strategies:
        table.add_column(s, justify="right")
    for col in ("bound", "cf compute/I/O busy", "cf blocked I/O s", "cf/cake [95%]", "cf/token [95%]",
                "cacheflow chose"):
        table.add_column(col, justify="right" if col != "cacheflow chose" else "left")
    for p in points:
        rows = {r["strategy"]: r for r in p["rows"]}
        cf = rows.get("cacheflow")
        paired = p["speedups"].get("paired", {})

        def pr(s):
            r = paired.get(s)
            return "—" if r is None else (f"{r['ratio']:.3f}" + (f" [{r['lo']:.3f}, {r['hi']:.3f}]"
                                                                  if r["pairs"] > 1 else " (1 pair)"))
        table.add_row(str(p["context"]), *[f"{rows[s]['ttft_s']:.3f}" + ("¹" if rows[s]["runs"] == 1 else "")
                                           for s in strategies],
                      f"{p['bound']['measured_bound_s']:.3f}",
                      f"{cf['compute_util']:.0%}/{cf['io_util']:.0%}" if cf else "—",
                      f"{cf['blocked_io_s']:.3f}" if cf else "—", pr("cake"), pr("token"),
                      cf["chose"] if cf else "—")
    console.print(table)
    console.print("¹ one run (no interval); cf/x: cacheflow's TTFT over x, paired over interleaved repeats (< 1: "
                  "cacheflow faster)")
    for s, lead in result.get("lead_by_length", {}).items():
        if not lead["grows"]:
            console.print(f"cacheflow's lead over {s} does NOT grow with length here: "
                          + ", ".join(f"{q['context']}: {q['ratio']:.3f}" for q in lead["points"]))
    if result["crossover"]["measured_tokens"] is not None or result["crossover"]["points"]:
        console.print(f"measured crossover (token split beats layer split from): "
                      f"{result['crossover']['measured_tokens']}")


def _print_memory(points: list[dict]) -> None:
    table = Table(title="peak RSS of one cacheflow restore (fresh process per length; context on an O_DIRECT file)")
    for col in ("context", "KV MiB", "weights MiB", "RSS before MiB", "peak MiB", "growth / KV",
                "(growth + weights) / (KV + weights)", "store put / prefill", "max |diff|"):
        table.add_column(col, justify="right")
    mib = lambda b: f"{b / 2**20:,.1f}"
    for p in points:
        table.add_row(str(p["context"]), mib(p["kv_bytes"]), mib(p["weights_bytes"]), mib(p["rss_before_restore"]),
                      mib(p["peak_rss"]), f"{p['restore_growth_over_kv']:.2f}", f"{p['peak_over_kv_weights']:.2f}",
                      f"{p['store_put_over_prefill']:.3f}", f"{p.get('max_abs_diff', float('nan')):.1e}")
    console.print(table)


def _print_planning(pl: dict) -> None:
    table = Table(title=f"planning time at length (cost model only, rho={pl['rho']:g} vs each context's predicted "
                        f"recompute): ms / share of the TTFT planned")
    table.add_column("strategy")
    for p in pl["lengths"]:
        table.add_column(f"{p['context']} ({p['cells']} cells)", justify="right")
    for i, row in enumerate(pl["lengths"][0]["rows"]):
        table.add_row(row["strategy"], *(f"{p['rows'][i]['plan_s'] * 1e3:.1f} / {p['rows'][i]['share_of_ttft']:.3%}"
                                         for p in pl["lengths"]))
    console.print(table)
    b = pl["batch"]
    console.print(f"batch scheduler, {b['requests']} requests of {b['context']}: planned in {b['plan_s'] * 1e3:.1f} ms"
                  f" = {b['share_of_first_ttft']:.2%} of the first predicted TTFT ({b['first_ttft_s']:.1f} s)")


def _print_acceptance(acc: dict) -> None:
    table = Table(title="headline ratios (same run, medians)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in acc.items():
        if isinstance(v, list):
            v = ", ".join(f"{x:.2f}" for x in v)
        elif isinstance(v, float):
            v = f"{v:.3f}"
        table.add_row(k, str(v))
    console.print(table)


def _print_batch(res: dict) -> None:
    table = Table(title=f"batch of {len(res['lengths'])} (contexts {res['lengths']}), rho={res['rho']:g}, "
                        f"max |diff| {res['max_abs_diff']:.1e}")
    for col in ("scheduler", "mean s", "P50 s", "P90 s", "P99 s", "max s"):
        table.add_column(col, justify="right" if col != "scheduler" else "left")
    for name, st in res["modes"].items():
        table.add_row(name, *(f"{st[k]:.3f}" for k in ("mean", "p50", "p90", "p99", "max")))
    console.print(table)
    if res["note"]:
        console.print(res["note"])
    for base in ("sjf", "fcfs_cake"):
        console.print(f"batch-aware / {base.replace('_', ' ').upper() if base == 'sjf' else 'FCFS cake'}: "
                      + ", ".join(f"{k} {v:.2f}x" for k, v in res[f"batch_vs_{base}"].items()))
    console.print(f"measured whole-batch bound {res['measured_bound_s']:.3f} s (model T* "
                  f"{res['model_bound_s']:.3f} s) = {res['measured_bound_vs_sjf_max']:.2f}x SJF's last TTFT (no "
                  f"schedule's last request can finish sooner); batch-aware's last TTFT = "
                  f"{res['batch_max_vs_measured_bound']:.2f}x the bound")
    console.print(f"measured mean bound {res['measured_mean_bound_s']:.3f} s (no schedule's mean TTFT is lower): "
                  f"SJF mean = {res['sjf_mean_vs_mean_bound']:.2f}x it, batch-aware mean = "
                  f"{res['batch_mean_vs_mean_bound']:.2f}x it")
