"""`kvflow bench pool`: the unified KV pool against the ways peers store KV, every figure a ratio from one run.

1. striping   — N throttled devices at 4:2:1:1: read bandwidth of bandwidth-aware striping, equal striping and
                overflow order (one device at a time, fastest first, like LMCache's tiers) over the sum of the
                devices' bandwidths measured one by one; also for the last quarter of the context only.
2. passthrough — `extent` (O_DIRECT, one preallocated file) vs `files` (one file per record) on this machine's
                real disk, page cache dropped before every read pass: throughput and CPU seconds per GiB.
3. lookup     — `longest_prefix` of a whole context vs the time to load that context's records.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

from kvflow.bench.common import odirect_supported
from kvflow.chunks.keys import chunk_keys, layer_groups
from kvflow.pool import KVPool

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


def median_time(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


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
            t_all = median_time(lambda: timed_get(pool, keys), repeats)
            t_suffix = median_time(lambda: timed_get(pool, suffix), repeats)
            share = [d["records"] / len(keys) for d in pool.stats()["devices"]]
            row = {"read_bw": moved / t_all, "suffix_bw": suffix_moved / t_suffix, "share": share}
            if placement == "bandwidth":
                dev_of = {d: dev for d, dev, *_ in pool.entries()}
                alone = []
                for i in range(len(bws)):
                    mine = [k for k in keys if dev_of[k.digest] == i]
                    progress(f"striping: device {i} alone")
                    alone.append(sum(data[k].numel() * 4 for k in mine) / median_time(lambda: timed_get(pool, mine),
                                                                                       repeats))
                out["individual_bw"] = alone
                out["sum_individual"] = sum(alone)
            out["placements"][placement] = row
    for row in out["placements"].values():
        row["ratio_to_sum"] = row["read_bw"] / out["sum_individual"]
        row["suffix_ratio_to_sum"] = row["suffix_bw"] / out["sum_individual"]
    return out


# -- 2. passthrough vs files on the real disk ---------------------------------------------------------------
def drop_page_cache(allowed: bool = True) -> str:
    """Drop the kernel page cache if allowed (root); otherwise the files device fadvises DONTNEED on every file."""
    if not allowed:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


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
        t_lookup = median_time(lambda: _timed(lambda: pool.longest_prefix(ids, FP, gs)), 15)
        for bw in links:
            progress(f"lookup: loading the context at {'memory speed' if bw is None else f'{bw / 1e9:.2f} GB/s'}")
            pool.set_throttle(bw)
            t_load = median_time(lambda: timed_get(pool, keys), 3)
            out["links"].append({"link_bw": bw, "load_s": t_load, "lookup_s": t_lookup, "share": t_lookup / t_load})
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- the command ---------------------------------------------------------------------------------------------
def run(quick: bool = False, disk_dir: str | None = None, record_kib: int = 256,
        progress: Progress = lambda s: None) -> dict:
    disk_dir = disk_dir or os.environ.get("KVFLOW_BENCH_DISK", "/var/tmp")
    repeats = 1 if quick else 3       # striping reads are long; the disk runs repeat more (noisier)
    t0 = time.perf_counter()
    results = {
        "command": "kvflow bench pool" + (" --quick" if quick else ""),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": sys.version.split()[0],
                    "torch": torch.__version__},
        "striping": striping(total_bw=(384 if quick else 1024) * MiB, weights=(4, 2, 1, 1),
                             data_bytes=(96 if quick else 512) * MiB, record_bytes=MiB, repeats=repeats,
                             progress=progress),
        "passthrough": passthrough(disk_dir, (128 if quick else 1024) * MiB, record_kib * 1024, repeats + 2,
                                   progress),
        "lookup": lookup((8192 if quick else 32768), 12 * 1024, 6, [None, 1.25e9], progress),
    }
    results["elapsed_s"] = time.perf_counter() - t0
    s, p = results["striping"]["placements"], results["passthrough"]
    results["summary"] = {
        "striped_over_sum": s["bandwidth"]["ratio_to_sum"],
        "striped_suffix_over_sum": s["bandwidth"]["suffix_ratio_to_sum"],
        "equal_over_sum": s["equal"]["ratio_to_sum"],
        "overflow_over_sum": s["overflow"]["ratio_to_sum"],
        "extent_over_files_bw": p["extent_over_files_bw"],
        "extent_cpu_s_per_gib": p["extent"]["cpu_s_per_gib"],
        "files_cpu_s_per_gib": p["files"]["cpu_s_per_gib"],
        "fs_share_of_files_fetch": p["fs_share_of_files_fetch"],
        "lookup_share_max": max(link["share"] for link in results["lookup"]["links"]),
    }
    return results


def tables(results: dict) -> list[tuple[str, list[dict]]]:
    s, p, lk = results["striping"], results["passthrough"], results["lookup"]
    mb = lambda b: b / MiB
    rows1 = [{"placement": "sum of devices alone", "read MiB/s": mb(s["sum_individual"]), "/ sum": 1.0,
              "suffix MiB/s": None, "suffix / sum": None, "records per device": None}]
    rows1 += [{"placement": name, "read MiB/s": mb(r["read_bw"]), "/ sum": r["ratio_to_sum"],
               "suffix MiB/s": mb(r["suffix_bw"]), "suffix / sum": r["suffix_ratio_to_sum"],
               "records per device": " ".join(f"{x:.2f}" for x in r["share"])} for name, r in s["placements"].items()]
    rows2 = [{"device": name, "read MiB/s": mb(p[name]["read_bw"]), "CPU s/GiB": p[name]["cpu_s_per_gib"],
              "vs files (bw)": p[name]["read_bw"] / p["files"]["read_bw"],
              "vs files (CPU)": p[name]["cpu_s_per_gib"] / p["files"]["cpu_s_per_gib"]} for name in ("extent", "files")]
    rows3 = [{"link": "memory speed" if l["link_bw"] is None else f"{l['link_bw'] * 8 / 1e9:.0f} Gbps",
              "load ms": l["load_s"] * 1e3, "lookup ms": l["lookup_s"] * 1e3, "lookup / load": l["share"]}
             for l in lk["links"]]
    caps = " ".join(f"{mb(c):.0f}" for c in s["device_caps"])
    return [(f"1. striping: {mb(s['bytes']):.0f} MiB over 4 devices capped at {caps} MiB/s", rows1),
            (f"2. passthrough vs files: {mb(p['bytes']):.0f} MiB in {p['record_bytes'] // 1024} KiB records on "
             f"{p['disk_dir']} (O_DIRECT {p['o_direct']}, page cache: {p['page_cache']}; files spent "
             f"{p['files']['fs_meta_share']:.0%} of its I/O time in open/close/fadvise)", rows2),
            (f"3. lookup of a {lk['tokens']}-token context ({lk['records']} records) vs loading it", rows3)]


def figure(results: dict, path) -> None:
    from kvflow.bench.common import save_figure
    s, p, lk = results["striping"], results["passthrough"], results["lookup"]

    def draw(axes):
        ax = axes[0]
        names = ["sum alone", *s["placements"]]
        vals = [s["sum_individual"], *(r["read_bw"] for r in s["placements"].values())]
        ax.bar(names, [v / MiB for v in vals], color=["grey", "tab:green", "tab:orange", "tab:red"])
        for i, v in enumerate(vals):
            ax.text(i, v / MiB, f"{v / s['sum_individual']:.2f}", ha="center", va="bottom")
        ax.set_ylabel("read MiB/s")
        ax.set_title("4 throttled devices (4:2:1:1)")
        ax = axes[1]
        ax.bar(["extent", "files"], [p["extent"]["read_bw"] / MiB, p["files"]["read_bw"] / MiB],
               color=["tab:green", "tab:red"])
        for i, name in enumerate(("extent", "files")):
            ax.text(i, p[name]["read_bw"] / MiB, f"{p[name]['cpu_s_per_gib']:.2f} CPU s/GiB", ha="center",
                    va="bottom")
        ax.set_ylabel("read MiB/s (page cache dropped)")
        ax.set_title("passthrough vs one file per record")
        ax = axes[2]
        labels = ["memory" if l["link_bw"] is None else f"{l['link_bw'] * 8 / 1e9:.0f} Gbps" for l in lk["links"]]
        ax.bar(labels, [100 * l["share"] for l in lk["links"]], color="tab:blue")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_ylabel("lookup time, % of load time")
        ax.set_title(f"prefix lookup, {lk['tokens']} tokens")

    save_figure(path, lambda axes: (draw(axes), [ax.margins(y=0.12) for ax in axes]), panels=3)
