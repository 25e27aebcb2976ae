"""``kvflow demo restore``, a run of the restoration bench (so it lives in bench): one long context stored, then
restored with every strategy over a pool link throttled to rho x the measured recompute rate, each checked against
one fresh full prefill; a table and cacheflow's timeline.

    demo = restore_demo(RestoreDemoOptions(context_len=4096, rho=1.0), cost_for=ensure_cost)
    print_restore_demo(demo)                            # demo.folder holds demo.json and timeline.png
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.table import Table

from kvflow.demo.job import console, status


@dataclass(slots=True)
class RestoreDemoOptions:
    """What ``kvflow demo restore`` takes, parsed (the option help in cli/restore_cmds.py says what each means)."""
    model: str = "qwen2.5-0.5b@layers=2"
    context_len: int = 4096
    query_len: int = 32
    rho: float = 1.0
    dtype: str = "float32"
    out: Path | None = None


@dataclass(slots=True)
class RestoreDemo:
    """A finished run: ``rows`` per strategy (restore_bench.measure's), the rates the link was set from, where the
    files are; ``public`` is what ``--json`` prints."""
    options: RestoreDemoOptions
    folder: Path
    rows: dict[str, dict]
    public: list[dict]
    recompute_rate: float
    link_rate: float

    @property
    def timeline(self) -> Path:
        return self.folder / "timeline.png"


def restore_demo(o: RestoreDemoOptions, cost_for: Callable) -> RestoreDemo:
    """Run ``o``; ``cost_for(runner, max_position)`` gives the cost model. Writes demo.json and timeline.png."""
    from kvflow.bench.restore_bench import make_bench, measure, public
    from kvflow.executor import plot_timeline
    from kvflow.model import load_model, parse_dtype
    from kvflow.planner import STRATEGIES
    from kvflow.report import out_dir, write_json

    storage = str(parse_dtype(o.dtype)).removeprefix("torch.")   # a bad dtype is an error before any work
    status(f"building {o.model}")
    runner = load_model(o.model)
    runner.check_context_len(o.context_len + o.query_len)     # before any profile or allocation
    cost = cost_for(runner, max(o.context_len, 2048))
    bench = make_bench(runner, cost, [o.context_len], query_len=o.query_len, progress=status, storage_dtype=storage)
    try:
        rate = bench.set_link("memory", o.rho)
        rows = measure(bench, "memory", o.context_len, STRATEGIES, 1, status, "demo")
    finally:
        bench.close()
    folder = out_dir("demo-restore", o.out)
    chosen = rows["cacheflow"]
    plot_timeline(chosen["_result"].timeline, folder / "timeline.png", f"cacheflow restoring {o.context_len} tokens "
                  f"of {o.model} at rho={o.rho:g}: {chosen['plan']}", bench.chunk_tokens)
    data = public(rows)
    write_json(folder / "demo.json", {"model": o.model, "context": o.context_len, "query": o.query_len, "rho": o.rho,
                                      "recompute_rate_bytes_per_s": bench.recompute_rate,
                                      "link_bytes_per_s": rate, "bound": bench.probes[o.context_len],
                                      "results": data})
    return RestoreDemo(o, folder, rows, data, bench.recompute_rate, rate)


def print_restore_demo(d: RestoreDemo) -> None:
    o = d.options
    console.print(strategy_table(f"{o.model}: restore {o.context_len} tokens + {o.query_len}-token query, "
                                 f"rho={o.rho:g} (recompute measured at {d.recompute_rate / 2**20:.1f} MiB/s of KV; "
                                 f"pool throttled to {d.link_rate / 2**20:.1f} MiB/s)", d.rows))
    console.print(f"TTFT/bound: over the bound measured in this run (per-chunk recompute, the link's rate, the "
                  f"query alone); TTFT/T*: over the cost model's bound. Every strategy checked against one fresh "
                  f"full prefill; timeline: {d.timeline}")


def strategy_table(title: str, rows: dict[str, dict]) -> Table:
    """One row per strategy: TTFT, cacheflow's speedup over it, TTFT over both bounds, utilisation, exactness."""
    from kvflow.bench.restore_bench import speedups
    sp = speedups(rows)["vs"] if "cacheflow" in rows else {}
    table = Table(title=title)
    for col in ("strategy", "TTFT s", "cacheflow speedup", "TTFT/bound", "predicted s", "TTFT/T*", "compute %",
                "I/O %", "max |diff|", "plan"):
        table.add_column(col, justify="left" if col in ("strategy", "plan") else "right")
    for s, r in rows.items():
        diff_ok = r["max_abs_diff"] <= 1e-4 and r["argmax_ok"]
        table.add_row(s, f"{r['ttft_s']:.3f}", f"{sp[s]:.2f}x" if s in sp else "—", f"{r['vs_measured_bound']:.2f}",
                      f"{r['predicted_s']:.3f}", f"{r['vs_model_bound']:.2f}", f"{r['compute_util']:.0%}",
                      f"{r['io_util']:.0%}",
                      f"[{'green' if diff_ok else 'red'}]{r['max_abs_diff']:.1e}[/]", r["plan"])
    return table
