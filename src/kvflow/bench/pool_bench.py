"""`kvflow bench pool`: the unified KV pool against the ways peers store KV, every figure a ratio from one run.

1. striping   — N token-bucket-throttled memory devices at 4:2:1:1: read bandwidth of bandwidth-aware striping,
                equal striping and overflow order (one device at a time, fastest first, like LMCache's tiers) over
                the sum of the devices' bandwidths measured one by one; also for the last quarter of the context.
                The caps come from the same weights the striper is given, so this is a check of the mechanism
                (striping + parallel reads), not of the organizer — sections 4 and 5 are.
2. passthrough — `extent` (O_DIRECT, one preallocated file) vs `files` (one file per record) on this machine's
                real disk, page cache dropped before every read pass: throughput and CPU seconds per GiB.
3. lookup     — `longest_prefix` of a whole context vs the time to load that context's records.
4. loops      — N loop devices capped by the kernel (cgroup v1 blkio), unknown to kvflow (``pool_loop.py``).
5. mixed      — host memory + an extent file on the real disk, both probed (``pool_loop.py``).
6. long       — one long context (``--context``, e.g. 131072 tokens) on the disk pool and on a memory + disk pool:
                store rate, read rate vs the sum of the devices alone, ``longest_prefix`` vs the load, index size.
                Only with ``--context``.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from kvflow.pool.devices import odirect_supported
from kvflow.bench.pool_loop import LoopOptions, kernel_capped_loops, mixed
from kvflow.chunks.keys import chunk_keys, layer_groups
from kvflow.pool import KVPool
from kvflow.report import BenchRun
from kvflow.stats import drop_page_cache, median_of

MiB, GiB = 1 << 20, 1 << 30
FP = "b0" * 16
Progress = Callable[[str], None]


def synthetic_context(tokens: int, record_bytes: int, groups: int = 1, chunk_tokens: int = 256, seed: int = 0):
    """Keys of one context (chunk-major) and a float32 record of ~``record_bytes`` for each."""
    ids = torch.randint(0, 32000, (tokens,), generator=torch.Generator().manual_seed(seed))
    keys = [k for row in chunk_keys(ids, FP, chunk_tokens, layer_groups(groups, 1)) for k in row]
    numel = max(record_bytes // 4 - 32, 1)
    base = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return ids, keys, {k: base.roll(i) for i, k in enumerate(keys)}


def timed_get(pool: KVPool, keys) -> float:
    t0 = time.perf_counter()
    got = pool.get_many(keys)
    took = time.perf_counter() - t0
    assert all(v is not None for v in got.values()), "benchmark records went missing"
    return took


# -- 1. striping over throttled heterogeneous devices -------------------------------------------------------
def striping(total_bw: float, weights, data_bytes: int, record_bytes: int, repeats: int, progress: Progress) -> dict:
    n = data_bytes // record_bytes
    _, keys, data = synthetic_context(n * 256, record_bytes)
    moved = sum(t.numel() * 4 for t in data.values())
    suffix = keys[-(len(keys) // 4):]
    suffix_moved = moved * len(suffix) / len(keys)
    bws = [total_bw * w / sum(weights) for w in weights]
    out: dict = {"total_cap": total_bw, "device_caps": bws, "bytes": moved, "records": len(keys), "placements": {}}
    for placement in ("bandwidth", "equal", "overflow"):
        progress(f"striping: {placement} placement")
        cfg = {"placement": placement, "chunk_tokens": 256,
               "devices": [{"type": "memory", "capacity": int(moved * 1.2) + 64 * MiB, "bandwidth": int(b)}
                           for b in bws]}
        with KVPool.open(cfg) as pool:
            pool.put_many(data)
            pool.set_throttle(total_bw)          # writes ran unthrottled; every read below is capped
            t_all = median_of(lambda: timed_get(pool, keys), repeats)
            t_suffix = median_of(lambda: timed_get(pool, suffix), repeats)
            share = [d["records"] / len(keys) for d in pool.stats()["devices"]]
            row = {"read_bw": moved / t_all, "suffix_bw": suffix_moved / t_suffix, "share": share}
            if placement == "bandwidth":
                dev_of = {d: dev for d, dev, *_ in pool.entries()}
                alone = []
                for i in range(len(bws)):
                    mine = [k for k in keys if dev_of[k.digest] == i]
                    progress(f"striping: device {i} alone")
                    alone.append(sum(data[k].numel() * 4 for k in mine) / median_of(lambda: timed_get(pool, mine),
                                                                                       repeats))
                out["individual_bw"] = alone
                out["sum_individual"] = sum(alone)
            out["placements"][placement] = row
    for row in out["placements"].values():
        row["ratio_to_sum"] = row["read_bw"] / out["sum_individual"]
        row["suffix_ratio_to_sum"] = row["suffix_bw"] / out["sum_individual"]
    return out


# -- 2. passthrough vs files on the real disk ---------------------------------------------------------------
def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)    # all threads of this process
    return r.ru_utime + r.ru_stime


def passthrough(disk_dir: str, data_bytes: int, record_bytes: int, repeats: int, progress: Progress,
                global_drop: bool = True) -> dict:
    n = data_bytes // record_bytes
    _, keys, data = synthetic_context(n * 256, record_bytes, seed=1)
    moved = sum(t.numel() * 4 for t in data.values())
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-pool-", dir=disk_dir) as tmp:
        direct = odirect_supported(tmp)
        cap = int(moved * 1.3) // MiB * MiB + 64 * MiB
        global_drop = drop_page_cache(global_drop) == "drop_caches"   # else each file is fadvised out after use
        devices = {"extent": {"type": "extent", "path": f"{tmp}/disk.img", "direct": direct},
                   "files": {"type": "files", "path": f"{tmp}/files", "drop_cache": not global_drop}}
        pools = {}
        for name, dev in devices.items():
            progress(f"passthrough: writing {moved / MiB:.0f} MiB through {name}")
            pools[name] = KVPool.open({"index_dir": f"{tmp}/{name}-index", "durability": "relaxed",
                                       "devices": [{**dev, "capacity": cap, "bandwidth": GiB, "workers": 4}]})
            pools[name].put_many(data)
            pools[name].checkpoint()
        runs: dict[str, list] = {name: [] for name in pools}
        cache = "none"
        for r in range(repeats):
            for name, pool in pools.items():             # interleaved: drift in machine load hits both alike
                progress(f"passthrough: reading via {name} ({r + 1}/{repeats})")
                cache = drop_page_cache(global_drop)
                timed_get(pool, keys[:1])     # fault our own code back in after the drop; this record stays cold
                drop_page_cache(global_drop)
                files_dev = pool.slots[0].device.inner
                meta0, data0 = getattr(files_dev, "meta_s", 0.0), getattr(files_dev, "data_s", 0.0)
                c0, t0 = cpu_seconds(), time.perf_counter()
                timed_get(pool, keys)
                wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
                runs[name].append({"wall": wall, "cpu": cpu, "meta": getattr(files_dev, "meta_s", 0.0) - meta0,
                                   "io": getattr(files_dev, "data_s", 0.0) - data0})
        for pool in pools.values():
            pool.close()
    out = {"bytes": moved, "records": len(keys), "record_bytes": record_bytes, "o_direct": direct,
           "page_cache": cache, "disk_dir": disk_dir}
    for name, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        cpu = statistics.median(r["cpu"] for r in rs)
        out[name] = {"read_bw": moved / wall, "wall_s": wall, "cpu_s_per_gib": cpu / (moved / GiB)}
    f = runs["files"]
    out["files"]["fs_meta_share"] = sum(r["meta"] for r in f) / max(sum(r["meta"] + r["io"] for r in f), 1e-9)
    out["extent_over_files_bw"] = out["extent"]["read_bw"] / out["files"]["read_bw"]
    out["files_over_extent_cpu"] = out["files"]["cpu_s_per_gib"] / out["extent"]["cpu_s_per_gib"]
    out["fs_share_of_files_fetch"] = max(0.0, 1 - out["extent"]["wall_s"] / out["files"]["wall_s"])
    return out


# -- 3. lookup cost vs the load it serves --------------------------------------------------------------------
def lookup(tokens: int, kv_bytes_per_token: int, groups: int, links: list[float | None], progress: Progress) -> dict:
    record = 256 * kv_bytes_per_token // groups
    ids, keys, data = synthetic_context(tokens, record, groups=groups, seed=2)
    moved = sum(t.numel() * 4 for t in data.values())
    gs = layer_groups(groups, 1)
    out = {"tokens": tokens, "records": len(keys), "bytes": moved, "kv_bytes_per_token": kv_bytes_per_token,
           "links": []}
    with KVPool.memory(int(moved * 1.2) + 64 * MiB, devices=2) as pool:
        pool.put_many(data)
        assert pool.longest_prefix(ids, FP, gs) == tokens // 256 * 256
        t_lookup = median_of(lambda: _timed(lambda: pool.longest_prefix(ids, FP, gs)), 15)
        for bw in links:
            progress(f"lookup: loading the context at {'memory speed' if bw is None else f'{bw / 1e9:.2f} GB/s'}")
            pool.set_throttle(bw)
            t_load = median_of(lambda: timed_get(pool, keys), 3)
            out["links"].append({"link_bw": bw, "load_s": t_load, "lookup_s": t_lookup, "share": t_lookup / t_load})
    return out


# -- 6. one long context on the disk pool and on memory + disk ------------------------------------------------
def _dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def long_context(disk_dir: str, tokens: int, kv_bytes_per_token: int, groups: int, repeats: int,
                 progress: Progress) -> dict:
    """A ``tokens``-token context (records of one chunk x one layer group) stored on an O_DIRECT extent file, then
    on memory + that file: store time and rate, whole-context read rate against the sum of each device read
    alone (the disk pool: the raw O_DIRECT rate of the file), ``longest_prefix`` of the whole context against
    the load it serves, the index's size on disk and in entries."""
    from kvflow.bench.bound import odirect_read_rate
    from kvflow.pool.devices.base import SUPERBLOCK
    record = 256 * kv_bytes_per_token // groups
    ids, keys, data = synthetic_context(tokens, record, groups=groups, seed=6)
    gs = layer_groups(groups, 1)
    moved = sum(t.numel() * 4 for t in data.values())
    cap = int(moved * 1.3) // MiB * MiB + 128 * MiB
    out = {"tokens": tokens, "records": len(keys), "bytes": moved, "kv_bytes_per_token": kv_bytes_per_token,
           "disk_dir": disk_dir, "pools": {}}
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-long-", dir=disk_dir) as tmp:
        direct = odirect_supported(tmp)
        out["o_direct"] = direct
        for name in ("disk", "memory+disk"):
            path = os.path.join(tmp, f"{name}.img")
            devices = [{"type": "extent", "path": path, "capacity": cap, "direct": direct}]
            if name == "memory+disk":
                devices.insert(0, {"type": "memory", "capacity": cap})
            index = os.path.join(tmp, f"{name}-index")
            progress(f"long context: storing {tokens} tokens ({moved / MiB:.0f} MiB) on the {name} pool")
            with KVPool.open({"index_dir": index, "durability": "relaxed", "chunk_tokens": 256,
                              "devices": devices}) as pool:
                t0 = time.perf_counter()
                pool.put_many(data)
                pool.checkpoint()
                store_s = time.perf_counter() - t0
                held = pool.longest_prefix(ids, FP, gs)
                assert held == tokens // 256 * 256, (held, tokens)
                progress(f"long context: reading it back from the {name} pool")
                t_all = median_of(lambda: timed_get(pool, keys), repeats)
                t_lookup = median_of(lambda: _timed(lambda: pool.longest_prefix(ids, FP, gs)), 7)
                dev_of = {d: dev for d, dev, *_ in pool.entries()}
                alone = []
                for i in range(len(devices)):
                    mine = [k for k in keys if dev_of[k.digest] == i]
                    alone.append(sum(data[k].numel() * 4 for k in mine) / median_of(lambda: timed_get(pool, mine),
                                                                                       repeats) if mine else 0.0)
                extent_bytes = sum(e[3] for e in pool.entries() if e[1] == len(devices) - 1)
                entries = len(list(pool.entries()))
            raw = (odirect_read_rate(path, extent_bytes // MiB * MiB, 4, offset=SUPERBLOCK)
                   if direct and extent_bytes >= 16 * MiB else None)
            row = {"store_s": store_s, "store_bw": moved / store_s, "store_tokens_per_s": tokens / store_s,
                   "read_s": t_all, "read_bw": moved / t_all, "device_alone_bw": alone, "sum_alone": sum(alone),
                   "ratio_to_sum": moved / t_all / sum(alone), "extent_raw_alone_bw": raw,
                   "lookup_s": t_lookup, "lookup_share_of_load": t_lookup / t_all,
                   "index_bytes": _dir_bytes(index), "index_entries": entries}
            if raw is not None and name == "disk":
                row["ratio_to_raw_disk"] = row["read_bw"] / raw
            out["pools"][name] = row
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the command ---------------------------------------------------------------------------------------------
SECTIONS = ("striping", "passthrough", "lookup", "loops", "mixed", "long")


def run(quick: bool = False, disk_dir: str | None = None, record_kib: int = 256,
        progress: Progress = lambda s: None, sections=SECTIONS, loops: LoopOptions | None = None,
        command: str | None = None, context: int | None = None, kv_bytes_per_token: int = 12 * 1024,
        groups: int = 6) -> dict:
    disk_dir = disk_dir or os.environ.get("KVFLOW_BENCH_DISK", "/var/tmp")
    repeats = 1 if quick else 3       # striping reads are long; the disk runs repeat more (noisier)
    loops = loops or LoopOptions(data_bytes=(128 if quick else 256) * MiB)
    t0 = time.perf_counter()
    results = {
        "command": command or "kvflow bench pool" + (" --quick" if quick else ""),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": sys.version.split()[0],
                    "torch": torch.__version__},
    }
    if "striping" in sections:
        results["striping"] = striping(total_bw=(384 if quick else 1024) * MiB, weights=(4, 2, 1, 1),
                                       data_bytes=(96 if quick else 512) * MiB, record_bytes=MiB, repeats=repeats,
                                       progress=progress)
    if "passthrough" in sections:
        results["passthrough"] = passthrough(disk_dir, (128 if quick else 1024) * MiB, record_kib * 1024,
                                             repeats + 2, progress)
    if "lookup" in sections:
        results["lookup"] = lookup((8192 if quick else 32768), 12 * 1024, 6, [None, 1.25e9], progress)
    if "loops" in sections:
        results["loops"] = kernel_capped_loops(loops, disk_dir, progress)
    if "mixed" in sections:
        results["mixed"] = mixed(disk_dir, (64 if quick else 256) * MiB, MiB, max(repeats, 2), progress)
    if "long" in sections and context:
        results["long"] = long_context(disk_dir, context, kv_bytes_per_token, groups, max(repeats, 2), progress)
    results["elapsed_s"] = time.perf_counter() - t0
    results["summary"] = summary(results)
    return results


def bench(folder: Path, **kw) -> BenchRun:
    """``run(**kw)`` and its figure in ``folder``: ``kvflow bench pool``."""
    results = run(**kw)
    figure(results, folder / "pool.png")
    return BenchRun(results, folder, tables(results),
                    f"results: {folder / 'results.json'}, figure: {folder / 'pool.png'}")


def summary(results: dict) -> dict:
    out = {}
    if "striping" in results:
        s = results["striping"]["placements"]
        out |= {"striped_over_sum": s["bandwidth"]["ratio_to_sum"],
                "striped_suffix_over_sum": s["bandwidth"]["suffix_ratio_to_sum"],
                "equal_over_sum": s["equal"]["ratio_to_sum"], "overflow_over_sum": s["overflow"]["ratio_to_sum"]}
    if "passthrough" in results:
        p = results["passthrough"]
        out |= {"extent_over_files_bw": p["extent_over_files_bw"], "extent_cpu_s_per_gib": p["extent"]["cpu_s_per_gib"],
                "files_cpu_s_per_gib": p["files"]["cpu_s_per_gib"],
                "fs_share_of_files_fetch": p["fs_share_of_files_fetch"]}
    if "lookup" in results:
        out["lookup_share_max"] = max(link["share"] for link in results["lookup"]["links"])
    if "loops" in results:
        lp = results["loops"]
        if "skipped" in lp:
            out["loops"] = lp["skipped"]
        else:
            out |= {"loops_striped_over_sum_alone": lp["placements"]["bandwidth"]["ratio_to_sum"],
                    "loops_equal_over_sum_alone": lp["placements"]["equal"]["ratio_to_sum"],
                    "loops_overflow_over_sum_alone": lp["placements"]["overflow"]["ratio_to_sum"],
                    "loops_max_probed_ratio_error": lp["max_ratio_error"]}
    if "mixed" in results:
        out["mixed_striped_over_sum_alone"] = results["mixed"]["ratio_to_sum"]
    if "long" in results:
        for name, r in results["long"]["pools"].items():
            out[f"long_{name}_over_sum_alone"] = r["ratio_to_sum"]
            out[f"long_{name}_lookup_share_of_load"] = r["lookup_share_of_load"]
    return out


def tables(results: dict) -> list[tuple[str, list[dict]]]:
    out = []
    if "striping" in results:
        out += _striping_table(results["striping"])
    if "passthrough" in results:
        out += _passthrough_table(results["passthrough"])
    if "lookup" in results:
        out += _lookup_table(results["lookup"])
    if "loops" in results:
        out += _loops_tables(results["loops"])
    if "mixed" in results:
        out += _mixed_table(results["mixed"])
    if "long" in results:
        out += _long_table(results["long"])
    return out


def _long_table(lc: dict) -> list:
    mb = lambda b: b / MiB
    rows = [{"pool": name, "store s": r["store_s"], "store MiB/s": mb(r["store_bw"]), "read MiB/s": mb(r["read_bw"]),
             "sum alone MiB/s": mb(r["sum_alone"]), "/ sum": r["ratio_to_sum"],
             "raw disk MiB/s": mb(r["extent_raw_alone_bw"]) if r["extent_raw_alone_bw"] else None,
             "lookup ms": r["lookup_s"] * 1e3, "lookup / load": r["lookup_share_of_load"],
             "index KiB": r["index_bytes"] / 1024, "entries": r["index_entries"]} for name, r in lc["pools"].items()]
    return [(f"6. a {lc['tokens']}-token context ({mb(lc['bytes']):.0f} MiB, {lc['records']} records) on "
             f"{lc['disk_dir']} (O_DIRECT {lc['o_direct']})", rows)]


def _striping_table(s: dict) -> list:
    mb = lambda b: b / MiB
    rows1 = [{"placement": "sum of devices alone", "read MiB/s": mb(s["sum_individual"]), "/ sum": 1.0,
              "suffix MiB/s": None, "suffix / sum": None, "records per device": None}]
    rows1 += [{"placement": name, "read MiB/s": mb(r["read_bw"]), "/ sum": r["ratio_to_sum"],
               "suffix MiB/s": mb(r["suffix_bw"]), "suffix / sum": r["suffix_ratio_to_sum"],
               "records per device": " ".join(f"{x:.2f}" for x in r["share"])} for name, r in s["placements"].items()]
    caps = " ".join(f"{mb(c):.0f}" for c in s["device_caps"])
    return [(f"1. striping (token-bucket check): {mb(s['bytes']):.0f} MiB over 4 memory devices capped at {caps} "
             f"MiB/s", rows1)]


def _passthrough_table(p: dict) -> list:
    mb = lambda b: b / MiB
    rows2 = [{"device": name, "read MiB/s": mb(p[name]["read_bw"]), "CPU s/GiB": p[name]["cpu_s_per_gib"],
              "vs files (bw)": p[name]["read_bw"] / p["files"]["read_bw"],
              "vs files (CPU)": p[name]["cpu_s_per_gib"] / p["files"]["cpu_s_per_gib"]} for name in ("extent", "files")]
    return [(f"2. passthrough vs files: {mb(p['bytes']):.0f} MiB in {p['record_bytes'] // 1024} KiB records on "
             f"{p['disk_dir']} (O_DIRECT {p['o_direct']}, page cache: {p['page_cache']}; files spent "
             f"{p['files']['fs_meta_share']:.0%} of its I/O time in open/close/fadvise)", rows2)]


def _lookup_table(lk: dict) -> list:
    rows3 = [{"link": "memory speed" if l["link_bw"] is None else f"{l['link_bw'] * 8 / 1e9:.0f} Gbps",
              "load ms": l["load_s"] * 1e3, "lookup ms": l["lookup_s"] * 1e3, "lookup / load": l["share"]}
             for l in lk["links"]]
    return [(f"3. lookup of a {lk['tokens']}-token context ({lk['records']} records) vs loading it", rows3)]


def _loops_tables(lp: dict) -> list:
    mb = lambda b: b / MiB
    if "skipped" in lp:
        return [(f"4. {lp['skipped']}", [])]
    rows_dev = [{"device": path, "cap MiB/s": mb(d["cap"]), "probed MiB/s": mb(d["probed"]),
                 "alone O_DIRECT MiB/s": mb(d["raw_alone"]), "cap share": d["cap_share"], "p (probed)": d["p"],
                 "p / cap share": d["p_over_cap_share"]} for path, d in zip(lp["loop_devices"], lp["devices"])]
    rows = [{"placement": "sum of devices alone (O_DIRECT)", "read MiB/s": mb(lp["sum_raw_alone"]), "/ sum": 1.0,
             "/ sum alone via pool": lp["sum_raw_alone"] / lp["sum_pool_alone"], "records per device": None}]
    rows += [{"placement": name, "read MiB/s": mb(r["read_bw"]), "/ sum": r["ratio_to_sum"],
              "/ sum alone via pool": r["ratio_to_pool_alone_sum"],
              "records per device": " ".join(f"{x:.2f}" for x in r["share"])} for name, r in lp["placements"].items()]
    caps = ":".join(f"{c:g}" for c in lp["options"]["caps"])
    return [(f"4a. kernel-capped loop devices ({caps} x {mb(lp['options']['base']):.0f} MiB/s, cgroup v1 blkio; "
             f"kvflow probed them)", rows_dev),
            (f"4b. striping {mb(lp['bytes']):.0f} MiB over them (each placement on fresh devices, same caps)", rows)]


def _mixed_table(m: dict) -> list:
    mb = lambda b: b / MiB
    rows = [{"device": name, "probed MiB/s": mb(b), "alone MiB/s": mb(a), "records": sh}
            for name, b, a, sh in zip(("memory", "extent (disk)"), m["probed_read_bw"], m["pool_alone_bw"],
                                      m["share"])]
    rows.append({"device": "striped (both)", "probed MiB/s": None, "alone MiB/s": mb(m["read_bw"]),
                 "records": m["ratio_to_sum"]})
    return [(f"5. mixed pool: memory + extent file on {m['disk_dir']}, {mb(m['bytes']):.0f} MiB; last row: striped "
             f"read and its ratio to the sum alone", rows)]


def figure(results: dict, path) -> None:
    """One panel per section that ran (loops: two — probed vs cap, and the placements over the sum alone)."""
    from kvflow.report import save_figure
    panels = []
    if "striping" in results:
        panels.append(_draw_striping)
    if "passthrough" in results:
        panels.append(_draw_passthrough)
    if "lookup" in results:
        panels.append(_draw_lookup)
    if "loops" in results and "skipped" not in results["loops"]:
        panels += [_draw_loop_probe, _draw_loop_placements]
    if "mixed" in results:
        panels.append(_draw_mixed)
    panels += [_long_panel(name) for name in results.get("long", {}).get("pools", {})]
    if not panels:
        return

    def draw(axes):
        for ax, fn in zip(axes, panels):
            fn(ax, results)
            ax.margins(y=0.12)

    save_figure(path, draw, panels=len(panels))


def _bars_over_sum(ax, total: float, named: dict[str, float], title: str, ylabel: str = "read MiB/s") -> None:
    names, vals = ["sum alone", *named], [total, *named.values()]
    ax.bar(names, [v / MiB for v in vals], color=["grey", "tab:green", "tab:orange", "tab:red"][:len(vals)])
    for i, v in enumerate(vals):
        ax.text(i, v / MiB, f"{v / total:.2f}", ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def _draw_striping(ax, results) -> None:
    s = results["striping"]
    _bars_over_sum(ax, s["sum_individual"], {n: r["read_bw"] for n, r in s["placements"].items()},
                   "token-bucket devices (4:2:1:1)")


def _draw_passthrough(ax, results) -> None:
    p = results["passthrough"]
    ax.bar(["extent", "files"], [p["extent"]["read_bw"] / MiB, p["files"]["read_bw"] / MiB],
           color=["tab:green", "tab:red"])
    for i, name in enumerate(("extent", "files")):
        ax.text(i, p[name]["read_bw"] / MiB, f"{p[name]['cpu_s_per_gib']:.2f} CPU s/GiB", ha="center", va="bottom")
    ax.set_ylabel("read MiB/s (page cache dropped)")
    ax.set_title("passthrough vs one file per record")


def _draw_lookup(ax, results) -> None:
    lk = results["lookup"]
    labels = ["memory" if l["link_bw"] is None else f"{l['link_bw'] * 8 / 1e9:.0f} Gbps" for l in lk["links"]]
    ax.bar(labels, [100 * l["share"] for l in lk["links"]], color="tab:blue")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_ylabel("lookup time, % of load time")
    ax.set_title(f"prefix lookup, {lk['tokens']} tokens")


def _draw_loop_probe(ax, results) -> None:
    lp = results["loops"]
    xs = range(len(lp["devices"]))
    ax.bar([x - 0.2 for x in xs], [d["cap"] / MiB for d in lp["devices"]], width=0.4, color="grey", label="cap")
    ax.bar([x + 0.2 for x in xs], [d["probed"] / MiB for d in lp["devices"]], width=0.4, color="tab:green",
           label="probed by kvflow")
    for x, d in zip(xs, lp["devices"]):
        ax.text(x + 0.2, d["probed"] / MiB, f"{d['p_over_cap_share']:.2f}", ha="center", va="bottom")
    ax.set_xticks(list(xs), [os.path.basename(p) for p in lp["loop_devices"]])
    ax.set_ylabel("MiB/s (label: p_i / cap share)")
    ax.set_title("kernel-capped loops: probe vs cap")
    ax.legend(fontsize=8)


def _draw_loop_placements(ax, results) -> None:
    lp = results["loops"]
    caps = ":".join(f"{c:g}" for c in lp["options"]["caps"])
    _bars_over_sum(ax, lp["sum_raw_alone"], {n: r["read_bw"] for n, r in lp["placements"].items()},
                   f"kernel-capped loops ({caps}), / sum O_DIRECT alone")


def _long_panel(name: str):
    """One long-context pool (``--context N``): its read rate over the sum of its devices read alone."""
    def draw(ax, results) -> None:
        lc = results["long"]
        p = lc["pools"][name]
        _bars_over_sum(ax, p["sum_alone"], {"pool": p["read_bw"]}, f"{lc['tokens']:,} tokens: {name}")
    return draw


def _draw_mixed(ax, results) -> None:
    m = results["mixed"]
    _bars_over_sum(ax, m["sum_pool_alone"], {"striped": m["read_bw"]}, "memory + disk extent")
