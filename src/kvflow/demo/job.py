"""``kvflow demo`` end to end: build the model (smollm2-135m unless told), get its cost profile, run the written chat
under memory pressure (run.py), save the TTFT CDF and demo.json, print one exchange, the table and the verdicts.

    job = demo_job(DemoOptions(ChatWorkload(users=4, rounds=3, text="written")), cost_for=ensure_cost,
                   progress_bar=progress_bar)
    print_job(job)                                      # job.results is demo.json
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from rich.console import Console

from kvflow.demo.chat import ChatWorkload
from kvflow.errors import KVFlowError

console = Console(width=None if sys.stdout.isatty() else 160)  # full tables in logs too
err_console = Console(stderr=True)


@dataclass(slots=True)
class DemoOptions:
    """What ``kvflow demo`` takes, parsed (the option help in cli/restore_cmds.py says what each one means)."""
    workload: ChatWorkload = field(default_factory=ChatWorkload)
    model: str | None = None                    # None: the real model of model/catalog.py (smollm2-135m)
    kv_share: float = 0.25
    repeats: int = 2
    check: bool = True
    home: Path = Path(".kvflow")
    out: Path | None = None


@dataclass(slots=True)
class DemoJob:
    """A finished demo: ``results`` as written to ``folder/demo.json``; ``t0`` when it started (perf_counter)."""
    options: DemoOptions
    folder: Path
    results: dict
    t0: float

    @property
    def exact(self) -> bool:
        """The replayed conversation matched ``generate`` (True when the check was off)."""
        return self.results["exact"] is None or self.results["exact"]["all_equal"]


def status(message: str) -> None:
    err_console.print(f"[dim]… {message}[/dim]")


def profile_positions(longest: int) -> int:
    """Positions the demo's cost profile covers: its longest sequence rounded up to a power of two, from 1,024 to
    cost/saved.py's MAX_POSITION (the fit is linear in position beyond it; a saved profile of at least half the
    positions is reused), not the model's whole context."""
    from kvflow.cost.saved import MAX_POSITION
    return min(MAX_POSITION, max(1024, 1 << (longest - 1).bit_length()))


def demo_job(o: DemoOptions, cost_for: Callable, progress_bar: Callable) -> DemoJob:
    """Run the demo of ``o``; ``cost_for(runner, max_position)`` gives the cost model, ``progress_bar(title)`` a rich
    Progress to show what runs and the requests served."""
    from kvflow.demo.chat import draw_cdf
    from kvflow.demo.run import budget_tokens, run_demo
    from kvflow.engine import EngineConfig
    from kvflow.engine.tokenizer import load_tokenizer
    from kvflow.model import catalog, load_model
    from kvflow.report import out_dir, save_figure, write_json
    from kvflow.server.build import DEFAULT_CHUNK_TOKENS
    from kvflow.threads import in_fresh_thread

    o = replace(o, model=o.model or catalog.DEFAULT)
    o.workload.validate()
    if not 0 < o.kv_share <= 4:
        raise KVFlowError("--kv-share must be in (0, 4]")
    if o.repeats < 1:
        raise KVFlowError("--repeats must be >= 1")
    if o.home.exists() and not o.home.is_dir():
        raise KVFlowError(f"--home {o.home} is not a folder")
    t0 = time.perf_counter()
    status(f"building {o.model}")
    runner = in_fresh_thread(load_model, o.model)        # set-up off the thread that drives the server: threads.py
    tokenizer = load_tokenizer(o.model, runner.config.vocab_size)
    longest = budget_tokens(o.workload, 0.0, EngineConfig().block_size, tokenizer)
    runner.check_context_len(longest)
    cost = in_fresh_thread(cost_for, runner, profile_positions(longest))
    folder = out_dir("demo", o.out)
    with progress_bar("chat requests") as bar:
        task = bar.add_task("chat requests", total=None)
        results, cdf = run_demo(runner, cost, o.workload, home=o.home, chunk_tokens=DEFAULT_CHUNK_TOKENS,
                                tokenizer=tokenizer, kv_share=o.kv_share, repeats=o.repeats, check=o.check,
                                model=o.model, tick=lambda done, total: bar.update(task, completed=done, total=total),
                                say=lambda what: bar.update(task, description=what))
    results["wall_s"] = time.perf_counter() - t0
    save_figure(folder / "ttft_cdf.png", draw_cdf(cdf, f"{o.model} chat, KV {o.kv_share:g}x working set"))
    write_json(folder / "demo.json", results)
    return DemoJob(o, folder, results, t0)


def print_job(job: DemoJob) -> None:
    """The table of both configurations, cacheflow over recompute, the exactness verdict, where the files are."""
    from kvflow.demo.run import STRATEGIES, elapsed
    from kvflow.report import print_table

    o, results, w = job.options, job.results, job.options.workload
    ex = results.get("exchange")
    if ex is not None:
        from rich.markup import escape
        console.print(f"[bold]{escape(ex['user'])}, turn {ex['round'] + 1} of {w.rounds}[/bold] (cacheflow, "
                      f"{ex['prompt_tokens']:,}-token prompt, {ex['cached_tokens']:,} of them cached; first token "
                      f"after {ex['ttft_s'] * 1e3:,.0f} ms)")
        console.print(f"  [cyan]question:[/cyan] {escape(ex['question'])}")
        console.print(f"  [green]answer:[/green]   {escape(ex['answer'].strip())}")
    print_table(f"{o.model}: multi-round chat ({w.text} text), {w.users} users x {w.rounds} turns, resident KV for "
                f"{results['kv_budget_tokens']:,} of {results['working_set_tokens']:,} working-set tokens, pool on "
                f"disk under {o.home}/", [results["runs"][s]["row"] for s in STRATEGIES],
                ["config", "req", "err", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ttft_mean_ms", "resident",
                 "pool", "miss"], console=console)
    rc, cf = (results["runs"][s]["summary"] for s in STRATEGIES)
    console.print(f"cacheflow vs recompute (same run): P50 TTFT {cf['ttft_p50_s'] / rc['ttft_p50_s']:.2f}x, P99 "
                  f"{cf['ttft_p99_s'] / rc['ttft_p99_s']:.2f}x, mean {cf['ttft_mean_s'] / rc['ttft_mean_s']:.2f}x. "
                  f"resident / pool / miss: shares of prompt tokens from resident blocks, restored from the pool, "
                  f"computed.")
    exact = results["exact"]
    if exact is not None:
        verdict = "[green]equal[/]" if exact["all_equal"] else "[red]NOT equal[/]"
        console.print(f"exactness: user 0's {len(exact['turns'])} turns as served and replayed "
                      f"({exact['cached_tokens']:,} of {exact['prompt_tokens']:,} prompt tokens cached): tokens "
                      f"{verdict} to transformers' greedy generate")
    console.print(f"done in {elapsed(job.t0)}; TTFT CDF {job.folder / 'ttft_cdf.png'}, JSON "
                  f"{job.folder / 'demo.json'}")
