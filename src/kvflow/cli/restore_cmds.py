"""`kvflow demo` (the main job: the serving engine under memory pressure), `kvflow demo restore` (one context restored
with every strategy), `kvflow bench restore` and `kvflow bench second-turn`."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kvflow.cli.limits import MAX_RHO, seed_option
from kvflow.cli.main import app, bench_app
from kvflow.demo.job import console, err_console, status
from kvflow.bench.restore_demo import strategy_table
from kvflow.errors import KVFlowError
from kvflow.stats import comma_list


def ensure_cost(runner, max_position: int):
    """The cost profile of this model on this machine (kvflow.cost.cost_profile's rule), with a progress bar when it
    is measured now."""
    from kvflow.cli.model_cmds import progress_bar
    from kvflow.cost import cost_profile, profiles_dir, saved_profile

    cost = saved_profile(runner, max_position)
    if cost is not None:
        return cost
    with progress_bar(f"profiling {runner.name} (once per machine)") as bar:
        task = bar.add_task(f"profiling {runner.name} (once per machine)", total=1)
        cost = cost_profile(runner, max_position,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    err_console.print(f"cost model saved to {profiles_dir()} (held-out error "
                      f"{cost.fit['held_out_median_rel_error']:.1%})")
    return cost


demo_app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                       help="The main job (what `make demo` runs); `kvflow demo restore`: the restoration demo.")
app.add_typer(demo_app, name="demo")


@demo_app.callback()
def demo(ctx: typer.Context,
         model: Optional[str] = typer.Option(None, help="real model, preset or checkpoint directory (default: "
                                                        "smollm2-135m)"),
         users: int = typer.Option(4, help="chat users (Poisson arrivals)"),
         rounds: int = typer.Option(3, help="turns per user"),
         rate: float = typer.Option(2.0, help="users arriving per second"),
         text: str = typer.Option("written", help="written: the conversations of kvflow/demo/texts.py (each user "
                                                  "asks about a reference document); random: random words of "
                                                  "--system-tokens / --user-tokens"),
         system_tokens: int = typer.Option(256, help="random text: system prompt tokens"),
         user_tokens: int = typer.Option(64, help="random text: user turn tokens"),
         answer_tokens: int = typer.Option(32, help="answer tokens at most (random text: exactly)"),
         think: float = typer.Option(0.5, help="mean think time s"),
         kv_share: float = typer.Option(0.25, help="resident KV budget as a share of the working set"),
         repeats: int = typer.Option(2, help="rounds over recompute and cacheflow, alternated ABBA... (medians)"),
         check: bool = typer.Option(True, help="replay user 0's conversation and compare its tokens with generate"),
         seed: int = seed_option(),
         home: Path = typer.Option(Path(".kvflow"), help="where the demo's pools live (removed after each run)"),
         out: Optional[Path] = typer.Option(None, help="output folder (default runs/demo-TIME)"),
         as_json: bool = typer.Option(False, "--json", help="print the results as JSON")) -> None:
    """The engine on a real model: a multi-user, multi-turn chat with recompute and cacheflow under memory pressure."""
    if ctx.invoked_subcommand is not None:
        return
    from kvflow.cli.model_cmds import progress_bar
    from kvflow.demo.chat import ChatWorkload
    from kvflow.demo.job import DemoOptions, demo_job, print_job

    w = ChatWorkload("chat", users, rounds, rate, system_tokens, user_tokens, answer_tokens, think, seed=seed,
                     text=text)
    job = demo_job(DemoOptions(w, model, kv_share, repeats, check, home, out), cost_for=ensure_cost,
                   progress_bar=progress_bar)
    if as_json:
        print(json.dumps(job.results, indent=2, default=str))
        return
    print_job(job)
    if not job.exact:
        raise typer.Exit(1)


@demo_app.command("restore")
def demo_restore(
    model: str = typer.Option("qwen2.5-0.5b@layers=2", help="preset or checkpoint directory"),
    context_len: int = typer.Option(4096, "--context", min=256, help="context tokens to store and restore"),
    query_len: int = typer.Option(32, "--query", min=1, help="new tokens after the context"),
    rho: float = typer.Option(1.0, min=0.01, max=MAX_RHO, help="I/O-to-compute ratio the pool is throttled to "
                                                             "(a finite number: the link runs at rho x the "
                                                             "measured recompute rate)"),
    dtype: str = typer.Option("float32", help="KV storage dtype: float32 (exact), bfloat16 or float16 (half the "
                                              "bytes, not exact: the table shows by how much)"),
    out: Optional[Path] = typer.Option(None, help="where to write the timeline PNG and JSON"),
    as_json: bool = typer.Option(False, "--json", help="print the results as JSON"),
) -> None:
    """Store a long context, restore it with every strategy at rho, compare with a fresh full prefill."""
    from kvflow.bench.restore_demo import RestoreDemoOptions, print_restore_demo, restore_demo

    demo = restore_demo(RestoreDemoOptions(model, context_len, query_len, rho, dtype, out), cost_for=ensure_cost)
    if as_json:
        print(json.dumps(demo.public, indent=2))
        return
    print_restore_demo(demo)


@bench_app.command("restore")
def bench_restore(
    model: str = typer.Option("qwen2.5-0.5b@layers=4", help="preset or checkpoint directory"),
    context_len: int = typer.Option(8192, "--context", min=256, help="context for the rho sweep"),
    rhos: str = typer.Option("0.25,0.5,1,2,4,8", "--rho", help="I/O-to-compute ratios to sweep"),
    lengths: str = typer.Option("512,1024,2048,4096,8192", help="contexts for the crossover sweep at rho=1"),
    query_len: int = typer.Option(32, "--query", min=1),
    repeats: int = typer.Option(3, min=1, help="interleaved repeats per point (median reported)"),
    latency: str = typer.Option("0.0001,0.001", help="per-read link latencies (seconds) swept at rho=1; '' for none"),
    disk: bool = typer.Option(True, help="also run unthrottled from a real-disk O_DIRECT extent file"),
    gbps: Optional[str] = typer.Option(None, "--gbps", help="links in Gbit/s instead of --rho (a GPU's: 10,40,80): "
                                                          "each becomes rho = link / the recompute rate measured at "
                                                          "the start of the run"),
    batch: Optional[str] = typer.Option(None, help="batch sizes, e.g. 2,4,8: run the batch benchmark instead"),
    quick: bool = typer.Option(False, "--quick", help="small model and contexts: a smoke run in about a minute"),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/bench-restore-<time>)"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON result instead of tables"),
) -> None:
    """TTFT of every strategy vs rho and context length (+ batches); ratios measured side by side."""
    from kvflow.bench import restore_bench as rb
    from kvflow.report import out_dir, write_json
    from kvflow.model import load_model
    from kvflow.pool.devices.throttle import MAX_LATENCY_S
    from kvflow.planner import STRATEGIES

    if quick:
        model, context_len, rhos, lengths, repeats, latency = "qwen2.5-0.5b@layers=2", 2048, "1,8", "512,2048", 1, ""
    rho_list = comma_list(rhos, float, "--rho", MAX_RHO)
    gbps_list = comma_list(gbps, float, "--gbps", 1e5) if gbps else []
    latencies = comma_list(latency, float, "--latency", MAX_LATENCY_S) if latency.strip() else []
    len_list = comma_list(lengths, int, "--lengths")
    batch_sizes = comma_list(batch, int, "--batch", 256) if batch else []
    folder = out_dir("bench-restore", out)
    status(f"building {model}")
    runner = load_model(model)
    longest = max([context_len, *len_list] + ([8192] if batch_sizes else []))
    runner.check_context_len(longest + query_len)     # before any profile or allocation
    cost = ensure_cost(runner, longest)
    result: dict = {"model": model, "chunk_tokens": 256, "query": query_len, "repeats": repeats,
                    "threads": cost.threads, "profiled_recompute_rate_mib_s": cost.short_context_rate() / 2**20}
    if batch_sizes:
        batches = [rb.batch_lengths(size, seed=size) for size in batch_sizes]
        bench = rb.make_bench(runner, cost, [n for lengths in batches for n in lengths], query_len=query_len,
                              progress=status, store=False)
        try:
            result["recompute_rate_mib_s"] = bench.recompute_rate / 2**20
            result["batches"] = [rb.measure_batch(bench, lengths, 1.0, repeats, status) for lengths in batches]
        finally:
            bench.close()
        rb.plot_batch(result["batches"], folder / "batch.png", f"{model}, rho=1: batch-aware vs SJF vs FCFS")
        write_json(folder / "restore-batch.json", rb.jsonable(result))
        if as_json:
            print(json.dumps(rb.jsonable(result), indent=2))
            return
        _print_batches(result["batches"])
        console.print(f"JSON + PNG in {folder}")
        return

    bench = rb.make_bench(runner, cost, [context_len, *len_list], query_len=query_len,
                          disk_dir=str(folder) if disk else None, progress=status)
    try:
        result["recompute_rate_mib_s"] = bench.recompute_rate / 2**20
        if gbps_list:            # the same sweep, its points named by link rate: rho follows from this run's rate
            rho_list = [g * 1e9 / 8 / bench.recompute_rate for g in gbps_list]
            result["gbps"] = gbps_list
            status("links " + ", ".join(f"{g:g} Gbps = rho {r:.3g}" for g, r in zip(gbps_list, rho_list)))
        result["rho_sweep"] = rb.sweep_rho(bench, context_len, rho_list, STRATEGIES, repeats, status, latencies)
        # the rho = 1 point of the sweep is the length sweep's point at context_len: measured once
        reuse = next((p for p in result["rho_sweep"] if p["rho"] == 1.0 and not p["latency_s"]
                      and p["pool"].startswith("memory")), None) if context_len in len_list else None
        short = [n for n in len_list if n != context_len or reuse is None]
        result["length_sweep"] = sorted(rb.sweep_length(bench, sorted(short), 1.0, STRATEGIES, repeats, status)
                                        + ([reuse] if reuse is not None else []), key=lambda p: p["context"])
        bench.set_link("memory", 1.0)
        predicted_crossover = bench.restorer("memory").planner().crossover_length(query_len)
    finally:
        bench.close()
    points = list({id(p): p for p in result["rho_sweep"] + result["length_sweep"]}.values())  # one may be in both
    for point in points:
        point["speedups"] = rb.speedups(point["rows"])
    result["crossover"] = rb.crossover(result["length_sweep"])
    result["crossover"]["predicted_tokens"] = predicted_crossover
    one = next(p for p in result["rho_sweep"] if p["rho"] == 1.0) if 1.0 in rho_list else result["rho_sweep"][0]
    cf = one["rows"]["cacheflow"]
    rb.plot_rho(result["rho_sweep"], folder / "rho-sweep.png", f"{model}, {context_len} tokens")
    rb.plot_lengths(result["length_sweep"], folder / "length-sweep.png", f"{model}, rho=1")
    from kvflow.executor import plot_timeline
    plot_timeline(cf["_result"].timeline, folder / "timeline.png",
                  f"cacheflow, {context_len} tokens, rho={one['rho']:g}: {cf['plan']}", 256)
    result["acceptance"] = _acceptance(result, one)
    for point in points:
        point["rows"] = rb.public(point["rows"])
    write_json(folder / "restore.json", rb.jsonable(result))
    if as_json:
        print(json.dumps(rb.jsonable(result), indent=2))
        return
    for point in result["rho_sweep"]:
        console.print(strategy_table(f"{model}, {point['context']} tokens, {point['pool']}, rho={point['rho']:.3g} "
                                     f"(link {point['link_bytes_per_s'] / 2**20:,.1f} MiB/s)",
                                     {r["strategy"]: r for r in point["rows"]}))
    _print_lengths(result)
    _print_acceptance(result["acceptance"])
    console.print(f"JSON + PNG (rho-sweep, length-sweep, timeline) in {folder}")


def _acceptance(result: dict, one: dict) -> dict:
    rows = one["rows"]
    cf = rows["cacheflow"]["ttft_s"]
    worst = max(p["speedups"]["cacheflow_vs_best_other"] for p in result["rho_sweep"])
    worst_at = max(result["rho_sweep"], key=lambda p: p["speedups"]["cacheflow_vs_best_other"])
    cross = result["crossover"]["points"]
    return {
        "headline_rho": one["rho"],      # the rho1_* figures' point: rho = 1 when swept, else the first swept rho
        "rho1_cacheflow_vs_min_recompute_load": cf / min(rows["recompute"]["ttft_s"], rows["load"]["ttft_s"]),
        "rho1_cacheflow_vs_cake": cf / rows["cake"]["ttft_s"],
        "rho1_cacheflow_vs_measured_bound": rows["cacheflow"]["vs_measured_bound"],
        "rho1_cacheflow_vs_model_bound": rows["cacheflow"]["vs_model_bound"],
        "rho1_cacheflow_vs_best_other": one["speedups"]["cacheflow_vs_best_other"],
        "rho1_compute_util": rows["cacheflow"]["compute_util"],
        "rho1_io_util": rows["cacheflow"]["io_util"],
        "rho1_prefix_lookup_share_of_ttft": rows["cacheflow"]["lookup_s"] / cf,
        "rho1_planning_share_of_ttft": rows["cacheflow"]["plan_s"] / cf,
        "worst_cacheflow_vs_best_other_over_sweep": worst,
        "worst_point": f"{worst_at['pool']}, rho={worst_at['rho']:.3g}",
        "worst_point_same_plan_as_best": worst_at["speedups"]["same_plan_as_best"],
        "median_repeat_spread_over_sweep": statistics.median(p["speedups"]["repeat_spread"]
                                                             for p in result["rho_sweep"]),
        "crossover_tokens": result["crossover"]["measured_tokens"],
        "cacheflow_vs_faster_side_at_each_length": [p["cacheflow_s"] / p["faster_side_s"] for p in cross],
        "max_abs_diff": max(r["max_abs_diff"] for p in result["rho_sweep"] + result["length_sweep"]
                            for r in p["rows"].values()),
    }


def _print_lengths(result: dict) -> None:
    table = Table(title="context length sweep at rho=1 (TTFT s) — where layer split stops paying")
    points = result["length_sweep"]
    strategies = [r["strategy"] for r in points[0]["rows"]]
    table.add_column("context", justify="right")
    for s in strategies:
        table.add_column(s, justify="right")
    table.add_column("cacheflow chose")
    for p in points:
        rows = {r["strategy"]: r for r in p["rows"]}
        table.add_row(str(p["context"]), *[f"{rows[s]['ttft_s']:.3f}" for s in strategies], rows["cacheflow"]["chose"])
    console.print(table)
    console.print(f"measured crossover (token split beats layer split from): {result['crossover']['measured_tokens']}")


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


def _print_batches(batches: list[dict]) -> None:
    for res in batches:
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


@bench_app.command("second-turn")
def bench_second_turn(
    model: Optional[str] = typer.Option(None, help="preset or checkpoint directory (default: the serve default)"),
    history: int = typer.Option(4096, min=64, help="turn 1's system prompt (tokens): the history evicted"),
    user_tokens: int = typer.Option(64, min=1, help="mean user message (tokens)"),
    answer_tokens: int = typer.Option(16, min=1),
    rho: float = typer.Option(1.0, help="link = rho x the recompute rate measured at the start of the run"),
    repeats: int = typer.Option(3, min=1, help="interleaved repeats (median reported)"),
    chunk_tokens: Optional[int] = typer.Option(None, help="pool chunk (default: the serve default, 64)"),
    pool_dir: Optional[Path] = typer.Option(None, help="pool on disk under this folder (default: in memory)"),
    seed: int = seed_option(),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/second-turn-TIME)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Second turn of a chat whose long history was evicted: recompute vs cacheflow TTFT over a link at rho."""
    from kvflow.report import out_dir, print_table, save_figure, write_json
    from kvflow.bench.second_turn import run_second_turn
    from kvflow.model import load_model
    from kvflow.server.build import DEFAULT_CHUNK_TOKENS, DEFAULT_MODEL

    if not 0 < rho <= MAX_RHO:
        raise KVFlowError(f"--rho must be in (0, {MAX_RHO:g}]")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise KVFlowError("--chunk-tokens must be >= 1")
    model = model or DEFAULT_MODEL
    status(f"building {model}")
    runner = load_model(model)
    runner.check_context_len(history + 4 * user_tokens + answer_tokens + 64)
    cost = ensure_cost(runner, max(8192, history * 2))
    folder = out_dir("second-turn", out)
    res = run_second_turn(runner, cost, history=history, user_tokens=user_tokens, answer_tokens=answer_tokens,
                          rho=rho, repeats=repeats, chunk_tokens=chunk_tokens or DEFAULT_CHUNK_TOKENS,
                          pool_dir=str(pool_dir) if pool_dir else None, seed=seed, progress=status)
    write_json(folder / "second_turn.json", res)
    save_figure(folder / "second_turn.png", _draw_turns(res))
    if as_json:
        print(json.dumps(res, indent=2))
        return
    rows = [{"strategy": s, "TTFT ms (median)": r["ttft_s"] * 1e3,
             "each repeat ms": ", ".join(f"{t * 1e3:.0f}" for t in r["ttft_runs"]),
             "from pool": r["pool_hit_tokens"], "resident": r["resident_hit_tokens"],
             "planned loaded / recomputed": f"{r['loaded_tokens']:.0f} / {r['recomputed_tokens']:.0f}",
             "exact": r["exact"]}
            for s, r in res["rows"].items()]
    print_table(f"{model}: second turn ({res['turn2_prompt_tokens']:,} prompt tokens) after "
                f"{res['evicted_history_tokens']:,} tokens of history were evicted; pool at rho={rho:g} "
                f"(recompute {res['recompute_rate_bytes_per_s'] / 2**20:.1f} MiB/s of KV, link "
                f"{res['link_bytes_per_s'] / 2**20:.1f} MiB/s)", rows, console=console)
    if "cacheflow_vs_recompute" in res:
        each = ", ".join(f"{x:.2f}" for x in res["cacheflow_vs_recompute_each_repeat"])
        console.print(f"cacheflow / recompute TTFT: [bold]{res['cacheflow_vs_recompute']:.2f}x[/] (medians; each "
                      f"repeat {each})")
    console.print(f"JSON + PNG in {folder}")


def _draw_turns(res: dict):
    def draw(axes):
        ax = axes[0]
        names = list(res["rows"])
        for i, name in enumerate(names):
            runs = res["rows"][name]["ttft_runs"]
            ax.scatter([i] * len(runs), [t * 1e3 for t in runs], alpha=0.6)
            ax.bar(i, res["rows"][name]["ttft_s"] * 1e3, alpha=0.3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"second turn, {res['evicted_history_tokens']:,} evicted tokens, rho={res['rho']:g}")
        ax.grid(alpha=0.3, axis="y")
    return draw
