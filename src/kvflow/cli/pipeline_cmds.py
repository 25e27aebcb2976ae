"""`kvflow bench pipeline`: pipeline-parallel restoration — stages as processes, each on its own link."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvflow.cli.limits import MAX_RHO, seed_option
from kvflow.cli.main import bench_app
from kvflow.errors import KVFlowError
from kvflow.stats import comma_list


def _rhos(text: str) -> list[float | None]:
    out: list[float | None] = []
    for x in (t.strip() for t in text.split(",") if t.strip()):
        if x in ("unthrottled", "inf", "none"):
            out.append(None)
            continue
        try:
            value = float(x)
        except ValueError:
            raise KVFlowError(f"bad --rho {text!r}: numbers or 'unthrottled', e.g. 1,unthrottled") from None
        if value <= 0:
            raise KVFlowError(f"bad --rho {text!r}: rho must be positive")
        if not value <= MAX_RHO:              # nan and 1e400 (inf as a number) too: 'inf' is the word above
            raise KVFlowError(f"bad --rho {text!r}: rho must be a number up to {MAX_RHO:g}, or 'unthrottled'")
        out.append(value)
    if not out:
        raise KVFlowError("--rho needs at least one value")
    return out


@bench_app.command("pipeline")
def bench_pipeline(
    stages: str = typer.Option("1,2", "--stages", help="stage counts to compare, e.g. 1,2 (1 = single process)"),
    model: str = typer.Option("tiny-deep", help="preset or checkpoint directory (tiny-deep: 16 layers, 4 KV heads — "
                                                 "Llama-3.1-8B's activation/KV ratio at 2 stages)"),
    context: int = typer.Option(4096, min=1, help="context tokens"),
    query: int = typer.Option(32, min=1, help="query tokens"),
    chunk: int = typer.Option(256, min=1, help="chunk tokens"),
    rho: str = typer.Option("1,unthrottled", help="I/O-to-compute ratios per stage link; 'unthrottled' = no cap"),
    repeats: int = typer.Option(5, min=1, help="timed runs per configuration (median reported)"),
    threads: int = typer.Option(1, min=1, help="torch threads per stage process"),
    split: str = typer.Option("auto", help="layers per stage: auto (planner-balanced), even, or sizes like 9,7"),
    handoff: str = typer.Option("stage,step", help="sequential baseline hand-off: stage (all at once), step, or both"),
    seed: int = seed_option("weight seed"),
    timeout: float = typer.Option(900.0, min=10, max=7 * 86400, help="seconds before the stages are stopped"),
    as_json: bool = typer.Option(False, "--json", help="print the results as JSON instead of tables"),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/pipeline-<timestamp>/)"),
) -> None:
    """Independent (boundary activations) vs sequential vs 1-stage restoration: TTFT, speedup vs the ideal, T*."""
    from kvflow.bench import pipeline_bench
    from kvflow.report import out_dir

    from kvflow.model.runner import max_threads
    if threads > max_threads():            # 99999 OpenMP threads crash a stage process, not one line
        raise KVFlowError(f"--threads must be 1..{max_threads()}, got {threads}")
    handoffs = [h.strip() for h in handoff.split(",") if h.strip()]
    if not handoffs or any(h not in ("stage", "step") for h in handoffs):
        raise KVFlowError(f"bad --handoff {handoff!r}: stage, step or stage,step")
    cfg = pipeline_bench.PipelineBenchConfig(model=model, seed=seed, stages=sorted(set(comma_list(stages, int, "--stages"))),
                                             context=context, query=query, chunk_tokens=chunk, rhos=_rhos(rho),
                                             repeats=repeats, threads=threads, split=split, handoffs=handoffs,
                                             timeout_s=timeout)
    if 1 not in cfg.stages:
        raise KVFlowError("--stages must include 1: speedups are measured against the 1-stage restoration")
    log = Console(stderr=True)
    pipeline_bench.bench(cfg, out_dir("pipeline", out), lambda s: log.log(s) if not as_json else None).report(as_json)
