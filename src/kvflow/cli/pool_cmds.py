"""`kvflow pool init|stat|probe|fsck` and `kvflow bench pool`.

The pool config comes from the CONFIG argument, else $KVFLOW_CONFIG, else ./kvflow.yaml (its `pool:` section).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvflow.cli.main import app, bench_app
from kvflow.errors import ConfigError

pool_app = typer.Typer(help="The unified KV pool: create it, inspect it, re-probe bandwidths, verify every record.",
                       no_args_is_help=True)
app.add_typer(pool_app, name="pool")

ConfigArg = typer.Argument(None, help="pool config (YAML/TOML); default $KVFLOW_CONFIG or ./kvflow.yaml",
                           show_default=False)


def _config(path: Optional[Path]) -> Path:
    path = path or Path(os.environ.get("KVFLOW_CONFIG", "kvflow.yaml"))
    if not path.is_file():
        raise ConfigError(f"pool config {path} not found (pass CONFIG or set KVFLOW_CONFIG)")
    return path


def _open(path: Optional[Path], readonly: bool = False):
    from kvflow.pool import KVPool, PoolConfig
    cfg = PoolConfig.load(_config(path))
    if cfg.index_dir is None:
        raise ConfigError("this pool has no index_dir: nothing of it persists between commands")
    return KVPool.open(cfg, readonly=readonly)


def _device_rows(st: dict) -> list[dict]:
    gib, mib = 1 << 30, 1 << 20
    return [{"#": i, "device": d["name"], "kind": d["kind"], "GiB": d["capacity"] / gib,
             "used %": 100 * d["used"] / max(d["capacity"], 1), "records": d["records"],
             "read MiB/s": d["read_bw"] / mib, "write MiB/s": d["probed_write_bw"] / mib, "p": d["p"],
             "ok": d["healthy"]} for i, d in enumerate(st["devices"])]


def _show(title: str, st: dict) -> None:
    from kvflow.report import print_table
    print_table(title, _device_rows(st))
    Console().print(f"{st['records']} records, {st['used'] / (1 << 30):.3f} of {st['capacity'] / (1 << 30):.3f} GiB "
                    f"used, pool reads at {st['read_bandwidth'] / (1 << 20):.0f} MiB/s, durability {st['durability']}")


@pool_app.command("init")
def init(config: Path = typer.Argument(..., help="pool config (YAML/TOML) to create the pool from"),
         force: bool = typer.Option(False, "--force", help="format the configured devices and index even if they "
                                                          "exist (everything stored on them is lost)")) -> None:
    """Create every device (preallocated extents, device headers), the index, and probe bandwidths. Existing files
    that are not this pool's devices are refused, never overwritten, unless --force."""
    import logging
    if force:
        _format(config)
    pool_log = logging.getLogger("kvflow.pool")
    level = pool_log.level
    pool_log.setLevel(logging.ERROR)        # a store down is this command's one error line, not a warning before it
    try:
        pool = _open(config)
    finally:
        pool_log.setLevel(level)
    with pool:
        for s in pool.slots:
            if why := s.store is not None and s.store.unreachable:     # serving starts without it; creating does not
                raise ConfigError(f"{why}: the store does not answer; check its address, or start it first")
        _show("pool created", pool.stats())


def _format(config: Path) -> None:
    """--force: check everything the config names and take every writer lock first (pool/format.py), then remove
    it so init creates it anew; a refusal deletes nothing."""
    from kvflow.pool import PoolConfig
    from kvflow.pool.format import plan
    plan(PoolConfig.load(_config(config))).run()


@pool_app.command("stat")
def stat(config: Optional[Path] = ConfigArg,
         as_json: bool = typer.Option(False, "--json", help="print the full stats as JSON")) -> None:
    """Devices, fill, records, bandwidths and ratios — read-only, safe beside a running writer."""
    with _open(config, readonly=True) as pool:
        st = pool.stats()
    if as_json:
        print(json.dumps(st, indent=2, default=str))
    else:
        _show("pool", st)


@pool_app.command("probe")
def probe(config: Optional[Path] = ConfigArg,
          size: Optional[str] = typer.Option(None, help="bytes per device, e.g. 256M (default: config)")) -> None:
    """Measure every device's read/write bandwidth again (on free space) and store it for placement."""
    from kvflow.config import parse_size
    from kvflow.pool.organizer import PROBE_CHUNK
    nbytes = parse_size(size, "--size") if size is not None else None
    if nbytes is not None and nbytes < PROBE_CHUNK:
        raise ConfigError(f"--size: at least {PROBE_CHUNK >> 20}M per device, got {size!r}")
    with _open(config) as pool:
        for i in range(len(pool.stats()["devices"])):
            if pool.probe(i, nbytes) is None:
                Console().print(f"device {i}: no free space to probe; kept its previous bandwidth")
        _show("pool probed", pool.stats())


@pool_app.command("fsck")
def fsck(config: Optional[Path] = ConfigArg,
         dry_run: bool = typer.Option(False, "--dry-run", help="report only; open read-only, drop nothing"),
         rebuild: bool = typer.Option(False, "--rebuild", help="first rebuild the index from the records on the "
                                                              "devices (a scan of every record header)")) -> None:
    """Read and verify every record (header, checksum, key, sequence); report bad ones and drop them.
    Exit status 1 when any were found."""
    if rebuild and dry_run:
        raise ConfigError("--rebuild writes a new index; it cannot be combined with --dry-run")
    with _open(config, readonly=dry_run) as pool:
        if rebuild:
            found = pool.rebuild()
            Console().print(f"rebuilt the index from {found['devices']} devices: {found['found']} intact records "
                            f"found, {found['bad']} damaged skipped; {found['records']} indexed")
        report = pool.fsck(repair=not dry_run, scan=True)
    for bad in report["bad"]:
        Console().print(f"bad record {bad['key']} on {bad['device']} at {bad['offset']}: {bad['error']}")
    verb = "dropped" if report["repaired"] else "found"
    Console().print(f"checked {report['checked']} records ({report['bytes'] / (1 << 20):.1f} MiB): "
                    f"{len(report['bad'])} bad {verb}, {report['overlaps']} overlapping extents")
    if report["unindexed"]:
        Console().print(f"{report['unindexed']} intact records on the devices are not in the index (evicted ones "
                        f"whose space was not reused yet, or lost from the index: fsck --rebuild brings them back)")
    if report["bad"] or report["overlaps"]:
        raise SystemExit(1)   # not typer.Exit: click returns (not raises) it when main() runs non-standalone


@bench_app.command("pool")
def bench_pool(quick: bool = typer.Option(False, "--quick", help="small sizes, one repeat: under a minute"),
               as_json: bool = typer.Option(False, "--json", help="print the results as JSON instead of tables"),
               out: Optional[Path] = typer.Option(None, help="output folder (default runs/pool-<timestamp>/)"),
               disk_dir: Optional[Path] = typer.Option(None, help="folder on the real disk for extent vs files "
                                                                  "(default $KVFLOW_BENCH_DISK or /var/tmp)"),
               record_kib: int = typer.Option(256, min=1, max=65536, help="record size for extent vs files"),
               only: Optional[str] = typer.Option(None, help="comma-separated sections to run: striping, "
                                                             "passthrough, lookup, loops, mixed (default: all)"),
               loop_caps: str = typer.Option("1,1,2,4", help="loops: relative kernel caps, one per loop device"),
               loop_base: float = typer.Option(25.0, help="loops: MiB/s of cap 1 (read and write)"),
               loop_data: Optional[int] = typer.Option(None, help="loops: MiB stored per placement "
                                                                  "(default 256, --quick 128)"),
               context: Optional[int] = typer.Option(None, min=256, help="long: one context of this many tokens "
                                                                          "(e.g. 131072) on the disk pool and on "
                                                                          "memory + disk; alone unless --only"),
               kv_bytes_per_token: int = typer.Option(12 * 1024, min=64, help="long: KV bytes per token")) -> None:
    """Striping vs sum of devices vs equal/overflow (token-bucket check, and on kernel-capped loop devices kvflow
    must probe); passthrough vs files on the real disk; lookup cost; a memory + disk pool."""
    from kvflow.bench import pool_bench
    from kvflow.bench.pool_loop import parse_options
    from kvflow.report import out_dir
    if disk_dir is not None and not disk_dir.is_dir():
        raise ConfigError(f"--disk-dir {disk_dir} is not a folder")
    sections, loops = parse_options(only, loop_caps, loop_base, loop_data, quick)
    if context is not None and only is None:
        sections = ("long",)
    console = Console(stderr=True)
    pool_bench.bench(out_dir("pool", out), quick=quick, disk_dir=str(disk_dir) if disk_dir else None,
                     record_kib=record_kib, progress=lambda s: console.log(s) if not as_json else None,
                     sections=sections, loops=loops, context=context, kv_bytes_per_token=kv_bytes_per_token,
                     command=" ".join(["kvflow", *sys.argv[1:]])
                     if Path(sys.argv[0]).name == "kvflow" else None).report(as_json)
