"""`kvflow bench shared`: the shared KV tier on a Redis cluster (striped aggregate, a second engine's TTFT)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvflow.cli.main import bench_app
from kvflow.errors import ConfigError

SECTIONS = ("aggregate", "engine", "hosts")
DEFAULT = ("aggregate", "engine")          # hosts (root, namespaces): --only hosts


@bench_app.command("shared")
def bench_shared(quick: bool = typer.Option(False, "--quick", help="small sizes, one repeat"),
                 as_json: bool = typer.Option(False, "--json", help="print the results as JSON instead of tables"),
                 out: Optional[Path] = typer.Option(None, help="output folder (default runs/shared-<timestamp>/)"),
                 url: Optional[str] = typer.Option(None, help="an existing store, redis://host:port[,host:port] "
                                                              "(default: a 3-master cluster started on loopback)"),
                 single: bool = typer.Option(False, "--single", help="--url is one server, not a cluster"),
                 disk_dir: Optional[Path] = typer.Option(None, help="folder on the real disk for the extent device "
                                                                    "(default $KVFLOW_BENCH_DISK or /var/tmp)"),
                 model: str = typer.Option("tiny", help="model of the second-engine section"),
                 tokens: Optional[int] = typer.Option(None, help="context tokens (default 8192, --quick 2048)"),
                 caps: str = typer.Option("150,100,100", help="aggregate, capped run: MB/s of memory,disk,cluster"),
                 only: Optional[str] = typer.Option(None, help="comma-separated sections: aggregate, engine (default "
                                                              "both), or hosts alone (root: a namespace cluster)"),
                 link_rate: float = typer.Option(1250.0, "--link-rate", help="hosts: engine B's link, MB/s (tc)"),
                 host_rate: float = typer.Option(15.0, "--host-rate",
                                                 help="hosts: each storage host's link for the aggregate, MB/s")) -> None:
    """Memory + disk + cluster striped vs the sum of each alone (own speed and capped), and the TTFT of a second
    engine restoring a context another process stored, vs recompute (loopback and a 10 Gbps link)."""
    from kvflow.bench import shared_bench
    from kvflow.report import out_dir
    from kvflow.pool.redis_local import redis_available

    if disk_dir is not None and not disk_dir.is_dir():
        raise ConfigError(f"--disk-dir {disk_dir} is not a folder")
    sections = set(DEFAULT) if not only else {s.strip() for s in only.split(",") if s.strip()}
    if not sections or sections - set(SECTIONS) or ("hosts" in sections and len(sections) > 1):
        raise ConfigError(f"--only {only!r}: sections are {', '.join(DEFAULT)}, or hosts alone")
    if not (0 < link_rate <= 1e6 and 0 < host_rate <= 1e6):
        raise ConfigError("--link-rate / --host-rate: MB/s between 0 and 1000000")
    if "hosts" in sections:
        from kvflow.bench.netcluster import netcluster_available

        if (why := netcluster_available()) is not None:
            raise ConfigError(f"--only hosts: {why}")
    try:
        cap_list = [float(c) * 1e6 for c in caps.split(",")]
    except ValueError:
        cap_list = []
    if len(cap_list) != 3 or not all(0 < c <= 1e12 for c in cap_list):         # nan and inf too
        raise ConfigError(f"--caps {caps!r}: three positive MB/s values (memory,disk,cluster), e.g. 150,100,100")
    if tokens is not None and not 256 <= tokens <= 1 << 20:
        raise ConfigError(f"--tokens: 256 (one chunk) to 1048576, got {tokens}")
    if url is None and "hosts" not in sections and (why := redis_available()) is not None:
        raise ConfigError(f"no --url and {why}")
    console = Console(stderr=True)
    shared_bench.bench(out_dir("shared", out), url=url, cluster=not single, quick=quick,
                       disk_dir=str(disk_dir) if disk_dir else None, model=model, tokens=tokens, caps=cap_list,
                       sections=sections, link_rate=link_rate * 1e6, host_rate=host_rate * 1e6, progress=lambda s: console.log(s) if not as_json else None,
                       command=" ".join(["kvflow", *sys.argv[1:]]) if Path(sys.argv[0]).name == "kvflow"
                       else None).report(as_json)
