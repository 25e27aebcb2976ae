"""`kvflow demo` (the main job: the serving engine under memory pressure), `kvflow demo restore` (one context restored
with every strategy), `kvflow bench restore` and `kvflow bench second-turn`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from kvflow.cli.limits import MAX_RHO, seed_option
from kvflow.cli.main import app, bench_app
from kvflow.demo.job import console, err_console, status
from kvflow.errors import KVFlowError
from kvflow.stats import comma_list


def ensure_cost(runner, max_position: int):
    """The cost profile of this model on this machine (kvflow/cost/saved.py's rule), with a progress bar while it is
    measured now."""
    from kvflow.cli.model_cmds import progress_task
    from kvflow.cost import cost_profile, profiles_dir

    measured = []
    cost = cost_profile(runner, max_position, profiling=lambda title: measured.append(title) or progress_task(title))
    if measured:
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
         answer_tokens: int = typer.Option(24, help="answer tokens at most (random text: exactly)"),
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
    strategies: str = typer.Option("", help="strategies to run, e.g. cacheflow,cake,token,load,recompute (default: "
                                            "all)"),
    rho_basis: str = typer.Option("context", help="context: the link runs at rho x the KV bytes/s of recomputing "
                                                 "that context (measured in the run; rho=1: loading takes as long "
                                                 "as recomputing it); short: x recompute's rate at short context"),
    once_from: int = typer.Option(65536, min=1, help="contexts of at least this many tokens run recompute once "
                                                    "and one bound probe (big steps only)"),
    long_repeats: Optional[int] = typer.Option(None, min=1, help="repeats of the other strategies at --once-from "
                                                                  "and beyond (default: --repeats)"),
    memory: bool = typer.Option(False, "--memory", help="only the peak RSS of one cacheflow restore at each of "
                                                       "--lengths (a fresh child process per length)"),
    planning: bool = typer.Option(False, "--planning", help="only time every planner at --lengths (and the batch "
                                                           "scheduler on 8 x 32K) from the cost model: no compute"),
    quick: bool = typer.Option(False, "--quick", help="small model and contexts: a smoke run in about a minute"),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/bench-restore-<time>)"),
    as_json: bool = typer.Option(False, "--json", help="print the JSON result instead of tables"),
    link: str = typer.Option("emulated", "--link", metavar="emulated|tc|both",
                             help="tc / both (root): the link to a Redis cluster on namespace hosts shaped by tc "
                                  "(beside the in-process throttle), at --rho (default 1,4), --context only"),
) -> None:
    """TTFT of every strategy vs rho and context length (+ batches); ratios measured side by side."""
    from kvflow.bench.restore_run import RestoreRunOptions, print_restore_run, restore_run
    from kvflow.planner import STRATEGIES
    from kvflow.pool.devices.throttle import MAX_LATENCY_S

    if link != "emulated":
        return _bench_links(link, model, context_len, rhos, query_len, repeats, quick, out, as_json)

    if quick:
        model, context_len, rhos, lengths, repeats, latency = "qwen2.5-0.5b@layers=2", 2048, "1,8", "512,2048", 1, ""
    rho_list = comma_list(rhos, float, "--rho", MAX_RHO)
    gbps_list = comma_list(gbps, float, "--gbps", 1e5) if gbps else []
    latencies = comma_list(latency, float, "--latency", MAX_LATENCY_S) if latency.strip() else []
    chosen = [x.strip() for x in strategies.split(",") if x.strip()]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        raise KVFlowError(f"unknown --strategies {', '.join(unknown)}: use some of {', '.join(STRATEGIES)}")
    if rho_basis not in ("context", "short"):
        raise KVFlowError(f"--rho-basis must be context or short, got {rho_basis!r}")
    run = restore_run(RestoreRunOptions(model, context_len, rho_list, comma_list(lengths, int, "--lengths"), query_len,
                                        repeats, latencies, disk, gbps_list,
                                        comma_list(batch, int, "--batch", 256) if batch else [], out,
                                        strategies=[s for s in STRATEGIES if s in chosen], rho_basis=rho_basis,
                                        once_from=once_from, long_repeats=long_repeats, planning=planning,
                                        memory=memory),
                      cost_for=ensure_cost)
    if as_json:
        print(json.dumps(run.to_json(), indent=2))
        return
    print_restore_run(run)


def _bench_links(link, model, context_len, rhos, query_len, repeats, quick, out, as_json) -> None:
    from kvflow.bench.link_bench import QUICK, LinkRunOptions, link_run, rows_for_print
    from kvflow.bench.netcluster import netcluster_available

    if link not in ("tc", "both"):
        raise KVFlowError(f"--link {link!r}: emulated, tc or both")
    if (why := netcluster_available()) is not None:
        raise KVFlowError(f"--link {link}: {why}")
    rho_list = [1.0, 4.0] if rhos == "0.25,0.5,1,2,4,8" else comma_list(rhos, float, "--rho", MAX_RHO)
    if quick:                        # --repeats stays as given: a smoke is --quick --repeats 1
        model, context_len = "qwen2.5-0.5b@layers=2", 2048
    result = link_run(LinkRunOptions(model, context_len, rho_list, ("emulated", "tc") if link == "both" else ("tc",),
                                     query_len, repeats, QUICK if quick else (), out), cost_for=ensure_cost,
                      progress=status)
    if as_json:
        print(json.dumps({k: v for k, v in result.items() if k != "folder"}, indent=2, default=str))
        return
    from rich.table import Table

    rows = rows_for_print(result)
    table = Table(title=f"{model}, {context_len} tokens: emulated (in-process) vs tc-shaped link")
    for k in rows[0]:
        table.add_column(k, justify="right")
    for r in rows:
        table.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()])
    console.print(table)
    for p in result["points"]:
        if "compare" in p:
            c = p["compare"]
            console.print(f"rho={p['rho']:g}: tc/emulated (cacheflow/bound) {c['tc_over_emulated_bound_ratio']:.3f}, "
                          f"(cacheflow/min) {c['tc_over_emulated_min_ratio']:.3f}, spread {c['repeat_spread']:.3f}, "
                          f"same verdict {c['same_verdict']}")
    console.print(f"JSON in {result['folder']}/restore-links.json")


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
    from kvflow.bench.second_turn import SecondTurnOptions, second_turn
    from kvflow.report import print_table

    if not 0 < rho <= MAX_RHO:
        raise KVFlowError(f"--rho must be in (0, {MAX_RHO:g}]")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise KVFlowError("--chunk-tokens must be >= 1")
    turn = second_turn(SecondTurnOptions(model, history, user_tokens, answer_tokens, rho, repeats, chunk_tokens,
                                         pool_dir, seed, out), cost_for=ensure_cost, progress=status)
    if as_json:
        print(json.dumps(turn.to_json(), indent=2))
        return
    print_table(turn.title, turn.rows, console=console)
    for line in turn.notes:
        console.print(line)
