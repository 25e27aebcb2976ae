"""`kvflow bench faults`: two engines sharing a Redis cluster serve a multi-round chat while the cluster fails."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvflow.cli.main import bench_app
from kvflow.errors import ConfigError


@bench_app.command("faults")
def bench_faults(quick: bool = typer.Option(False, "--quick", help="2 chats x 3 rounds per fault"),
                 as_json: bool = typer.Option(False, "--json", help="print the results as JSON instead of a table"),
                 out: Optional[Path] = typer.Option(None, help="output folder (default runs/faults-<timestamp>/)"),
                 netns: bool = typer.Option(False, "--netns", help="the namespace cluster (root, ip, tc; "
                                                                   "bench/netcluster.py) instead of loopback"),
                 faults: str = typer.Option("none,kill-master,cut-link,slow-node", help="phases, in order"),
                 chats: int = typer.Option(4, help="conversations per phase"),
                 rounds: int = typer.Option(5, help="rounds per conversation (fault on from round 2 to the "
                                                    "second-to-last)"),
                 context: int = typer.Option(512, help="tokens of each conversation's first prompt"),
                 timeout: float = typer.Option(0.5, help="the remote device's timeout_s (connect and per command)"),
                 slow_ms: float = typer.Option(20.0, help="loopback slow-node: ms added to each reply segment"),
                 model: str = typer.Option("tiny", help="model of both engines")) -> None:
    """Every request must succeed and equal a fresh prefill's greedy tokens; P99 TTFT during each fault vs the
    fault-free run; threads and cluster connections before, while serving and after."""
    from kvflow.bench import faults as bench
    from kvflow.pool.redis_local import redis_available
    from kvflow.report import out_dir

    phases = [f.strip() for f in faults.split(",") if f.strip()]
    if not phases or set(phases) - set(bench.FAULTS):
        raise ConfigError(f"--faults {faults!r}: phases are {', '.join(bench.FAULTS)}")
    if not (1 <= chats <= 64 and 3 <= rounds <= 50 and 64 <= context <= 8192 and 0 < timeout <= 30
            and 0 <= slow_ms <= 10_000):
        raise ConfigError("--chats 1..64, --rounds 3..50, --context 64..8192, --timeout (0, 30] s, --slow-ms 0..10000")
    if netns:
        from kvflow.bench.netcluster import netcluster_available
        if (why := netcluster_available()) is not None:
            raise ConfigError(f"--netns: {why}")
    elif (why := redis_available()) is not None:
        raise ConfigError(why)
    console = Console(stderr=True)
    bench.bench(out_dir("faults", out), faults=phases, convs=2 if quick else chats, rounds=3 if quick else rounds,
                context=256 if quick else context, turn=32, answer=4 if quick else 8, timeout_s=timeout,
                slow_ms=slow_ms, model=model, netns=netns,
                progress=lambda s: console.log(s) if not as_json else None,
                command=" ".join(["kvflow", *sys.argv[1:]]) if Path(sys.argv[0]).name == "kvflow" else None
                ).report(as_json)
