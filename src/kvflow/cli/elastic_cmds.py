"""`kvflow bench elastic`: the elastic KV reserve vs a smaller token budget (bench/elastic_bench.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from kvflow.cli.limits import seed_option
from kvflow.cli.main import bench_app
from kvflow.stats import comma_list


@bench_app.command("elastic")
def bench_elastic(
    model: str = typer.Option("tiny", help="preset or checkpoint directory"),
    budgets: str = typer.Option("256,512,1024,2048,4096", help="token budgets (max_num_batched_tokens) for (a)/(b)"),
    long_len: int = typer.Option(4096, help="tokens of each arriving long prompt"),
    long_prompts: int = typer.Option(2, help="long prompts per run (one after another)"),
    decoders: int = typer.Option(4, help="(a): steady decoders beside the long prompts"),
    decode_prompt: int = typer.Option(64, help="prompt tokens of each decoder"),
    gap: int = typer.Option(8, help="decode-only steps between a long prompt's first token and the next arrival"),
    repeats: int = typer.Option(3, help="repeats, the order rotated each time"),
    c_decoders: int = typer.Option(16, help="(c): decoders at one memory budget"),
    c_tokens: int = typer.Option(192, help="(c): tokens each of them decodes"),
    c_long_len: int = typer.Option(1024, help="(c): tokens of each arriving long prompt"),
    c_long_prompts: int = typer.Option(4, help="(c): long prompts per run"),
    c_base_blocks: int = typer.Option(0, help="(c): KV blocks of the fixed config (0: half the decoders' need)"),
    small_budget: int = typer.Option(512, help="(c): the smaller token budget"),
    seed: int = seed_option(),
    out: Optional[Path] = typer.Option(None, help="output folder (default runs/elastic-TIME)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Chunked prefill vs an elastic reserve: TTFT vs token budget, reserve vs budget, capacity at one memory
    budget, take-back latency, peak resident memory vs budget."""
    from kvflow.bench.elastic_bench import ElasticWorkload, elastic_run
    from kvflow.report import print_table

    w = ElasticWorkload(budgets=tuple(comma_list(budgets, int, "--budgets")), long_len=long_len,
                        long_prompts=long_prompts, decoders=decoders, decode_prompt=decode_prompt, gap=gap,
                        repeats=repeats, c_decoders=c_decoders, c_tokens=c_tokens, c_long_len=c_long_len,
                        c_long_prompts=c_long_prompts, c_base_blocks=c_base_blocks, small_budget=small_budget,
                        seed=seed)
    run = elastic_run(model, w, out, progress=lambda m: print(m, file=sys.stderr, flush=True))
    if as_json:
        print(json.dumps(run.to_json(), indent=2))
        return
    for title, rows in run.tables():
        print_table(title, rows)
    print(run.footer)
