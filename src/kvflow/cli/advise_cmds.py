"""`kvflow advise`: weights, activation reserve and KV capacity per device, and whether the elastic reserve or a
smaller token budget pays (kvflow.advisor, docs/ADVISOR.md)."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvflow.cli.main import app
from kvflow.errors import ConfigError

GPU_MEMS, TPS, CHUNKS = (24.0, 80.0, 141.0), (1, 2, 4, 8), (512, 2048, 8192)
console = Console(width=None if sys.stdout.isatty() else 200)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f}"


def _single(adv, shape, dtype: str) -> None:
    from kvflow.advisor.advise import formula

    layout = f"TP {adv.tp}" + (f" x PP {adv.pp}" if adv.pp > 1 else "")
    t = Table(title=f"kvflow advise: {adv.model}, {adv.gpu_mem_gib:g} GiB per device, {layout}, chunk {adv.chunk}")
    t.add_column("per device")
    t.add_column("value", justify="right")
    t.add_row("weights", f"{_gib(adv.weights)} GiB")
    t.add_row(f"activation reserve (chunk {adv.chunk})", f"{_gib(adv.reserve)} GiB")
    t.add_row("KV memory", f"{_gib(adv.kv_bytes)} GiB")
    t.add_row("KV bytes per token", f"{adv.kv_bytes_per_token:,}")
    t.add_row("KV capacity", f"{adv.kv_tokens:,} tokens")
    t.add_row("elastic reserve lends (decode-only phases)", f"+{adv.elastic_tokens:,} tokens "
              f"({(adv.reserve - adv.reserve_decode) / adv.kv_bytes:.1%})")
    t.add_row(f"chunk {adv.small_chunk} frees (always)", f"+{adv.small_chunk_tokens:,} tokens "
              f"({(adv.reserve - adv.reserve_small) / adv.kv_bytes:.1%})")
    console.print(t)
    print(formula(shape, adv.tp, dtype, adv.factor))
    print(f"recommendation: {adv.recommendation} — {adv.reason}")


def _table(cells) -> None:
    t = Table(title="kvflow advise --table (per device; KV in tokens; + = tokens added)")
    for col in ("model", "GiB", "TP", "chunk", "weights GiB", "reserve GiB", "KV tokens", "elastic +", "small chunk +",
                "recommendation"):
        t.add_column(col, justify="left" if col in ("model", "recommendation") else "right")
    for c in cells:
        a = c.advice
        if a is None:
            t.add_row(c.model, f"{c.gpu_mem_gib:g}", str(c.tp), str(c.chunk), "", "", "", "", "",
                      f"cannot run: {c.problem}")
        else:
            t.add_row(c.model, f"{c.gpu_mem_gib:g}", str(c.tp), str(c.chunk), _gib(a.weights), _gib(a.reserve),
                      f"{a.kv_tokens:,}", f"{a.elastic_tokens:,}", f"{a.small_chunk_tokens:,} ({a.small_chunk})",
                      f"{a.recommendation}: {a.reason}")
    console.print(t)


@app.command("advise")
def advise_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="preset, real model id or checkpoint dir (--table: "
                                        "all presets when omitted)"),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GiB per device (--table: 24, 80, 141)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor-parallel degree (--table: 1, 2, 4, 8)"),
    pp: int = typer.Option(1, "--pp", help="pipeline-parallel degree"),
    chunk: Optional[int] = typer.Option(None, "--chunk", help="token budget per step, max_num_batched_tokens "
                                        "(default 2048; --table: 512, 2048, 8192)"),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="KV cache dtype: bf16, fp16, fp32, fp8"),
    dtype: str = typer.Option("bf16", "--dtype", help="weight and activation dtype"),
    max_model_len: int = typer.Option(0, "--max-model-len",
                                      help="one context of this many tokens must fit (0: no check)"),
    small_chunk: int = typer.Option(0, "--small-chunk", help="the smaller chunk to compare (0: chunk/4, >= 256)"),
    max_seqs: int = typer.Option(256, "--max-seqs", help="sequences in a decode-only step (vLLM's max_num_seqs)"),
    utilization: float = typer.Option(0.9, "--utilization", help="share of GPU memory the engine may use"),
    calibrate: bool = typer.Option(False, "--calibrate", help="measure the reserve formula's factor k here "
                                   "(the model with one layer, fp32, this CPU) and apply it"),
    as_table: bool = typer.Option(False, "--table", help="tabulate over models, GPU memory, TP and chunks"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Weights, activation reserve and KV capacity per device; elastic reserve vs a smaller chunk; a recommendation."""
    from kvflow.advisor.advise import advise, table
    from kvflow.advisor.calibrate import calibration_factor
    from kvflow.advisor.shapes import load_shape, table_models

    kw = dict(dtype=dtype, kv_dtype=kv_dtype, max_model_len=max_model_len, small_chunk=small_chunk,
              max_seqs=max_seqs, utilization=utilization)
    factor = 1.0
    if calibrate:
        if model is None:
            raise ConfigError("--calibrate needs --model")
        factor, measured, tokens = calibration_factor(model, load_shape(model), 2048 if chunk is None else chunk)
        print(f"calibration: measured reserve {measured / 2**20:,.1f} MiB for {tokens} tokens (one layer, fp32, "
              f"CPU) -> k = {factor:.2f}", file=sys.stderr)
    if as_table:
        cells = table([model] if model else table_models(), [gpu_mem] if gpu_mem is not None else list(GPU_MEMS),
                      [tp] if tp is not None else list(TPS), [chunk] if chunk is not None else list(CHUNKS),
                      pp=pp, factor=factor, **kw)
        if as_json:
            print(json.dumps([{"model": c.model, "gpu_mem_gib": c.gpu_mem_gib, "tp": c.tp, "chunk": c.chunk,
                               "advice": c.advice.as_dict() if c.advice else None, "problem": c.problem}
                              for c in cells], indent=1))
        else:
            _table(cells)
        return
    if model is None or gpu_mem is None:
        raise ConfigError("kvflow advise needs --model and --gpu-mem (or --table)")
    shape = load_shape(model)
    adv = advise(shape, gpu_mem, 1 if tp is None else tp, pp, 2048 if chunk is None else chunk, factor=factor, **kw)
    if as_json:
        print(json.dumps(adv.as_dict(), indent=1))
    else:
        _single(adv, shape, dtype)
