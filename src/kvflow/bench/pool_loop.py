"""`kvflow bench pool`, the honest striping runs: devices whose speed kvflow does not set.

4. kernel-capped loops — N loop devices, each capped by the kernel (cgroup v1 blkio, caps e.g. 1:1:2:4 x base),
   opened by the pool as raw ``extent`` devices. The organizer probes them (it is never told the caps) and derives
   p_i; reported: probed ratio vs cap ratio per device, and the striped read (bandwidth-aware, equal, overflow —
   each on fresh devices with the same caps) over the sum of each device read alone with O_DIRECT in the same run.
5. mixed — host memory + an extent file on the real disk, both probed: striped read over the sum of each alone.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Callable

from kvflow.bench import loopdev
from kvflow.bench.bound import odirect_read_rate
from kvflow.errors import ConfigError
from kvflow.pool import KVPool
from kvflow.pool.devices.base import SUPERBLOCK
from kvflow.stats import median_of

MiB = 1 << 20
Progress = Callable[[str], None]


@dataclass(slots=True)
class LoopOptions:
    caps: tuple[float, ...] = (1, 1, 2, 4)     # relative read (and write) caps of the devices
    base: float = 25 * MiB                     # bytes/s of cap 1
    data_bytes: int = 256 * MiB                # stored and read back per placement
    record_bytes: int = MiB
    repeats: int = 3
    alone_s: float = 2.0                       # seconds of O_DIRECT reading per device alone (at its cap)
    workers: int = 4                           # I/O threads per device, the pool's and the lone reader's
    probe_seconds: float = 1.0                 # the pool's probe reads each device at least this long


def parse_options(only: str | None, caps: str, base_mib: float, data_mib: int | None, quick: bool):
    """CLI text -> (sections, LoopOptions); ConfigError naming the option on bad input."""
    from kvflow.bench.pool_bench import SECTIONS
    sections = SECTIONS
    if only is not None:
        sections = tuple(x.strip() for x in only.split(",") if x.strip())
        unknown = [x for x in sections if x not in SECTIONS]
        if unknown or not sections:
            raise ConfigError(f"--only: unknown section {', '.join(unknown) or '(none)'} "
                              f"(known: {', '.join(SECTIONS)})")
    try:
        weights = tuple(float(x) for x in caps.split(","))
    except ValueError:
        raise ConfigError(f"--loop-caps: a comma-separated list of numbers, got {caps!r}") from None
    if not 1 <= len(weights) <= 8 or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"--loop-caps: 1 to 8 positive numbers, got {caps!r}")
    if not (math.isfinite(base_mib) and 1 <= base_mib <= 10_000):
        raise ConfigError(f"--loop-base: MiB/s between 1 and 10000, got {base_mib!r}")
    data = data_mib if data_mib is not None else (128 if quick else 256)
    if not 8 <= data <= 64 * 1024:
        raise ConfigError(f"--loop-data: MiB between 8 and 65536, got {data}")
    return sections, LoopOptions(caps=weights, base=base_mib * MiB, data_bytes=data * MiB,
                                 repeats=3)


def _share(pool: KVPool, n: int) -> list[float]:
    return [d["records"] / n for d in pool.stats()["devices"]]


def kernel_capped_loops(opts: LoopOptions, disk_dir: str, progress: Progress) -> dict:
    """Section 4; ``{"skipped": why}`` where the machine cannot make capped loop devices."""
    from kvflow.bench.pool_bench import synthetic_context, timed_get
    why = loopdev.unavailable()
    if why is not None:
        return {"skipped": f"kernel-capped loop devices skipped: {why}"}
    caps = [int(opts.base * c) for c in opts.caps]
    _, keys, data = synthetic_context(opts.data_bytes // opts.record_bytes * 256, opts.record_bytes, seed=4)
    moved = sum(t.numel() * 4 for t in data.values())
    size = int(moved * 1.25) // MiB * MiB + 160 * MiB      # overflow may put everything on one device, + probe room
    out: dict = {"options": {**asdict(opts), "caps": list(opts.caps)}, "caps": caps, "bytes": moved,
                 "records": len(keys), "device_bytes": size, "placements": {}}
    rig = loopdev.CappedLoops(disk_dir, size, caps, caps)
    try:
        rig.start()
    except OSError as err:                                  # e.g. every loop device in use, cgroup refused
        return {"skipped": f"kernel-capped loop devices skipped: could not set them up ({err})"}
    idx = tempfile.mkdtemp(prefix="kvflow-loop-index-", dir=disk_dir)
    try:
        with rig:
            out["cgroup"] = str(rig.cgroup)
            out["loop_devices"] = [d.path for d in rig.devices]
            out["direct_io"] = [_dio(d.path) for d in rig.devices]
            probed = None
            for placement in ("bandwidth", "equal", "overflow"):
                devices = rig.devices if placement == "bandwidth" else rig.renew()
                order = list(range(len(devices)))
                if placement == "overflow":        # fastest first, as kvflow probed them (LMCache's tier order)
                    order.sort(key=lambda i: -probed[i])
                dev_cfg = [{"type": "extent", "path": devices[i].path, "capacity": size - SUPERBLOCK,
                            "workers": opts.workers, **({"bandwidth": int(probed[i])} if probed else {})}
                           for i in order]
                progress(f"loops: {placement} placement on {', '.join(d['path'] for d in dev_cfg)}"
                         + (" (probing)" if probed is None else ""))
                cfg = {"index_dir": os.path.join(idx, placement), "durability": "relaxed", "placement": placement,
                       "chunk_tokens": 256, "probe_seconds": opts.probe_seconds, "devices": dev_cfg}
                with KVPool.open(cfg) as pool:
                    if probed is None:
                        probed = [d["probed_read_bw"] for d in pool.stats()["devices"]]
                        out["probed_write_bw"] = [d["probed_write_bw"] for d in pool.stats()["devices"]]
                    pool.put_many(data)
                    pool.checkpoint()
                    t_all = median_of(lambda: timed_get(pool, keys), opts.repeats)
                    share = [0.0] * len(order)
                    for j, x in enumerate(_share(pool, len(keys))):
                        share[order[j]] = x                # by device (cap order), whatever the pool's order
                    row = {"read_bw": moved / t_all, "pool_order": order, "share": share}
                    if placement == "bandwidth":
                        dev_of = {d: dev for d, dev, *_ in pool.entries()}
                        alone, written = [], []
                        for i in range(len(devices)):
                            mine = [k for k in keys if dev_of[k.digest] == i]
                            written.append(sum(e[3] for e in pool.entries() if e[1] == i))
                            progress(f"loops: device {i} alone through the pool")
                            alone.append(sum(data[k].numel() * 4 for k in mine)
                                         / median_of(lambda: timed_get(pool, mine), opts.repeats) if mine else 0.0)
                        out["pool_alone_bw"] = alone
                    out["placements"][placement] = row
                if placement == "bandwidth":
                    raw = []
                    for i, d in enumerate(devices):
                        n = max(16 * MiB, min(written[i], int(caps[i] * opts.alone_s))) // MiB * MiB
                        progress(f"loops: {d.path} alone, O_DIRECT ({n // MiB} MiB)")
                        raw.append(statistics.median(odirect_read_rate(d.path, n, opts.workers, offset=SUPERBLOCK)
                                                     for _ in range(opts.repeats)))
                    out["raw_alone_bw"] = raw
        out["torn_down"] = True
    finally:
        shutil.rmtree(idx, ignore_errors=True)
    total_cap, total_probe, total_raw = sum(caps), sum(probed), sum(out["raw_alone_bw"])
    out["probed_read_bw"] = probed
    out["devices"] = [{"cap": c, "probed": b, "raw_alone": r, "pool_alone": a, "cap_share": c / total_cap,
                       "p": b / total_probe, "p_over_cap_share": (b / total_probe) / (c / total_cap)}
                      for c, b, r, a in zip(caps, probed, out["raw_alone_bw"], out["pool_alone_bw"])]
    out["sum_raw_alone"] = total_raw
    out["sum_pool_alone"] = sum(out["pool_alone_bw"])
    for row in out["placements"].values():
        row["ratio_to_sum"] = row["read_bw"] / total_raw
        row["ratio_to_pool_alone_sum"] = row["read_bw"] / out["sum_pool_alone"]
    out["max_ratio_error"] = max(abs(d["p_over_cap_share"] - 1) for d in out["devices"])
    return out


def _dio(path: str) -> bool | None:
    try:
        with open(f"/sys/block/{os.path.basename(path)}/loop/dio") as f:
            return f.read().strip() == "1"
    except OSError:
        return None


def mixed(disk_dir: str, data_bytes: int, record_bytes: int, repeats: int, progress: Progress) -> dict:
    """Section 5: a pool of host memory + an extent file on the real disk, both probed by the organizer."""
    from kvflow.pool.devices import odirect_supported
    from kvflow.bench.pool_bench import synthetic_context, timed_get
    _, keys, data = synthetic_context(data_bytes // record_bytes * 256, record_bytes, seed=5)
    moved = sum(t.numel() * 4 for t in data.values())
    cap = int(moved * 1.3) // MiB * MiB + 128 * MiB
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-mixed-", dir=disk_dir) as tmp:
        direct = odirect_supported(tmp)
        path = os.path.join(tmp, "disk.img")
        cfg = {"index_dir": os.path.join(tmp, "index"), "durability": "relaxed", "chunk_tokens": 256,
               "devices": [{"type": "memory", "capacity": cap}, {"type": "extent", "path": path, "capacity": cap,
                                                                 "direct": direct}]}
        progress("mixed: memory + extent file on the disk (probing)")
        with KVPool.open(cfg) as pool:
            st = pool.stats()["devices"]
            probed = [d["probed_read_bw"] for d in st]
            pool.put_many(data)
            pool.checkpoint()
            t_all = median_of(lambda: timed_get(pool, keys), repeats)
            share = _share(pool, len(keys))
            dev_of = {d: dev for d, dev, *_ in pool.entries()}
            alone = []
            for i, name in enumerate(("memory", "extent")):
                mine = [k for k in keys if dev_of[k.digest] == i]
                progress(f"mixed: {name} alone")
                alone.append(sum(data[k].numel() * 4 for k in mine) / median_of(lambda: timed_get(pool, mine), repeats)
                             if mine else 0.0)
            extent_bytes = sum(e[3] for e in pool.entries() if e[1] == 1)
        raw_disk = None
        if direct and extent_bytes >= 16 * MiB:
            progress("mixed: extent file alone, O_DIRECT")
            raw_disk = statistics.median(odirect_read_rate(path, extent_bytes // MiB * MiB, 4, offset=SUPERBLOCK)
                                         for _ in range(repeats))
    out = {"bytes": moved, "records": len(keys), "o_direct": direct, "disk_dir": disk_dir,
           "probed_read_bw": probed, "share": share, "pool_alone_bw": alone, "sum_pool_alone": sum(alone),
           "read_bw": moved / t_all, "extent_raw_alone_bw": raw_disk}
    out["ratio_to_sum"] = out["read_bw"] / out["sum_pool_alone"]
    return out
